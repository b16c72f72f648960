"""In-flight batching engine for the ChatTTS GPT.

A single loop thread owns the model, the paged KV cache and all per-slot state. Each iteration it
admits waiting requests (one batched prefill; while busy, only once enough wait or the oldest has
waited a few steps), runs one decode step for every active request, samples, and retires the
finished ones through their callbacks. Running requests stay compacted in slots 0..B-1 (a finished
request's slot takes the last one's state and block table row). Each request's tokens depend only on
its own prompt, params and seed (per-slot positions, per-request counter-based sampling), not on its
slot, its pages or its batchmates. One host sync per decode step.

The KV cache is a pool of pages (`config.KV_PAGE_TOKENS` positions each, page 0 scratch); a request
holds the pages its positions reach, one more each time it crosses a page. The pool is sized for the
typical request, not for every slot at the full context: when a step needs more pages than are free,
the newest running requests are suspended (their pages, tokens and sampling state copied to the host,
their pages freed) and go back to the head of the queue; once pages are free again they resume
exactly where they stopped, bit for bit. Admission keeps a page per running request in reserve.

Beside this file: who joins the batch each iteration, how many pages each request gets and whom to suspend
is decided by `scheduler.py` (`Scheduler`; the engine does the tensor work its decisions imply); each slot's
sampling state, packed on the device, is named by `row_params.py` (`RowParams`); the cumulative counters
behind `Engine.stats()` are `stats.py` (`EngineStats`).

`model` is `ChatTTSGPT` or its TorchScript export (same methods).
"""

from __future__ import annotations

import collections
import inspect
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch import Tensor

from ..config import ADMIT_BATCH, ADMIT_WAIT_STEPS, AUDIO_EOS, KV_PAGE_TOKENS, REPETITION_WINDOW
from ..model import attention, sampling
from .graphs import GraphCache, bucket, to_host
from .row_params import RowParams
from .scheduler import Admission, Scheduler, Suspended
from .stats import EngineStats

log = logging.getLogger(__name__)

MAX_EMPTY_RETRIES = 16  # ensure_non_empty re-draws of the first step before giving up


@dataclass
class SamplingParams:
    temperature: float
    top_p: Optional[float]  # None: off (upstream passes None to skip the warper)
    top_k: Optional[int]
    repetition_penalty: float
    max_new_tokens: int
    min_new_tokens: int
    seed: int
    ensure_non_empty: bool = True


@dataclass
class GenRequest:
    """One generation. `mode` "code": audio codes through the 4 code heads (EOS = code 625);
    "text": refine-text through the text head (EOS = `eos_id`)."""

    text_ids: Tensor  # int64 [N]
    params: SamplingParams
    on_done: Callable[["GenResult"], None]
    mode: str = "code"
    audio_codes: Optional[Tensor] = None  # int64 [P, num_vq] appended after the text (spk_smp)
    spk_emb: Optional[Tensor] = None  # float [hidden] written at every spk_emb_id position
    spk_emb_id: int = -1
    eos_id: int = AUDIO_EOS
    want_hidden: bool = True
    cancelled: bool = False
    cancelled_at: Optional[float] = None  # time.perf_counter() of the first cancel(): the engine times the release
    # streaming: on_tokens(tokens, hiddens) gets the tokens generated since its last call once
    # there are at least `stream_every` of them (on the engine thread, one step later, after the
    # step's own host sync: hand off, never block). The consumer may change stream_every at any
    # time; the tail arrives in on_done's result.
    on_tokens: Optional[Callable[[Tensor, Optional[Tensor]], None]] = None
    stream_every: int = 1

    @property
    def prompt_len(self) -> int:
        return int(self.text_ids.numel()) + (0 if self.audio_codes is None else int(self.audio_codes.shape[0]))

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled_at = time.perf_counter()
        self.cancelled = True


@dataclass
class GenResult:
    tokens: Optional[Tensor]  # code: int64 [n, num_vq]; text: int64 [n]
    hiddens: Optional[Tensor]  # float32 [n, hidden] (code mode with want_hidden)
    finish_reason: str  # "eos" | "max_tokens" | "cancelled" | "error"
    error: Optional[BaseException] = None
    steps: int = 0
    # CUDA: tokens/hiddens are pinned host copies, complete once this event has (recorded by the
    # engine right after the copies, so waiting on it never waits for a later step)
    ready: Optional[Any] = None

    def wait(self) -> "GenResult":
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self


class EngineError(RuntimeError):
    pass


class _Slot:
    __slots__ = ("req", "idx", "attempt", "emitted", "seq", "saved", "_eng")

    def __init__(self, eng: "Engine", req: GenRequest, idx: int, seq: int):
        self._eng = eng
        self.req = req
        self.idx = idx  # slot; changes when finished requests below it are compacted away
        self.attempt = 0
        self.emitted = 0  # tokens handed to req.on_tokens
        self.seq = seq  # admission order: the newest running requests are suspended first
        self.saved: Optional[tuple] = None  # while suspended: its pages' keys/values and its slot state

    @property
    def n(self) -> int:  # tokens generated (kept) so far
        return int(self._eng.h_n[self.idx])

    @property
    def plen(self) -> int:
        return int(self._eng.h_plen[self.idx])


def paged_interface(model) -> bool:
    """Whether `model` (ChatTTSGPT or its TorchScript export) takes block tables (`tables`); a gpt.pt
    exported before the paged cache takes a slot range instead."""
    try:
        if isinstance(model, torch.jit.ScriptModule):
            names = [a.name for a in model.forward.schema.arguments]
        else:
            names = list(inspect.signature(model.forward).parameters)
    except Exception:  # noqa: BLE001 - an unusual wrapper: let the first step tell
        return True
    return "tables" in names


def _check_model(model) -> None:
    if not paged_interface(model):
        raise EngineError("the GPT model was exported before the paged KV cache: re-export it (python -m export), "
                          "or run the eager module built from its weights (gpt.eager_from_script)")


