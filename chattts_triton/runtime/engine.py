"""In-flight batching engine for the ChatTTS GPT.

A single loop thread owns the model, the paged KV cache and all per-slot state. Each iteration it
admits waiting requests (one batched prefill; while busy, only once enough wait or the oldest has
waited a few steps), runs one decode step for every active request, samples, and retires the
finished ones through their callbacks. Running requests stay compacted in slots 0..B-1 (a finished
request's slot takes the last one's state and block table row). Each request's tokens depend only on
its own prompt, params and seed (per-slot positions, per-request counter-based sampling), not on its
slot, its pages or its batchmates. One host sync per decode step; with `overlap` (CUDA's default) that
sync waits for the step before the one just launched, so the host's bookkeeping runs while the GPU steps.

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

The engine's parts beside this file: `runner.py` (`Runner`: the decode step, sampling, the prefill's tensor work),
`kv.py` (`KvPages`: pages, block tables, suspend/resume, compaction), `warmup.py` (`WarmUp`), `graphs.py`
(`CudaGraphs`: steps and prefills replayed from CUDA graphs), `request.py` (requests, results). They are mixins
of `Engine`, which owns all the state; this file holds the loop and the public API.

`model` is `ChatTTSGPT` or its TorchScript export (same methods).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..config import (
    ADMIT_BATCH,
    ADMIT_WAIT_STEPS,
    AUDIO_EOS,
    KV_PAGE_TOKENS,
    MAX_EMPTY_RETRIES,
)
from ..model import attention
from .graphs import (  # noqa: F401  re-exported: callers import the buckets and CudaGraphs from here
    BATCH_STEP,
    LEN_STEP,
    PREFILL_GRAPH_TOKENS,
    PREFILL_LEN_STEP,
    PREFILL_WARM_BATCHES,
    PREFILL_WARM_LENGTHS,
    WARM_DECODE_LEN,
    CudaGraphs,
    bucket_sizes,
)
from .kv import KvPages
from .request import EngineError, GenRequest, GenResult, SamplingParams, Slot  # noqa: F401  re-exported
from .runner import Runner, check_model, paged_interface  # noqa: F401  re-exported
from .scheduler import Admission, Scheduler
from .stats import EngineStats
from .warmup import WarmUp

log = logging.getLogger(__name__)


GPU_TIMING_EVERY = 8  # decode steps per one timed on the GPU's clock (two events and a query each)
# decode steps per GIL probe: its sleep(0) is paid on the hot path (≈ 1 % of a step at concurrency 1 when every
# 8th step paid it), so it samples rarely
GIL_PROBE_EVERY = 64


class _Flight:
    """A decode step launched (or an admission's first tokens drawn: step -1), its bookkeeping still to do
    (`Engine._land`)."""

    __slots__ = ("step", "b", "hit", "events", "inner", "slot_of", "host", "ready", "launch_seconds", "end", "carried")

    def __init__(self, step: int, b: int, hit: Tensor, events, inner, slots: int):
        self.step = step  # its index (the steps counter at its launch)
        self.b = b  # it ran slots 0..b-1
        self.hit = hit  # its EOS flags [b] on the device
        self.events = events  # timing events around its launch (every GPU_TIMING_EVERY-th step on CUDA)
        self.inner = inner  # the timing events its graph records, if a graph ran it
        # for each slot now, the row of this step it held then (-1: not in it); compaction keeps it current
        self.slot_of = np.full(slots, -1, dtype=np.int64)
        self.host: np.ndarray | None = None  # overlap: its flags on the host (valid once `ready` is done)
        self.ready = None  # overlap on CUDA: the event after the flags' copy
        self.launch_seconds = 0.0
        self.end = None  # when it ended: a CUDA event recorded after it, or the host's clock (`EngineStats.step_gaps`)
        self.carried = False  # rows of the decode step before it run on in it (a gap between the two counts)


class Engine(Runner, KvPages, WarmUp):
    @property
    def packed_prefill(self) -> bool:
        """Prompts prefilled packed (`Runner._packed_batch`): asked for and where the decode kernel runs, which alone
        reads a packed prompt's keys; a later `engine.packed_prefill = True` on an engine without the kernel stays
        padded instead of cutting prompts at the dense mask's length."""
        return self._packed_prefill and self.decode_kernel

    @packed_prefill.setter
    def packed_prefill(self, on: bool) -> None:
        self._packed_prefill = bool(on)

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
        cache_tokens: int | None = None,
        cuda_graphs: bool = True,
        admit_batch: int = ADMIT_BATCH,
        admit_wait_steps: int = ADMIT_WAIT_STEPS,
        max_pending: int = 0,
        compile_step: bool = False,
        compile_prefill: bool = False,
        gemv: bool = False,
        gemv_tune: bool = False,
        decode_kernel: bool | None = None,
        overlap: bool | None = None,
        packed_prefill: bool = True,
        high_priority: bool = False,
        start: bool = True,
    ):
        """admit_batch / admit_wait_steps / max_prefill_tokens: the admission policy (`Scheduler`): while
        requests are running, waiting ones are admitted (one batched prefill of at most max_prefill_tokens
        prompt positions) once `admit_batch` of them (or as many as there are free slots) wait, or the
        oldest has waited `admit_wait_steps` decode steps; an idle engine admits at once.
        max_pending: running + waiting requests at which `full()` says yes (0: never); the engine itself
        accepts every submit, its callers refuse.
        compile_step, compile_prefill, gemv, gemv_tune: see `compile_step` (the model must be the eager module).
        decode_kernel: decode steps of the eager module read each row's own keys only
        (`attention.decode_attention`); None: where its GPU kernel runs (True elsewhere: its dense PyTorch
        reference, for tests). TorchScript models: never.
        cache_tokens: positions the paged KV cache holds, all requests together (None: max_slots ×
        max_context, which never suspends a request); at least one request of the full context.
        overlap: each decode step is launched before the previous one's EOS flags are read back, so that
        the host's bookkeeping runs while the GPU steps (`_decode_step`); None: on CUDA (a CPU's ops are
        synchronous: nothing to overlap, the logic is the same). May be changed between steps.
        packed_prefill: an admission's prompts are prefilled packed end to end, each position a row of the decode
        kernel (`Runner._packed_batch`), instead of padded to the longest; only where `decode_kernel` is on (else
        ignored). May be changed between iterations.
        high_priority: on CUDA the engine's thread launches on a stream of the device's highest priority, so that
        where other work of this process shares the GPU (the stream model's codec) the block scheduler gives the
        step's blocks the SMs first, and a step no longer queues behind a whole codec call (CUDA graphs replay at
        the priority of the stream they are launched into). A started engine's only; a CPU's ops have no streams."""
        check_model(model)
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the engine thread needs the index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.overlap = self.device.type == "cuda" if overlap is None else bool(overlap)
        self.launch_stream = (torch.cuda.Stream(self.device, priority=torch.cuda.Stream.priority_range()[1])
                              if high_priority and self.device.type == "cuda" else None)
        self._flight: _Flight | None = None  # overlap: the step launched and not yet read back
        self._first: _Flight | None = None  # overlap: the first tokens of an admission, not yet read back
        self._first_buf: Tensor | None = None  # overlap on CUDA: the pinned buffer their flags go to
        self._flag_bufs: list[Tensor] = []  # overlap on CUDA: two pinned buffers the steps' flags alternate in
        self.decode_kernel = False  # the model's decode steps read each row's own keys (attn_len unused)
        if isinstance(model, torch.jit.ScriptModule) or not hasattr(model, "decode_kernel"):
            if decode_kernel:
                raise EngineError("decode_kernel needs the eager GPT module (chattts_triton.model.gpt), "
                                  "not TorchScript")
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
        self.rows: list[Slot] = []
        self.h_n = np.zeros(s, dtype=np.int64)
        self.h_plen = np.zeros(s, dtype=np.int64)
        self.h_max = np.zeros(s, dtype=np.int64)
        self.h_text = np.zeros(s, dtype=bool)
        self.streaming: set[Slot] = set()
        # stream chunks copied to the host, each with the event after its copy (CUDA), delivered after the next sync
        self._pending: list[tuple] = []
        self.cv = threading.Condition()
        self.stopping = False
        self.counters = EngineStats()  # cumulative, for metrics: Engine.stats()
        self._graph_timing_failed = False
        self._step_events: tuple[Any, Any] | None = None
        # CUDA: the events after the last decode steps, in turn (a step lands after the next one's launch: the one
        # before it, itself and the next are in use), and the end of the last step landed (`EngineStats.step_gaps`)
        self._end_events: list[Any] = []
        self._gap_timing_failed = False
        self._last_end: tuple[int, Any] | None = None
        # when the last few decode steps began: a cancelled row's release counts the steps begun since its cancel
        self._step_starts: collections.deque[float] = collections.deque(maxlen=4)
        self.cache_dtype = cache_dtype
        self.cuda_graphs = cuda_graphs
        self.graphs: CudaGraphs | None = None
        self.graph_step: Callable | None = None  # compile_step's compiled step_core for graph buckets
        self.graph_step_one: Callable | None = None  # with gemv: the one-row bucket's own (`compiled_step`)
        self.graph_prefill: Callable | None = None  # compile_step(prefill=True)'s compiled prefill_core
        self.compiled_frozen = False
        self.allocated = False
        self._ready = threading.Event()
        self._alloc_error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.event_sync = False  # see _host_sync
        # prompts prefilled by `model.prefill` replayed from CUDA graphs where graphs are on: eagerly a
        # prefill is ~600 kernel launches, many decode steps' time
        self.prefill_graphs = True
        # prompts prefilled packed end to end (`Runner._packed_batch`), each position a row reading its own prompt's
        # keys through the decode kernel, instead of padded to the longest prompt: a prefill's work follows its
        # prompts' positions (the served mix of 6-116 positions padded ~3.5x); needs the kernel's interface
        self._packed_prefill = bool(packed_prefill)
        # with a started engine, results reach on_done on their own thread: a consumer's copies to the
        # host and its reply (the GPT model's Triton response) then overlap the next steps instead of
        # stalling the batch (at hundreds of rows that host work was a third of a step)
        self._results: queue.SimpleQueue | None = None
        self._results_thread: threading.Thread | None = None
        self._tasks: list[Callable[[], None]] = []  # run by the engine thread between steps (graph captures)
        if compile_step:
            self.compile_step(prefill=compile_prefill, gemv=gemv, gemv_tune=gemv_tune)
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
        self._alloc_pages()
        self._alloc_slots()
        self.allocated = True

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._results = queue.SimpleQueue()
        self._results_thread = threading.Thread(target=self._deliver_results, name="chattts-engine-results",
                                                daemon=True)
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

    def generate(self, req: GenRequest, timeout: float | None = None) -> GenResult:
        """Blocking helper: submit and wait for the result."""
        done = threading.Event()
        box: list[GenResult] = []
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

    def stats(self) -> dict[str, float]:
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
    def free(self) -> list[int]:
        return list(range(len(self.rows), self.max_slots))

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
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
                if self.launch_stream is not None:
                    # every tensor and graph of the engine is made and used on this thread, so on this stream;
                    # what the constructor's thread queued (weights, compile set-up) is ordered before it
                    self.launch_stream.wait_stream(torch.cuda.default_stream(self.device))
            with torch.cuda.stream(self.launch_stream):  # None: a no-op
                self._alloc()
        except BaseException as e:  # noqa: BLE001  e.g. out of memory at start: the constructor raises it
            self._alloc_error = e
            return
        finally:
            self._ready.set()
        with torch.cuda.stream(self.launch_stream):
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
            carried = bool(self.rows)  # this iteration's step runs on rows of the last one (its gap counts)
            admitted = None if stop else self._take_admissions()
        if tasks:  # a task (a graph capture) meets no step in flight
            with torch.inference_mode():
                self._drain()
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
                    t0 = time.perf_counter()
                    self._decode_step(carried)
                    self.counters.step_seconds += time.perf_counter() - t0
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


    # -- prefill --------------------------------------------------------------------------------
    def _prefill(self, reqs: Sequence[GenRequest]) -> None:
        """Admitted requests take the next slots b0..b0+k-1: one prefill over that slot range."""
        b0, k = len(self.rows), len(reqs)
        for i, req in enumerate(reqs):
            slot = Slot(self, req, b0 + i, self._seq)
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
        if self.packed_prefill:
            if self.graphs is not None and self.prefill_graphs:
                h_last = self.graphs.prefill_packed(b0, reqs)
            if h_last is None:
                *inputs, last = self._packed_batch(reqs, sum(r.prompt_len for r in reqs), b0)
                h_last = self.run_prefill(*inputs).index_select(0, last)
        elif self.graphs is not None and self.prefill_graphs:
            h_last = self.graphs.prefill(b0, reqs)
        if h_last is None:
            x, positions, idx = self._prompt_batch(reqs, k, max(r.prompt_len for r in reqs), b0)
            h_last = self.run_prefill(x, positions, idx)
        self._first_step(b0, k, h_last[:k])


    def _first_step(self, b0: int, k: int, h: Tensor) -> None:
        """Sample each new request's first token (upstream ensure_non_empty: an EOS there is redrawn, on the
        device: `sample_first`). Without overlap its flags are read back here, the prefill's one host sync; with
        overlap they are read with the next decode step's (`_land_first`), which is launched first and runs the
        new rows too: admission adds no host sync and the GPU runs the prefill, then the step, without a wait."""
        modes = self.h_text[b0 : b0 + k]
        redraw = [r.req.params.ensure_non_empty for r in self.rows[b0 : b0 + k]]
        hit = None
        if self.graphs is not None and self.prefill_graphs and not modes.any():  # all code rows: the usual case
            hit = self.graphs.first_tokens(b0, k, h, redraw, MAX_EMPTY_RETRIES)
        hit = self._first_step_eager(b0, k, h, modes, redraw) if hit is None else hit[:k]
        f = _Flight(-1, k, hit, None, None, self.max_slots)
        f.slot_of[b0 : b0 + k] = np.arange(k)
        if not self.overlap:
            self._deliver()  # the chunks of the step before (it ended at the last host sync)
            self._advance(b0, b0 + k, self._host_sync(hit))
            return
        assert self._first is None, "two admissions' first tokens unread"
        if self.device.type == "cuda":
            if self._first_buf is None:  # its own buffer: the decode steps' two alternate while this is unread
                self._first_buf = torch.empty(self.max_slots, dtype=torch.bool, pin_memory=True)
            self._first_buf[:k].copy_(hit, non_blocking=True)
            f.ready = torch.cuda.Event()
            f.ready.record()
            f.host = self._first_buf.numpy()
        else:
            f.host = hit.numpy().copy()
        self._first = f

    def _first_step_eager(self, b0: int, k: int, h: Tensor, modes: np.ndarray, redraw: list[bool]) -> Tensor:
        """`_first_step`'s draws eagerly, each mode's rows with its own head (refine text, or no graphs)."""
        hit = torch.empty(k, dtype=torch.bool, device=self.device)
        for mode, sel in (("code", ~modes), ("text", modes)):
            if not sel.any():
                continue
            if sel.all():  # the usual case: one mode for all, no index lists to copy
                st = torch.arange(b0, b0 + k, device=self.device)
                rows, hm = None, h
            else:
                rows = self._h2d(torch.from_numpy(np.flatnonzero(sel)))
                st, hm = rows + b0, h.index_select(0, rows)
            want = self._h2d(torch.tensor([redraw[i] for i in np.flatnonzero(sel)], dtype=torch.bool))
            got = self.sample_first(st, self.row_params.select(st), hm, mode, want, MAX_EMPTY_RETRIES)
            if rows is None:
                hit = got
            else:
                hit.index_copy_(0, rows, got)
        return hit

    def _land_first(self) -> None:
        """The new rows' first tokens (overlap): their flags (copied right after the prefill, so the wait ends
        before the decode step launched since) and their bookkeeping."""
        f, self._first = self._first, None
        if f is not None:
            self._land(f)

    # -- decode ---------------------------------------------------------------------------------
    def _decode_step(self, carried: bool = False) -> None:
        """One decode step of every running row. Without overlap: launch it, read its EOS flags back (the
        step's one host sync), then the bookkeeping (`_land`). With overlap: launch step n+1, then read step n's
        flags (done by now, or soon: the GPU runs n+1 meanwhile) and do its bookkeeping, one step late. Step
        n+1 reads its inputs from the device state that step n left (`step_core`), so it needs nothing from the
        host's bookkeeping of step n; a row that ended at step n computes one step more, which nothing reads
        (results copy its first n tokens), and its slot is freed by the bookkeeping as before."""
        if not self.overlap:
            self._drain()  # switched off with a step in flight
            self._land(self._launch(carried))
            return
        launched = self._launch(carried)  # may land the step in flight first (`_drain`)
        prev, self._flight = self._flight, launched
        if prev is not None:
            self._land(prev)
        self._land_first()  # admitted after prev's launch, before this one's: read in that order
        if not self.rows:  # everyone it stepped has finished: nothing to read back
            self._flight = None

    def _drain(self) -> None:
        """Land the step in flight (overlap), if any: before what needs the host's counts exact (suspending
        rows, a task such as a graph capture)."""
        f, self._flight = self._flight, None
        if f is not None:
            self._land(f)
        self._land_first()

    def _ahead(self, b: int) -> np.ndarray:
        """1 for each of the rows 0..b-1 that the step in flight runs: on the device it may be one token past
        the host's count."""
        ahead = np.zeros(b, dtype=np.int64)
        for f in self._in_flight():
            ahead |= f.slot_of[:b] >= 0
        return ahead

    def _in_flight(self) -> list[_Flight]:
        """The steps launched and not yet read back (overlap): a decode step, an admission's first tokens."""
        return [f for f in (self._flight, self._first) if f is not None]

    def _launch(self, carried: bool = False) -> _Flight | None:
        """Enqueue one decode step of rows 0..B-1 (pages granted, tables synced first). With a step in flight
        the host's counts lag by it: pages and the attention length are taken one position further for the
        rows it runs. None: nothing launched (the rows all end with the step in flight, which was landed)."""
        b = len(self.rows)
        ahead = self._ahead(b)
        if self._in_flight():
            # max_tokens: a row the step in flight takes to its last token is done either way; when all are,
            # read that step back instead of launching one that nothing would read
            done_either_way = ahead.astype(bool) & (self.h_n[:b] + 1 >= self.h_max[:b])
            if done_either_way.all():
                self._drain()
                return None
        else:
            done_either_way = np.zeros(b, dtype=bool)
        if not self._ensure_pages(ahead):  # short of pages: suspending needs the exact counts
            self._drain()
            if not self.rows:
                return None
            b = len(self.rows)
            ahead, done_either_way = np.zeros(b, dtype=np.int64), np.zeros(b, dtype=bool)
            self._ensure_pages(ahead)
            b = len(self.rows)
            ahead, done_either_way = ahead[:b], done_either_way[:b]
        self._sync_tables()
        attn_len = int((self.h_plen[:b] + self.h_n[:b] + ahead).max())  # 1 + the largest position fed
        n_text = int(self.h_text[:b].sum())
        mode = "code" if n_text == 0 else "text" if n_text == b else "mixed"
        c = self.counters
        self._step_starts.append(time.perf_counter())
        hit = None
        inner = None  # the timing events of the graph that runs this step, if one does
        events = None
        if self.device.type == "cuda" and c.steps % GPU_TIMING_EVERY == 0:
            if self._step_events is None:
                self._step_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events = self._step_events
            events[0].record()
        t0 = time.perf_counter()
        if self.graphs is not None and mode != "mixed":
            hit = self.graphs.step(b, attn_len, mode)
            inner = self.graphs.last_events
        if hit is None:
            groups = None
            if mode == "mixed":  # rare (refine-text next to audio codes): eager, per-mode sampling
                text = self.h_text[:b]
                groups = [(m, self._h2d(torch.from_numpy(np.flatnonzero(sel))))
                          for m, sel in (("code", ~text), ("text", text))]
            hit = self.step_core(0, b, attn_len, mode, None, groups)
        if events is not None:
            events[1].record()
        f = _Flight(c.steps, b, hit[:b], events, inner, self.max_slots)
        f.slot_of[:b] = np.arange(b)
        self._mark_end(f, carried)
        if self.overlap:
            # the flags to the host now: a graph's replay returns the same buffer, which the next step overwrites
            if self.device.type == "cuda":
                if not self._flag_bufs:
                    self._flag_bufs = [torch.empty(self.max_slots, dtype=torch.bool, pin_memory=True) for _ in range(2)]
                buf = self._flag_bufs[c.steps % 2]  # the other one may still be read back (the step in flight)
                buf[:b].copy_(f.hit, non_blocking=True)
                f.ready = torch.cuda.Event()
                f.ready.record()
                f.host = buf.numpy()
            else:
                f.host = f.hit.numpy().copy()
        f.launch_seconds = time.perf_counter() - t0
        c.steps += 1
        c.step_rows += b - int(done_either_way.sum())  # rows that step for a token someone reads
        return f

    def _mark_end(self, f: _Flight, carried: bool) -> None:
        """When the step just launched ends: an event after it (CUDA), or now (the CPU's ops are synchronous)."""
        f.carried = carried
        if self.device.type == "cuda":
            if not self._end_events:
                self._end_events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            f.end = self._end_events[f.step % 4]
            f.end.record()
        else:
            f.end = time.perf_counter()

    def _count_gap(self, f: _Flight) -> None:
        """The gap from the decode step landed last to this one (both done by now), where this one ran on rows of
        that one (`EngineStats.step_gaps`)."""
        last, self._last_end = self._last_end, (f.step, f.end)
        if last is None or last[0] != f.step - 1 or not f.carried or self._gap_timing_failed:
            return
        try:  # both events came before the flags this step's landing has waited for
            gap = (last[1].elapsed_time(f.end) / 1000 if self.device.type == "cuda" else f.end - last[1])
        except Exception:  # a measurement must never fail the requests in flight
            log.exception("reading the decode steps' end events failed; no more step gaps")
            self._gap_timing_failed = True
            return
        c = self.counters
        c.step_gaps += 1
        c.step_gap_seconds += gap
        c.step_gap_max_seconds = max(c.step_gap_max_seconds, gap)

    def restart_step_gaps(self, timeout: float = 60.0) -> None:
        """The largest gap from now on (on the engine's thread): start-up's warm-up steps compile and capture
        between steps, which no client meets."""
        def restart() -> None:
            self.counters.step_gap_max_seconds = 0.0
        self._on_engine_thread(restart, time.monotonic() + timeout)

    def _land(self, f: _Flight) -> None:
        """A launched step's flags on the host (its one host sync, or the wait for its copy), its timings, then
        its bookkeeping: counts, stream chunks, finished rows. Rows that moved since the launch are found
        through `f.slot_of`; rows admitted since (not in the step) stay as they are."""
        c = self.counters
        t0 = time.perf_counter()
        if f.host is None:
            hit_host = self._host_sync(f.hit)
        else:
            if f.ready is not None:
                f.ready.synchronize()
            hit_host = f.host[: f.b].copy()
        if f.step >= 0:  # a decode step's (an admission's first tokens are the prefill's)
            c.step_device_seconds += f.launch_seconds + time.perf_counter() - t0
        if f.events is not None:  # both events are done: they came before the flags
            c.step_gpu_seconds += f.events[0].elapsed_time(f.events[1]) / 1000
            c.step_gpu_samples += 1
            # the graph's own events are re-recorded by its next replay: unreadable once that is launched
            inner = f.inner if self._flight is None or self._flight.inner is not f.inner else None
            if inner is not None and not self._graph_timing_failed:
                try:
                    c.step_graph_seconds += inner[0].elapsed_time(inner[1]) / 1000
                    c.step_graph_samples += 1
                except Exception:
                    log.exception("reading a decode graph's own timing events failed; no more graph timings")
                    self._graph_timing_failed = True
        if f.step >= 0:
            self._count_gap(f)
        if f.step >= 0 and f.step % GIL_PROBE_EVERY == 0:
            t1 = time.perf_counter()
            time.sleep(0)  # lets the GIL go and takes it back: the wait a release costs now
            c.gil_wait_seconds += time.perf_counter() - t1
            c.gil_wait_samples += 1
        self._deliver()
        b = len(self.rows)
        where = f.slot_of[:b]
        stepped = where >= 0
        if stepped.all() and b == f.b and (where == np.arange(b)).all():
            self._advance(0, b, hit_host)
            return
        hit = np.zeros(b, dtype=bool)
        hit[stepped] = hit_host[where[stepped]]
        self._advance(0, b, hit, stepped)

    # -- host bookkeeping -------------------------------------------------------------------------
    def _advance(self, lo: int, hi: int, hit: np.ndarray, stepped: np.ndarray | None = None) -> None:
        """After a step of the rows in slots lo..hi-1: counts, stream chunks, finished requests. `stepped`: which
        of them the step ran (None: all; rows admitted after an overlapped step's launch were not in it)."""
        rows = self.rows
        cancelled = np.fromiter((rows[i].req.cancelled for i in range(lo, hi)), dtype=bool, count=hi - lo)
        kept = ~hit & ~cancelled
        if stepped is not None:
            kept &= stepped
        n = self.h_n[lo:hi]
        n += kept
        maxed = kept & (n >= self.h_max[lo:hi])
        chunks = []
        for slot in self.streaming:
            i = slot.idx - lo
            if 0 <= i < hi - lo and kept[i] and not maxed[i] and n[i] - slot.emitted >= max(1, slot.req.stream_every):
                chunks.append(self._emit(slot.idx, slot))
        if chunks:
            # with overlap the next host sync waits for an earlier step than these copies: they get their own event
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self._pending.extend(chunk + (ready,) for chunk in chunks)
        done = np.flatnonzero(hit | cancelled | maxed)
        if done.size:
            reasons = ["cancelled" if cancelled[j] else "eos" if hit[j] else "max_tokens" for j in done]
            self._finish_rows([(lo + int(j), r) for j, r in zip(done, reasons, strict=True)])

    def _emit(self, slot_id: int, slot: Slot) -> tuple:
        """The slot's tokens since its last chunk, copies queued; on_tokens gets them after the next host sync
        (the step's own), so streaming adds no sync of its own."""
        a, b = slot.emitted, int(self.h_n[slot_id])
        toks = self._d2h(self.tokens[slot_id, a:b])
        hid = self._d2h(self.hiddens[slot_id, a:b].float()) if slot.req.want_hidden else None
        slot.emitted = b
        return slot, toks, hid

    def _deliver(self) -> None:
        """Hand queued chunks to their consumers; call right after a host sync (their copies are done, or
        done with a step that is: the wait on their event is then a formality)."""
        pending, self._pending = self._pending, []
        for slot, toks, hid, ready in pending:
            if ready is not None:
                ready.synchronize()
            try:
                slot.req.on_tokens(toks, hid)
            except Exception:  # a failing consumer must not take the engine down: stop its generation
                log.exception("streaming callback failed; cancelling that generation")
                slot.req.cancel()

    def _finish_rows(self, items: list[tuple[int, str]]) -> None:
        results = list(zip((self.rows[i].req for i, _ in items), self._finished_results(items), strict=True))
        for slot_id, reason in items:
            slot = self.rows[slot_id]
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

    def _finished_results(self, items: list[tuple[int, str]]) -> list[GenResult]:
        """The results of the rows in `items` (slot, finish reason). The finished rows of one kind (text, codes,
        codes with hidden states) are gathered on the device and copied to the host together, each result a view
        of its row: a few copies per step instead of a few per result, which on the engine's thread cost tens of
        microseconds each (the host copies, their pinned buffers, the casts) with dozens of rows finishing at
        once. A result's view keeps its batch's host buffer alive until the last of them is dropped."""
        out: list[GenResult | None] = [None] * len(items)
        kinds: dict[tuple[bool, bool], list[tuple[int, int, int, str]]] = {}
        for pos, (slot_id, reason) in enumerate(items):
            n = int(self.h_n[slot_id])
            if reason not in ("eos", "max_tokens"):
                out[pos] = GenResult(None, None, reason, steps=n)
                continue
            req = self.rows[slot_id].req
            text = req.mode == "text"
            kinds.setdefault((text, req.want_hidden and not text), []).append((pos, slot_id, n, reason))
        for (text, hidden), rows in kinds.items():
            m = max(n for _, _, n, _ in rows)
            idx = self._h2d(torch.tensor([slot_id for _, slot_id, _, _ in rows], dtype=torch.int64))
            toks = self._d2h(self.tokens[:, :m, 0].index_select(0, idx) if text
                             else self.tokens[:, :m].index_select(0, idx))
            hid = self._d2h(self.hiddens[:, :m].index_select(0, idx).float()) if hidden else None
            for j, (pos, _, n, reason) in enumerate(rows):
                out[pos] = GenResult(toks[j, :n], None if hid is None else hid[j, :n], reason, steps=n)
        return out  # type: ignore[return-value]

    def _fail_all(self, error: BaseException) -> None:
        self._pending.clear()
        self._flight = self._first = None
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