class Engine:
    def __init__(
        self,
        model,
        *,
        max_slots: int,
        max_context: int,
        max_new_tokens: int,
        hidden: int,
        num_vq: int,
        device: str | torch.device = "cpu",
        cache_dtype: torch.dtype = torch.float32,
        compute_dtype: torch.dtype = torch.float32,
        max_prefill_tokens: int = 4096,
        cache_tokens: Optional[int] = None,
        cuda_graphs: bool = True,
        admit_batch: int = ADMIT_BATCH,
        admit_wait_steps: int = ADMIT_WAIT_STEPS,
        max_pending: int = 0,
        compile_step: bool = False,
        compile_prefill: bool = False,
        decode_kernel: Optional[bool] = None,
        start: bool = True,
    ):
        """admit_batch / admit_wait_steps / max_prefill_tokens: the admission policy (`Scheduler`): while
        requests are running, waiting ones are admitted (one batched prefill of at most max_prefill_tokens
        prompt positions) once `admit_batch` of them (or as many as there are free slots) wait, or the
        oldest has waited `admit_wait_steps` decode steps; an idle engine admits at once.
        max_pending: running + waiting requests at which `full()` says yes (0: never); the engine itself
        accepts every submit, its callers refuse.
        compile_step, compile_prefill: see `compile_step` (the model must be the eager module).
        decode_kernel: decode steps of the eager module read each row's own keys only
        (`attention.decode_attention`); None: where its GPU kernel runs (True elsewhere: its dense PyTorch
        reference, for tests). TorchScript models: never.
        cache_tokens: positions the paged KV cache holds, all requests together (None: max_slots ×
        max_context, which never suspends a request); at least one request of the full context."""
        _check_model(model)
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the engine thread needs the index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.decode_kernel = False  # the model's decode steps read each row's own keys (attn_len unused)
        if isinstance(model, torch.jit.ScriptModule) or not hasattr(model, "decode_kernel"):
            if decode_kernel:
                raise EngineError("decode_kernel needs the eager GPT module (chattts_triton.model.gpt), not TorchScript")
        else:
            model.decode_kernel = self.decode_kernel = bool(
                attention.kernel_available(self.device, model.head_dim) if decode_kernel is None else decode_kernel)
        self.max_slots = max_slots
        self.max_context = max_context
        self.page = KV_PAGE_TOKENS
        self.table_width = -(-max_context // self.page)  # pages of one request at the full context
        usable = self.table_width * max_slots if cache_tokens is None else -(-cache_tokens // self.page)
        if usable < self.table_width:
            raise EngineError(f"a KV cache of {cache_tokens} positions cannot hold one request of the full context "
                              f"({max_context} positions)")
        self.num_pages = usable + 1  # and the scratch page 0
        self._seq = 0  # admission order of the next slot (the newest running requests are suspended first)
        self.max_new_tokens = max_new_tokens
        self.hidden = hidden
        self.num_vq = num_vq
        self.num_audio_tokens = int(getattr(model, "num_audio_tokens", AUDIO_EOS + 1))
        self.compute_dtype = compute_dtype
        # who joins the batch and who leaves it for want of pages; the engine does what it decides
        self.scheduler = Scheduler(max_slots, max_prefill_tokens, self.page, admit_batch, admit_wait_steps, max_pending)
        self._live = 0
        s = max_slots
        # host mirrors, indexed by slot: the step needs no Python loop over the batch for these
        self.rows: List[_Slot] = []
        self.h_n = np.zeros(s, dtype=np.int64)
        self.h_plen = np.zeros(s, dtype=np.int64)
        self.h_max = np.zeros(s, dtype=np.int64)
        self.h_text = np.zeros(s, dtype=bool)
        self.streaming: Set[_Slot] = set()
        self._pending: List[tuple] = []  # stream chunks copied to the host, delivered after the next sync
        self.cv = threading.Condition()
        self.stopping = False
        self.counters = EngineStats()  # cumulative, for metrics: Engine.stats()
        self._graph_timing_failed = False
        self._step_events: Optional[Tuple[Any, Any]] = None
        # when the last few decode steps began: a cancelled row's release counts the steps begun since its cancel
        self._step_starts: "collections.deque[float]" = collections.deque(maxlen=4)
        self.cache_dtype = cache_dtype
        self.cuda_graphs = cuda_graphs
        self.graphs: Optional[CudaGraphs] = None
        self.graph_step: Optional[Callable] = None  # compile_step's compiled step_core for graph buckets
        self.graph_prefill: Optional[Callable] = None  # compile_step(prefill=True)'s compiled prefill_core
        self.compiled_frozen = False
        self.allocated = False
        self._ready = threading.Event()
        self._alloc_error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.event_sync = False  # see _host_sync
        # prompts prefilled by `model.prefill` replayed from CUDA graphs where graphs are on: eagerly a
        # prefill is ~600 kernel launches, many decode steps' time
        self.prefill_graphs = True
        # with a started engine, results reach on_done on their own thread: a consumer's copies to the
        # host and its reply (the GPT model's Triton response) then overlap the next steps instead of
        # stalling the batch (at hundreds of rows that host work was a third of a step)
        self._results: Optional["queue.SimpleQueue"] = None
        self._results_thread: Optional[threading.Thread] = None
        self._tasks: List[Callable[[], None]] = []  # run by the engine thread between steps (graph captures)
        if compile_step:
            self.compile_step(prefill=compile_prefill)
        if start:
            self.start()
            self._ready.wait()
            if self._alloc_error is not None:
                self._results.put(None)
                raise self._alloc_error
        else:
            self._alloc()

    def _alloc(self) -> None:
        """The device state, made on the thread that will use it: on CPU, parallel work of another
        thread first (a big zero fill on the caller's thread) left this thread's OpenMP team ~30 %
        slower per decode step."""
        if self.allocated:
            return
        model, max_slots, cache_dtype = self.model, self.max_slots, self.cache_dtype
        max_new_tokens, num_vq, hidden = self.max_new_tokens, self.num_vq, self.hidden
        dev = self.device
        # running requests hold slots 0..B-1 (compacted); CUDA-graph buckets pad with free slots B..
        # and never exceed max_slots, so no scratch slot is needed
        s = max_slots
        self.k_cache, self.v_cache = model.new_cache(self.num_pages, self.page, cache_dtype, dev)
        # each slot's pages in order (page 0, scratch, where it holds none); the host copy is the truth,
        # rows that changed are copied over before the next prefill or step (`_sync_tables`)
        self.block_table = torch.zeros(s, self.table_width, dtype=torch.int64, device=dev)
        self.h_table = np.zeros((s, self.table_width), dtype=np.int64)
        self.h_pages = np.zeros(s, dtype=np.int64)
        self.free_pages: List[int] = list(range(self.num_pages - 1, 0, -1))
        self._dirty: Set[int] = set()
        self.tokens = torch.zeros(s, max_new_tokens + 1, num_vq, dtype=torch.int64, device=dev)
        # the model's final hidden states are in the compute dtype: kept in it, they are exact at half the memory
        self.hiddens = torch.zeros(s, max_new_tokens + 1, hidden, dtype=self.compute_dtype, device=dev)
        # each slot's sampling state and counts (row_params.py); a free slot's pads graph buckets
        self.row_params = RowParams.free(s, dev)
        self._free_row = RowParams.free(1, dev)
        self.n_dev = self.row_params.n  # the count column, kept as one view: every step writes it in place
        self.n_live = torch.zeros((), dtype=torch.int64, device=dev)  # rows ≥ this in a graph bucket are padding
        self.graphs = CudaGraphs(self) if (self.cuda_graphs and self.device.type == "cuda") else None
        self.allocated = True

    def compile_step(self, dynamic: bool = True, backend: str = "inductor", prefill: bool = False) -> None:
        """Graph buckets run the decode step compiled by torch.compile (inductor: fused norm, RoPE
        and sampling kernels, still replayed from CUDA graphs: faster than the TorchScript step, bench/probes/step.py
        measures both); audio-code steps only. Needs the eager module, not TorchScript.
        dynamic: one compile for all buckets (batch 1 still gets its own); else one per bucket. Call
        `freeze_compiled` once the buckets in use are warm: a bucket that would need a recompile then
        runs the plain step instead of stalling every running request for the tens of seconds a
        compile takes. prefill: prefills (graphed or not) run `prefill_core` compiled too, with dynamic
        shapes (opt-in: faster alone from its graph, but it makes a served start-up minutes longer;
        docs/performance.md)."""
        if isinstance(self.model, torch.jit.ScriptModule):
            raise EngineError("compile_step needs the eager GPT module (chattts_triton.model.gpt), not TorchScript")
        import torch._dynamo as dynamo
        import torch._inductor.config as inductor_config

        cfg = dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, name):  # one compile per (mode, batch bucket, length bucket) unless dynamic
                setattr(cfg, name, max(getattr(cfg, name), 4096))
        # autotuning a kernel that writes in place clones its arguments per tried config: for the
        # KV-cache writes that is the whole multi-GB cache (minutes, and no result)
        inductor_config.triton.autotune_pointwise = False
        self.graph_step = torch.compile(self.step_core, dynamic=dynamic, backend=backend)
        self.graph_prefill = torch.compile(self.prefill_core, dynamic=True, backend=backend) if prefill else None

    def freeze_compiled(self) -> None:
        self.compiled_frozen = True

    def compile_stance(self) -> str:
        """torch.compiler stance of compiled calls: once frozen, a call that would recompile runs plainly."""
        return "eager_on_recompile" if self.compiled_frozen else "default"

    def warm_up(self, text_eos_id: Optional[int] = None, freeze: bool = True, timeout: float = 1800.0) -> None:
        """Run what a server meets first before any client does: TorchScript's specialising runs,
        and with graph buckets, per mode (code; text when `text_eos_id` is given) a request alone and
        two together, so the compiled step (batch 1 and the dynamic batch ≥ 2 variant) and their
        first CUDA graphs exist, and the prefill graphs of the common buckets (PREFILL_WARM_*); then
        `freeze_compiled`. Runs the loop itself when the engine thread is not started."""
        deadline = time.monotonic() + timeout
        modes = [("code", AUDIO_EOS)] + ([("text", text_eos_id)] if text_eos_id is not None else [])
        if self.graphs is None:  # nothing to capture or compile: TorchScript's specialising runs only
            modes, rounds, tokens = modes[:1], (1, 1), 4
        else:  # 16 tokens each; a pair steps at batch 2
            rounds, tokens = (1, 1, 2), 16
        for mode, eos in modes:
            for n in rounds:
                self._warm_batch([torch.arange(1, 9)] * n, tokens, deadline, mode, eos)
        if self.graphs is not None:
            self._warm_prefills([k for k in PREFILL_WARM_BATCHES if k <= self.max_slots], deadline)
        if freeze and self.graph_step is not None:
            self.freeze_compiled()

    def warm_graphs(self, mode: str = "code", max_len: Optional[int] = None, timeout: float = 1800.0) -> int:
        """Capture now, before the first client, what a load would otherwise capture as it first reaches
        a bucket (each capture synchronises the device, stalling every running request): the decode
        graph of every batch bucket at every attention bucket up to `max_len` (default
        WARM_DECODE_LEN; with `decode_kernel` one bucket serves every length), and the prefill graphs
        of the prompt counts `warm_up` left out. A capture that fails leaves its bucket eager, as in
        serving. Returns the number of graphs held afterwards."""
        if self.graphs is None:
            return 0
        deadline = time.monotonic() + timeout
        max_len = WARM_DECODE_LEN if max_len is None else max_len
        self._warm_prefills([k for k in bucket_sizes(BATCH_STEP, self.max_slots) if k not in PREFILL_WARM_BATCHES], deadline)
        lens = sorted({self.graphs.buckets(1, n)[1] for n in range(1, min(max_len, self.max_context) + 1)})
        keys = [(bb, lb) for lb in lens for bb in bucket_sizes(BATCH_STEP, self.max_slots)]

        def capture() -> None:
            # a capture's warm-up steps every row of its bucket in `mode`: a live row of the other mode
            # would be stepped with the wrong head (the lazy path only meets buckets of its rows' mode)
            if self.rows:
                raise EngineError("warm_graphs needs an idle engine (requests are running)")
            for bb, lb in keys:
                self.graphs.decode_graph(mode, bb, lb)

        self._on_engine_thread(capture, deadline)
        return len(self.graphs.graphs)

    def _warm_prefills(self, counts: List[int], deadline: float) -> None:
        """One prefill (no decode step) of k prompts per PREFILL_WARM_LENGTHS bucket that graphs take,
        for each k in `counts`: their graphs are captured now."""
        if not self.prefill_graphs:
            return
        for k in counts:
            for t in PREFILL_WARM_LENGTHS:
                if t < self.max_context and k * t <= PREFILL_GRAPH_TOKENS:
                    self._warm_batch([torch.arange(1, t + 1)] * k, 1, deadline)

    def _on_engine_thread(self, fn: Callable[[], object], deadline: float) -> None:
        """Run fn where the engine's graphs run (its thread, between two steps), wait for it, raise
        what it raised."""
        if self.thread is None or self.thread is threading.current_thread():
            with torch.inference_mode():
                fn()
            return
        done, box = threading.Event(), []

        def task() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001  handed to the caller
                box.append(e)
            finally:
                done.set()

        with self.cv:
            if self.stopping:
                raise EngineError("engine is stopping")
            self._tasks.append(task)
            self.cv.notify_all()
        while not done.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not self.thread.is_alive():
                raise EngineError("the engine thread has ended")
            if time.monotonic() >= deadline:
                raise EngineError("engine task did not finish in time")
        if box:
            raise box[0]

    def _warm_batch(self, prompts: List[Tensor], tokens: int, deadline: float, mode: str = "code", eos: int = AUDIO_EOS) -> None:
        """Generate `tokens` for each prompt, all waiting before the engine looks (an idle engine admits
        them in one prefill); raise what failed."""
        results: List[GenResult] = []
        with self.cv:  # re-entrant: submit takes it too
            for i, ids in enumerate(prompts):
                params = SamplingParams(1.0, None, None, 1.0, tokens, tokens, seed=i)
                self.submit(GenRequest(ids, params, results.append, mode=mode, eos_id=eos, want_hidden=False))
        while len(results) < len(prompts):
            if time.monotonic() > deadline:
                raise EngineError(f"engine warm-up ({mode}, {len(prompts)} requests) did not finish in time")
            if self.thread is None:
                self._run_once(block=False)
            else:
                time.sleep(0.01)
        for r in results:
            if r.error is not None:
                raise r.error

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._results = queue.SimpleQueue()
        self._results_thread = threading.Thread(target=self._deliver_results, name="chattts-engine-results", daemon=True)
        self._results_thread.start()
        self.thread = threading.Thread(target=self._loop, name="chattts-engine", daemon=True)
        self.thread.start()

    def _deliver_results(self) -> None:
        torch.set_grad_enabled(False)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = self._results.get()
            if item is None:
                return
            with torch.inference_mode():  # as on the engine thread (results are inference tensors)
                self._call(*item)

    def _hand_off(self, req: GenRequest, res: GenResult) -> None:
        """A finished request's result to its on_done: queued for the results thread (in order) when
        the engine runs its own thread, else called here."""
        if self._results is not None:
            self._results.put((req, res))
        else:
            self._call(req, res)

    def validate(self, req: GenRequest) -> None:
        p = req.params
        if req.text_ids.numel() == 0:
            raise ValueError("empty prompt")
        if p.max_new_tokens < 1 or p.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens must be in [1, {self.max_new_tokens}], got {p.max_new_tokens}")
        if req.prompt_len + p.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({req.prompt_len} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                f"context of {self.max_context} tokens"
            )

    def submit(self, req: GenRequest) -> None:
        self.validate(req)
        with self.cv:
            if self.stopping:
                raise EngineError("engine is stopping")
            self.scheduler.add(req, self.counters.steps)
            self.cv.notify()

    def generate(self, req: GenRequest, timeout: Optional[float] = None) -> GenResult:
        """Blocking helper: submit and wait for the result."""
        done = threading.Event()
        box: List[GenResult] = []
        user_cb = req.on_done

        def cb(res: GenResult) -> None:
            box.append(res)
            done.set()
            if user_cb is not None:
                user_cb(res)

        req.on_done = cb
        self.submit(req)
        if not done.wait(timeout):
            req.cancel()
            raise TimeoutError("generation timed out")
        return box[0]

    def stats(self) -> Dict[str, float]:
        """The counters (`EngineStats`) and the gauges read off the engine's state, each named `engine_*`."""
        return {"engine_active": self.active, "engine_waiting": self.pending, **self.counters.report(),
                "engine_results_pending": self._results.qsize() if self._results is not None else 0,
                "engine_slots": self.max_slots, "engine_kv_pages": self.num_pages - 1,
                "engine_kv_pages_free": len(self.free_pages) if self.allocated else self.num_pages - 1}

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def pending(self) -> int:
        return self.scheduler.pending

    def full(self) -> bool:
        """Whether running + waiting requests reached `max_pending` (a caller answers "server busy")."""
        return self.scheduler.full(len(self.rows))

    @property
    def free(self) -> List[int]:
        return list(range(len(self.rows), self.max_slots))

    def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop accepting work; with drain, finish what is queued and running first."""
        with self.cv:
            self.stopping = True
            if not drain:
                for r in self.scheduler.requests():
                    r.cancel()
                for s in list(self.rows):
                    s.req.cancel()
            self.cv.notify_all()
        if self.thread is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            self.thread.join(timeout)
            if not self.thread.is_alive() and self._results_thread is not None:
                self._results.put(None)  # after every result the loop handed off
                self._results_thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # -- loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            if self.device.type == "cuda":  # the current device is per thread: graphs and streams use it
                torch.cuda.set_device(self.device)
            self._alloc()
        except BaseException as e:  # noqa: BLE001  e.g. out of memory at start: the constructor raises it
            self._alloc_error = e
            return
        finally:
            self._ready.set()
        while self._run_once():
            pass

    def _run_once(self, block: bool = True) -> bool:
        """One iteration: admit (per the admission policy) with one batched prefill, then one decode
        step of every running request. False once stopped and drained."""
        with self.cv:
            while block and not self.scheduler.pending and not self.rows and not self.stopping and not self._tasks:
                self.cv.wait()
            tasks, self._tasks = self._tasks, []
            stop = self.stopping and not self.scheduler.pending and not self.rows
            admitted = None if stop else self._take_admissions()
        for task in tasks:  # each reports its own outcome
            with torch.inference_mode():
                task()
        if stop:
            return False
        try:
            with torch.inference_mode():
                for suspended in admitted.resume:  # first (they were at the head), where they stopped
                    self._resume(suspended.state)
                fresh = admitted.prefill
                if fresh:
                    t0 = time.perf_counter()
                    self._prefill(fresh)
                    self.counters.prefill_seconds += time.perf_counter() - t0
                    self.counters.prefills += 1
                    self.counters.prefill_rows += len(fresh)
                if self.rows:
                    t0, b = time.perf_counter(), len(self.rows)
                    self._decode_step()
                    self.counters.step_seconds += time.perf_counter() - t0
                    self.counters.step_rows += b
        except Exception as e:  # fail the requests in flight, keep serving the next ones
            log.exception("engine step failed")
            self._fail_all(e)
        return True

    def _take_admissions(self) -> Admission:
        """The scheduler's admissions for this iteration (under the lock); the cancelled requests it dropped
        from the queue end here."""
        admitted = self.scheduler.admit(len(self.rows), len(self.free_pages), self.counters.steps)
        for req, steps in admitted.cancelled:
            self._hand_off(req, GenResult(None, None, "cancelled", steps=steps))
        return admitted

    # -- pages ------------------------------------------------------------------------------------
    def _grant(self, slot_id: int, pages: int) -> None:
        """Give the slot free pages until it holds `pages` (the caller checked there are enough)."""
        have = int(self.h_pages[slot_id])
        if pages > have:
            for j in range(have, pages):
                self.h_table[slot_id, j] = self.free_pages.pop()
            self.h_pages[slot_id] = pages
            self._dirty.add(slot_id)

    def _release(self, slot_id: int) -> None:
        """The slot's pages back to the pool (work queued on the device before still reads them in order)."""
        have = int(self.h_pages[slot_id])
        if have:
            self.free_pages.extend(self.h_table[slot_id, :have].tolist())
            self.h_table[slot_id, :have] = 0
            self.h_pages[slot_id] = 0
            self._dirty.add(slot_id)

    def _sync_tables(self) -> None:
        """The block table rows that changed, onto the device (one copy)."""
        if self._dirty:
            rows = sorted(self._dirty)
            self._dirty.clear()
            at = self._h2d(torch.tensor(rows, dtype=torch.int64))
            self.block_table.index_copy_(0, at, self._h2d(torch.from_numpy(self.h_table[rows])))

    def _ensure_pages(self) -> None:
        """Before a decode step: every running row holds the page of the position it writes; where the pool
        has too few, the rows the scheduler picks are suspended."""
        b = len(self.rows)
        want = self.scheduler.pages_for(self.h_plen[:b] + self.h_n[:b])  # through the position it writes
        short = want > self.h_pages[:b]
        if int(short.sum()) > len(self.free_pages):
            self._suspend(self.scheduler.victims([s.seq for s in self.rows], self.h_pages[:b], short, len(self.free_pages)))
            b = len(self.rows)
            want = self.scheduler.pages_for(self.h_plen[:b] + self.h_n[:b])
            short = want > self.h_pages[:b]
        for i in np.flatnonzero(short):
            self._grant(int(i), int(want[i]))

    def _suspend(self, ids: List[int]) -> None:
        """Take the rows `ids` out of the batch: their pages' keys and values, tokens, hidden states and
        sampling state to the host (queued before anything reuses the pages), their pages freed; back to
        the head of the queue (the scheduler's `requeue`)."""
        records = []
        for i in ids:
            slot = self.rows[i]
            n, k = int(self.h_n[i]), int(self.h_pages[i])
            pages = self._h2d(torch.from_numpy(self.h_table[i, :k].copy()))
            slot.saved = (self._d2h(self.k_cache.index_select(1, pages)), self._d2h(self.v_cache.index_select(1, pages)),
                          self._d2h(self.tokens[i, :n]), self._d2h(self.hiddens[i, :n]),
                          self.row_params.narrow(i, 1).map(self._d2h),
                          (n, int(self.h_plen[i]), int(self.h_max[i]), bool(self.h_text[i]), k))
            self.streaming.discard(slot)
            self._release(i)
            records.append(Suspended(slot.req, slot.seq, pages=k, steps=n, state=slot))
        self._compact(set(ids))
        self.scheduler.requeue(records, self.counters.steps)
        self.counters.preemptions += len(records)
        log.debug("suspended %d requests for want of KV pages (%d free)", len(records), len(self.free_pages))

    def _resume(self, slot: _Slot) -> None:
        """A suspended request into the next slot, exactly as it was."""
        k_saved, v_saved, toks, hids, params, (n, plen, max_new, text, k) = slot.saved
        i = len(self.rows)
        self._grant(i, k)
        pages = self._h2d(torch.from_numpy(self.h_table[i, :k].copy()))
        self.k_cache.index_copy_(1, pages, self._h2d(k_saved))
        self.v_cache.index_copy_(1, pages, self._h2d(v_saved))
        self.tokens[i, :n].copy_(self._h2d(toks))
        self.hiddens[i, :n].copy_(self._h2d(hids))
        self.row_params.narrow(i, 1).copy_(params.map(self._h2d))
        self.h_n[i], self.h_plen[i], self.h_max[i], self.h_text[i] = n, plen, max_new, text
        slot.idx, slot.saved = i, None
        self.rows.append(slot)
        if slot.req.on_tokens is not None:
            self.streaming.add(slot)
        self.counters.resumes += 1

    # -- host <-> device without extra host syncs ---------------------------------------------------
    def _h2d(self, t: Tensor) -> Tensor:
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)  # a pageable copy would sync the stream

    def _d2h(self, t: Tensor) -> Tensor:
        if self.device.type != "cuda":
            return t.clone()  # the slot's buffers are reused: hand out a copy
        return t.to("cpu", non_blocking=True)  # pinned; valid after the next host sync

    def _set_live(self, b: int) -> None:
        if b != self._live:
            self.n_live.fill_(b)  # a kernel with a scalar argument: no copy, no sync
            self._live = b

    # -- prefill --------------------------------------------------------------------------------
    def _prefill(self, reqs: Sequence[GenRequest]) -> None:
        """Admitted requests take the next slots b0..b0+k-1: one prefill over that slot range."""
        b0, k = len(self.rows), len(reqs)
        for i, req in enumerate(reqs):
            slot = _Slot(self, req, b0 + i, self._seq)
            self._seq += 1
            self._grant(b0 + i, self.scheduler.pages_for(req.prompt_len))
            self.rows.append(slot)
            self.h_n[b0 + i] = 0
            self.h_plen[b0 + i] = req.prompt_len
            self.h_max[b0 + i] = req.params.max_new_tokens
            self.h_text[b0 + i] = req.mode == "text"
            if req.on_tokens is not None:
                self.streaming.add(slot)
        self._set_params(b0, reqs)
        self._sync_tables()
        h_last = None
        if self.graphs is not None and self.prefill_graphs:
            h_last = self.graphs.prefill(b0, reqs)
        if h_last is None:
            x, positions, idx = self._prompt_batch(reqs, k, max(r.prompt_len for r in reqs), b0)
            h_last = self.run_prefill(x, positions, idx)
        self._first_step(b0, k, h_last[:k])

    def run_prefill(self, x: Tensor, positions: Tensor, idx: Tensor) -> Tensor:
        """`prefill_core`, compiled where `compile_step(prefill=True)` asked (frozen: a shape that would
        recompile runs it plainly, as the step does)."""
        if self.graph_prefill is not None:
            try:
                with torch.compiler.set_stance(self.compile_stance()):
                    return self.graph_prefill(x, positions, idx)
            except Exception:
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise  # the capture is spoilt: the graph cache runs this bucket eagerly (and we get here again)
                log.exception("the compiled prefill failed; prefills run the plain module from now on")
                self.graph_prefill = None
        return self.prefill_core(x, positions, idx)

    def prefill_core(self, x: Tensor, positions: Tensor, idx: Tensor) -> Tensor:
        """The final hidden state [rows, hidden] (float) of each row's last prompt position, its
        keys and values written to the pages of slot idx[0, row] (pure tensor work: CUDA-graph safe).
        idx [2, rows]: slots, last positions."""
        h = self.model.prefill(x, positions, self.block_table.index_select(0, idx[0]), self.k_cache, self.v_cache)
        return h[torch.arange(x.shape[0], device=self.device), idx[1]].float()

    def _set_params(self, b0: int, reqs: Sequence[GenRequest]) -> None:
        self.row_params.narrow(b0, len(reqs)).copy_(RowParams.of(reqs).map(self._h2d))

    def _prompt_batch(self, reqs: Sequence[GenRequest], rows: int, t: int, b0: int):
        """The admitted prompts (slots b0..) as one padded batch x [rows, t, hidden], positions [rows, t]
        (-1 = padding) and idx [2, rows] (slot, last prompt position); rows past the prompts are bucket
        padding (all positions -1, slot b0). One host→device copy per input kind, one embedding call per
        kind, one gather to lay them out."""
        lens = [r.prompt_len for r in reqs]
        k = len(reqs)
        ids = [r.text_ids.reshape(-1).to("cpu", torch.int64) for r in reqs]
        codes = [r.audio_codes.to("cpu", torch.int64) if r.audio_codes is not None and r.audio_codes.numel() else None
                 for r in reqs]
        n_text = sum(int(i.numel()) for i in ids)
        n_code = sum(0 if c is None else int(c.shape[0]) for c in codes)
        src = torch.full((rows, t), n_text + n_code, dtype=torch.int64)  # padding points at a zero row
        positions = torch.full((rows, t), -1, dtype=torch.int64)
        idx = torch.zeros(2, rows, dtype=torch.int64)
        idx[0] = b0
        idx[0, :k] += torch.arange(k)
        idx[1, :k] = torch.tensor(lens) - 1
        spk_row = torch.full((n_text,), -1, dtype=torch.int64)
        spk: List[Tensor] = []
        ot, oc = 0, n_text
        for i, r in enumerate(reqs):
            nt = int(ids[i].numel())
            src[i, :nt] = torch.arange(ot, ot + nt)
            if r.spk_emb is not None:
                spk_row[ot : ot + nt].masked_fill_(ids[i] == r.spk_emb_id, len(spk))
                spk.append(r.spk_emb.reshape(-1).cpu())
            ot += nt
            if codes[i] is not None:
                nc = int(codes[i].shape[0])
                src[i, nt : nt + nc] = torch.arange(oc, oc + nc)
                oc += nc
            positions[i, : lens[i]] = torch.arange(lens[i])
        x = self.model.embed_text(self._h2d(torch.cat(ids)))
        if spk:
            table = self._h2d(torch.stack(spk)).to(x.dtype)
            row = self._h2d(spk_row)
            x = torch.where((row >= 0).unsqueeze(1), table[row.clamp(min=0)], x)
        parts = [x]
        if n_code:
            parts.append(self.model.embed_code(self._h2d(torch.cat([c for c in codes if c is not None]))).to(x.dtype))
        parts.append(x.new_zeros(1, x.shape[1]))
        flat = torch.cat(parts).to(self.compute_dtype)
        return flat[self._h2d(src)], self._h2d(positions), self._h2d(idx)

    def _first_step(self, b0: int, k: int, h: Tensor) -> None:
        """Sample each new request's first token; upstream ensure_non_empty: an EOS there is redrawn."""
        hit = np.zeros(k, dtype=bool)
        todo = list(range(k))
        while True:
            hit[todo] = self._sample_first(b0, todo, h)
            redraw = []
            for i in todo:
                slot = self.rows[b0 + i]
                if hit[i] and slot.req.params.ensure_non_empty and slot.attempt + 1 < MAX_EMPTY_RETRIES:
                    slot.attempt += 1
                    redraw.append(i)
            if not redraw:
                break
            idx = self._h2d(torch.tensor(redraw, dtype=torch.int64) + b0)
            self.row_params.attempt.index_add_(0, idx, torch.ones_like(idx))
            todo = redraw
        self._deliver()
        self._advance(b0, b0 + k, hit)

    def _sample_first(self, b0: int, rows: List[int], h: Tensor) -> np.ndarray:
        """First-token draw of the new rows `rows` (indices into h), per mode; one host sync."""
        order: List[int] = []
        hits: List[Tensor] = []
        for mode in ("code", "text"):
            sel = [i for i in rows if (self.h_text[b0 + i]) == (mode == "text")]
            if not sel:
                continue
            r = self._h2d(torch.tensor(sel, dtype=torch.int64))
            st = r + b0
            self.n_dev.index_fill_(0, st, 0)
            _, hm = self.sample_core(st, self.row_params.select(st), h.index_select(0, r), mode)
            order += sel
            hits.append(hm)
        got = self._host_sync(torch.cat(hits))  # the prefill's one host sync
        out = np.zeros(len(rows), dtype=bool)
        pos = {i: j for j, i in enumerate(rows)}
        for i, v in zip(order, got):
            out[pos[i]] = v
        return out

    # -- decode ---------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        self._ensure_pages()
        self._sync_tables()
        b = len(self.rows)
        attn_len = int((self.h_plen[:b] + self.h_n[:b]).max())  # 1 + the largest position fed
        n_text = int(self.h_text[:b].sum())
        mode = "code" if n_text == 0 else "text" if n_text == b else "mixed"
        c = self.counters
        self._step_starts.append(time.perf_counter())
        hit = None
        inner = None  # the timing events of the graph that runs this step, if one does
        timed = self.device.type == "cuda" and c.steps % GPU_TIMING_EVERY == 0
        if timed:
            if self._step_events is None:
                self._step_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._step_events[0].record()
        t0 = time.perf_counter()
        if self.graphs is not None and mode != "mixed":
            hit = self.graphs.step(b, attn_len, mode)
            inner = self.graphs.last_events
        if hit is None:
            groups = None
            if mode == "mixed":  # rare (refine-text next to audio codes): eager, per-mode sampling
                text = self.h_text[:b]
                groups = [(m, self._h2d(torch.from_numpy(np.flatnonzero(sel)))) for m, sel in (("code", ~text), ("text", text))]
            hit = self.step_core(0, b, attn_len, mode, None, groups)
        if timed:
            self._step_events[1].record()
        hit_host = self._host_sync(hit[:b])
        c.step_device_seconds += time.perf_counter() - t0
        if timed:  # both events are done: the sync came after the second
            c.step_gpu_seconds += self._step_events[0].elapsed_time(self._step_events[1]) / 1000
            c.step_gpu_samples += 1
            if inner is not None and not self._graph_timing_failed:
                try:
                    c.step_graph_seconds += inner[0].elapsed_time(inner[1]) / 1000
                    c.step_graph_samples += 1
                except Exception:
                    log.exception("reading a decode graph's own timing events failed; no more graph timings")
                    self._graph_timing_failed = True
        if c.steps % GIL_PROBE_EVERY == 0:
            t1 = time.perf_counter()
            time.sleep(0)  # lets the GIL go and takes it back: the wait a release costs now
            c.gil_wait_seconds += time.perf_counter() - t1
            c.gil_wait_samples += 1
        c.steps += 1
        self._deliver()
        self._advance(0, b, hit_host)

    def _host_sync(self, hit: Tensor) -> np.ndarray:
        """A step's (or prefill's) one host sync: its EOS flags on the host. `event_sync` (CUDA, off by default,
        an experiment of bench/probes/stream_codec.py): `to_host`'s wait on an event instead of a blocking copy."""
        if self.event_sync:
            return to_host(hit).numpy()
        return hit.cpu().numpy()

    def step_core(self, start: int, b: int, attn_len: int, mode: str = "code", n_live: Optional[Tensor] = None,
                  groups: Optional[List[Tuple[str, Tensor]]] = None) -> Tensor:
        """One decode step of the rows in slots start..start+b-1 (pure tensor work: no host sync,
        CUDA-graph safe). Feeds each row's last token at position prompt_len + n - 1 (both from the
        device state, so a graph replay needs no input), samples the next, records token and hidden
        state. Rows at or past `n_live` are padding: they compute, but their count does not advance.
        mode "mixed" (eager) samples each of `groups` (mode, row indices) with its own head.
        Returns eos_hit [b]."""
        dev = self.device
        st = torch.arange(start, start + b, dtype=torch.int64, device=dev)
        p = self.row_params.select(st)  # a copy: sampling advances the counts (n_dev) in place
        n = p.n
        last_tok = self.tokens[st, (n - 1).clamp(min=0)]
        if mode == "text":
            x = self.model.embed_text(last_tok[:, 0])
        else:
            # a free slot may still hold text-vocabulary ids: keep padding rows' lookups in range
            x = self.model.embed_code(last_tok.clamp(max=self.num_audio_tokens - 1))
            if mode == "mixed":
                x = torch.where(p.text.bool().unsqueeze(1), self.model.embed_text(last_tok[:, 0]), x)
        x = x.to(self.compute_dtype).unsqueeze(1)
        positions = (p.prompt_len + n - 1).unsqueeze(1)
        tables = self.block_table.narrow(0, start, b)
        h = self.model(x, positions, tables, self.k_cache, self.v_cache, attn_len)[:, 0].float()
        if groups is None:
            valid = None if n_live is None else torch.arange(b, device=dev) < n_live
            return self.sample_core(st, p, h, mode, valid)[1]
        hit = torch.zeros(b, dtype=torch.bool, device=dev)
        for m, rows in groups:
            _, hm = self.sample_core(st.index_select(0, rows), p.select(rows), h.index_select(0, rows), m)
            hit.index_copy_(0, rows, hm)
        return hit

    def sample_core(self, st: Tensor, p: Tensor, h: Tensor, mode: str, valid: Optional[Tensor] = None):
        """Sample the next token of the rows in slots `st` (p: a copy of their `row_params`); record it."""
        b = st.shape[0]
        q = self.num_vq if mode == "code" else 1
        n = p.n
        hc = h.to(self.compute_dtype)
        logits = self.model.logits_code(hc) if mode == "code" else self.model.logits_text(hc).unsqueeze(1)
        logits = logits.reshape(b * q, logits.shape[-1]).float()

        def rep(t: Tensor) -> Tensor:  # per-request value for each of its rows
            return t.repeat_interleave(q)

        w = REPETITION_WINDOW
        offs = (n.unsqueeze(1) - w + torch.arange(w, device=self.device)).clamp(min=0)  # [B, W]
        hist = self.tokens[st.unsqueeze(1), offs][..., :q].permute(0, 2, 1).reshape(b * q, w)
        eos = p.eos
        logits = sampling.process_logits(
            logits,
            rep(p.temperature),
            rep(p.repetition_penalty),
            rep(p.top_p),
            rep(p.top_k),
            hist,
            rep(n.clamp(max=w)),
            rep(n < p.min_new_tokens),
            rep(eos),
        )
        row = torch.arange(q, device=self.device).repeat(b)
        u = sampling.uniform(rep(p.seed), rep(n), row, rep(p.attempt))
        tok = sampling.sample(logits, u).view(b, q)
        hit = (tok == eos.unsqueeze(1)).any(1)
        if q < self.num_vq:
            tok = tok.expand(b, self.num_vq)
        self.tokens[st, n] = tok
        self.hiddens[st, n] = h.to(self.hiddens.dtype)  # the compute dtype: exact, the model's output in it
        keep = ~hit if valid is None else ~hit & valid
        self.n_dev.index_add_(0, st, keep.long())
        return tok, hit

    # -- host bookkeeping -------------------------------------------------------------------------
    def _advance(self, lo: int, hi: int, hit: np.ndarray) -> None:
        """After a step of the rows in slots lo..hi-1: counts, stream chunks, finished requests."""
        rows = self.rows
        cancelled = np.fromiter((rows[i].req.cancelled for i in range(lo, hi)), dtype=bool, count=hi - lo)
        kept = ~hit & ~cancelled
        n = self.h_n[lo:hi]
        n += kept
        maxed = kept & (n >= self.h_max[lo:hi])
        for slot in self.streaming:
            i = slot.idx - lo
            if 0 <= i < hi - lo and kept[i] and not maxed[i] and n[i] - slot.emitted >= max(1, slot.req.stream_every):
                self._emit(slot.idx, slot)
        done = np.flatnonzero(~kept | maxed)
        if done.size:
            reasons = ["cancelled" if cancelled[j] else "eos" if hit[j] else "max_tokens" for j in done]
            self._finish_rows([(lo + int(j), r) for j, r in zip(done, reasons)])

    def _emit(self, slot_id: int, slot: _Slot) -> None:
        """Queue the slot's tokens since its last chunk; on_tokens gets them after the next host sync
        (the step's own), so streaming adds no sync of its own."""
        a, b = slot.emitted, int(self.h_n[slot_id])
        toks = self._d2h(self.tokens[slot_id, a:b])
        hid = self._d2h(self.hiddens[slot_id, a:b].float()) if slot.req.want_hidden else None
        slot.emitted = b
        self._pending.append((slot, toks, hid))

    def _deliver(self) -> None:
        """Hand queued chunks to their consumers; call right after a host sync (their copies are done)."""
        pending, self._pending = self._pending, []
        for slot, toks, hid in pending:
            try:
                slot.req.on_tokens(toks, hid)
            except Exception:  # a failing consumer must not take the engine down: stop its generation
                log.exception("streaming callback failed; cancelling that generation")
                slot.req.cancel()

    def _finish_rows(self, items: List[Tuple[int, str]]) -> None:
        results = []
        for slot_id, reason in items:
            slot = self.rows[slot_id]
            results.append((slot.req, self._result(slot_id, slot.req, reason)))
            self.streaming.discard(slot)
            if reason == "cancelled":
                self._count_release(slot.req)
        if self.device.type == "cuda":
            # one event after the results' copies: the consumer waits for them alone, not for the
            # steps launched meanwhile (a copy made on its own thread queues behind those and takes
            # a step's time per result, which capped the results per second)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))  # where _d2h queued the copies
            for _, res in results:
                if res.tokens is not None:
                    res.ready = ready
        for i, _ in items:  # their pages back to the pool (the copies and steps queued before read them first)
            self._release(i)
        self._compact({i for i, _ in items})  # after the results' copies: they are queued first
        for req, res in results:
            self._hand_off(req, res)

    def _count_release(self, req: GenRequest) -> None:
        """A cancelled row's slot comes back now: how long after the cancel, and whether more than one decode step
        began in between (the row is checked after every step, so one step plus the host's bookkeeping is the bound)."""
        if req.cancelled_at is None:
            return
        c = self.counters
        wait = time.perf_counter() - req.cancelled_at
        c.cancel_releases += 1
        c.cancel_release_seconds += wait
        c.cancel_release_max_seconds = max(c.cancel_release_max_seconds, wait)
        if sum(t >= req.cancelled_at for t in self._step_starts) > 1:
            c.cancel_release_late += 1

    def _result(self, slot_id: int, req: GenRequest, reason: str) -> GenResult:
        n = int(self.h_n[slot_id])
        if reason not in ("eos", "max_tokens"):
            return GenResult(None, None, reason, steps=n)
        toks = self._d2h(self.tokens[slot_id, :n, 0] if req.mode == "text" else self.tokens[slot_id, :n])
        hid = self._d2h(self.hiddens[slot_id, :n].float()) if (req.want_hidden and req.mode == "code") else None
        return GenResult(toks, hid, reason, steps=n)

    def _compact(self, done: Set[int]) -> None:
        """Keep the running requests in slots 0..B-1: the last ones move into the freed slots below (their
        state and block table rows; their keys and values stay in their pages). `done` rows hold no pages."""
        b = len(self.rows)
        keep = b - len(done)
        holes = sorted(i for i in done if i < keep)
        movers = [i for i in range(keep, b) if i not in done]
        if holes:
            src_h, dst_h = np.array(movers), np.array(holes)
            src = self._h2d(torch.from_numpy(src_h))
            dst = self._h2d(torch.from_numpy(dst_h))
            t = int(self.h_n[src_h].max()) + 1
            for buf in (self.tokens.narrow(1, 0, t), self.hiddens.narrow(1, 0, t), self.row_params.ints, self.row_params.floats):
                buf.index_copy_(0, dst, buf.index_select(0, src))
            for arr in (self.h_n, self.h_plen, self.h_max, self.h_text, self.h_table, self.h_pages):
                arr[dst_h] = arr[src_h]
            self.h_table[src_h] = 0
            self.h_pages[src_h] = 0
            self._dirty.update(holes + movers)
            for s, d in zip(movers, holes):
                slot = self.rows[s]
                slot.idx = d
                self.rows[d] = slot
        del self.rows[keep:]
        self._clear_free(keep, b)

    def _clear_free(self, lo: int, hi: int) -> None:
        # free slots are the padding rows of graph buckets: n = prompt_len = 0 (nothing in their
        # history is read) and the audio EOS (a text request's EOS id would index past the code head)
        if hi > lo:
            self.row_params.narrow(lo, hi - lo).copy_(self._free_row)
            self.h_n[lo:hi] = 0
            self.h_plen[lo:hi] = 0
            self.h_text[lo:hi] = False

    def _fail_all(self, error: BaseException) -> None:
        self._pending.clear()
        for i in range(len(self.rows)):
            self._release(i)
        rows, self.rows = self.rows, []
        self.streaming.clear()
        results = [(s.req, GenResult(None, None, "error", error=error, steps=int(self.h_n[s.idx]))) for s in rows]
        try:
            self._clear_free(0, len(rows))
        except Exception:
            log.exception("resetting the slots failed")
        for req, res in results:
            self._hand_off(req, res)

    @staticmethod
    def _call(req: GenRequest, res: GenResult) -> None:
        try:
            res.wait()
        except Exception as e:
            log.exception("a finished result's copies failed")
            res = GenResult(None, None, "error", error=e, steps=res.steps)
        try:
            req.on_done(res)
        except Exception:  # a failing callback must not take the engine down
            log.exception("generation callback failed")


GPU_TIMING_EVERY = 8  # decode steps per one timed on the GPU's clock (two events and a query each)
# decode steps per GIL probe: its sleep(0) is paid on the hot path (≈ 1 % of a step at concurrency 1 when every
# 8th step paid it), so it samples rarely
GIL_PROBE_EVERY = 64
BATCH_STEP = 32  # batch buckets: powers of two up to this, then its multiples (≤ 31 padding rows)
LEN_STEP = 128  # attention-length buckets: multiples of this
PREFILL_LEN_STEP = 32  # prompt-length buckets: powers of two up to this, then its multiples
PREFILL_GRAPH_TOKENS = 4096  # larger padded prefills run eagerly
PREFILL_WARM_BATCHES = (1, 2, 4, 8, 16, 32)  # prefill graphs captured by warm_up: prompts per prefill ...
PREFILL_WARM_LENGTHS = (16, 32, 64, 128)  # ... times prompt-length bucket
WARM_DECODE_LEN = 512  # warm_graphs: decode graphs of every batch bucket up to this attention length


def bucket_sizes(step: int, largest: int) -> List[int]:
    """Every bucket `bucket(n, step, largest)` takes for n = 1 .. largest."""
    return sorted({bucket(n, step, largest) for n in range(1, largest + 1)})


class CudaGraphs(GraphCache):
    """Decode steps and prefills replayed from CUDA graphs.

    Decode: one graph per (mode, batch bucket, attention-length bucket; with `Engine.decode_kernel` one
    length bucket for all). A bucket runs slots
    0..bucket-1: the live batch, then free slots as padding rows (`Engine.n_live` keeps their counts
    from advancing; their other writes land in free slots, which admission resets). What a graph runs
    is `Engine.step_core`, the same code as the eager path.
    Prefill: one graph per (prompt-count bucket, prompt-length bucket) up to PREFILL_GRAPH_TOKENS
    padded tokens, over static inputs that each prefill copies its padded batch into; it runs
    `Engine.run_prefill` (slots as a tensor, so one graph serves any slots).
    All are captured on first use into one shared memory pool; with capture=False (CPU tests) the
    same buckets run eagerly.
    """

    def __init__(self, engine: Engine, capture: bool = True):
        super().__init__(engine.device, capture)
        self.e = engine
        self.prefill_inputs: Dict[tuple, Tuple[Tensor, Tensor, Tensor]] = {}
        self.last_events = None  # see step

    def buckets(self, b: int, attn_len: int) -> Tuple[int, int]:
        e = self.e
        if e.decode_kernel:  # each row reads its own keys whatever attn_len: one graph per batch bucket
            return bucket(b, BATCH_STEP, e.max_slots), LEN_STEP
        return bucket(b, BATCH_STEP, e.max_slots), bucket(max(attn_len, LEN_STEP), LEN_STEP, e.max_context)

    def prefill_buckets(self, k: int, t: int) -> Tuple[int, int]:
        e = self.e
        return bucket(k, BATCH_STEP, e.max_slots), bucket(t, PREFILL_LEN_STEP, e.max_context)

    def step(self, b: int, attn_len: int, mode: str) -> Optional[Tensor]:
        """eos_hit [bucket] of one step of the live rows 0..b-1, or None: run it eagerly.
        `last_events`: the timing events of the graph it replayed (None: eager, or untimed)."""
        self.last_events = None
        run = self.decode_graph(mode, *self.buckets(b, attn_len))
        if run is None:
            return None
        self.e._set_live(b)
        self.last_events = getattr(run, "events", None)
        return run()

    def decode_graph(self, mode: str, bb: int, lb: int) -> Optional[Callable[[], Tensor]]:
        return self._graph((mode, bb, lb), lambda: self._warm(mode, bb, lb), lambda: self._step(mode, bb, lb), timed=True)

    def failed_decode_buckets(self) -> List[tuple]:
        """Decode buckets whose capture failed (they run eagerly); failed prefill buckets are not
        counted (they run eagerly too, and a compiled prefill that fails falls back by itself)."""
        return [key for key, run in self.graphs.items() if run is None and key[0] != "prefill"]

    def prefill(self, b0: int, reqs: Sequence[GenRequest]) -> Optional[Tensor]:
        """`Engine.run_prefill` of the prompts `reqs` into slots b0.. from the graph of their bucket:
        [bucket rows, hidden], the first len(reqs) rows theirs; None over PREFILL_GRAPH_TOKENS."""
        e = self.e
        kb, tb = self.prefill_buckets(len(reqs), max(r.prompt_len for r in reqs))
        if kb * tb > PREFILL_GRAPH_TOKENS:  # compute-bound anyway: not worth a graph per shape
            return None
        key = ("prefill", kb, tb)
        inputs = e._prompt_batch(reqs, kb, tb, b0)
        static = self.prefill_inputs.get(key)
        if static is None:
            static = self.prefill_inputs[key] = tuple(torch.empty_like(t) for t in inputs)
        for buf, t in zip(static, inputs):
            buf.copy_(t)
        # warm-up and capture runs compute this very prefill (the same writes each time)
        run = self._graph(key, lambda: [e.run_prefill(*static) for _ in range(3)], lambda: e.run_prefill(*static))
        return e.run_prefill(*static) if run is None else run()

    def _step(self, mode: str, bb: int, lb: int) -> Tensor:
        e = self.e
        # text mode (refine text, rare) keeps the plain step: inductor 2.11 fails to generate its
        # top-P scan over the 21178-id text vocabulary at a dynamic batch
        if e.graph_step is None or mode != "code":
            return e.step_core(0, bb, lb, mode, e.n_live)
        # frozen: a bucket the warm-up did not compile for runs the plain step (still in a graph)
        with torch.compiler.set_stance(e.compile_stance()):
            return e.graph_step(0, bb, lb, mode, e.n_live)

    def _warm(self, mode: str, bb: int, lb: int) -> None:
        # n_live = 0: every row is padding, so a live row only gets the writes (its KV at its current
        # position, its next token/hidden) that its next real step makes again before reading them
        e = self.e
        e._set_live(0)
        for _ in range(3):
            self._step(mode, bb, lb)
