"""CUDA graphs captured on first use, by key, into one memory pool (the engine's decode steps and
prefills: `CudaGraphs` and its buckets; the codec's padded batches), and device-to-host copies that wait on an
event. Plain PyTorch: no Triton here."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .engine import Engine
    from .request import GenRequest

log = logging.getLogger(__name__)

# One capture at a time per process: entering torch.cuda.graph synchronises the device and empties the
# allocator's cache, which asserts that no other capture is under way (the stream model's engine and
# codec threads both capture)
_CAPTURE_LOCK = threading.Lock()


def to_host(t: Tensor) -> Tensor:
    """`t` on the host. CUDA: an async copy into pinned memory, then a wait on an event recorded after
    it, instead of a blocking copy (which can hold up other threads' launches while it waits for the
    GPU). A CPU tensor is returned as it is."""
    host, done = to_host_async(t)
    if done is not None:
        done.synchronize()
    return host


def to_host_async(t: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """`to_host` without the wait: the pinned host tensor and the event that follows its copy (None: a CPU tensor,
    returned as it is). Copies enqueued one after another on a stream finish in order, so waiting for the last event
    waits for them all."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # on t's device's current stream
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    return host, done


def graph_events() -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
    """Two timing events that a capture records as nodes of its graph (`external`): each replay then
    stamps its own start and end on the GPU's clock, whatever the host did around the launch. None
    where this torch has no external events."""
    try:
        return torch.cuda.Event(enable_timing=True, external=True), torch.cuda.Event(enable_timing=True, external=True)
    except TypeError:
        return None


def bucket(n: int, step: int, largest: int) -> int:
    """Padded size for n: powers of two up to `step`, then multiples of it, at most `largest`."""
    if n <= step:
        b = 1
        while b < n:
            b *= 2
    else:
        b = -(-n // step) * step
    return min(b, largest)


class GraphCache:
    """Replays of `fn` by key, each captured on first use (after `warm` ran on a side stream) into
    one pool that its graphs share: they must never run at once, so one thread replays them.
    capture=False (CPU tests): `fn` runs eagerly, after `warm`, with the same keys and padding."""

    def __init__(self, device: torch.device, capture: bool = True):
        self.device = device
        self.capture = capture
        self.graphs: dict[Hashable, Callable[[], Tensor] | None] = {}
        if capture:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device=device)

    def _graph(self, key: Hashable, warm: Callable[[], object], fn: Callable[[], Tensor],
               timed: bool = False) -> Callable[[], Tensor] | None:
        """The replay of `fn` for `key`, captured on first use; None: run it eagerly. timed: the graph
        also records `graph_events()` around `fn`, as the replay's attribute `events` (None without)."""
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(key, warm, fn, timed)
            except RuntimeError:  # never fail requests over an optimisation: run this bucket eagerly
                if not self.capture:  # the eager stand-in has no capture to fail: a real error
                    raise
                log.exception("CUDA graph capture failed for %s; running it eagerly", key)
                self.graphs[key] = None
        return self.graphs[key]

    def _capture(self, key: Hashable, warm: Callable[[], object], fn: Callable[[], Tensor],
                 timed: bool = False) -> Callable[[], Tensor]:
        if not self.capture:
            warm()
            return fn
        with _CAPTURE_LOCK:
            cur = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                warm()
            cur.wait_stream(self.stream)
            events = graph_events() if timed else None
            try:
                graph, out = self._record(fn, events)
            except RuntimeError as e:
                if events is None:
                    raise
                # timing is a measurement: never lose the graph over it (a failure of the capture itself
                # fails again below, and _graph logs it)
                log.warning("CUDA graph %s: capture with timing events failed (%s); capturing it without", key, e)
                events = None
                graph, out = self._record(fn, None)
        log.info("captured CUDA graph %s", key)

        def run() -> Tensor:
            graph.replay()
            return out

        run.events = events  # type: ignore[attr-defined]
        return run

    def _record(self, fn: Callable[[], Tensor], events) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (the stream model's codec, the engine) keep
        # running eagerly or replaying during a capture; the default "global" mode fails their
        # calls with cudaErrorStreamCaptureUnsupported
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            if events is not None:
                events[0].record()
            out = fn()
            if events is not None:
                events[1].record()
        return graph, out


BATCH_STEP = 32  # batch buckets: powers of two up to this, then its multiples (≤ 31 padding rows)
LEN_STEP = 128  # attention-length buckets: multiples of this
PREFILL_LEN_STEP = 32  # prompt-length buckets: powers of two up to this, then its multiples
PREFILL_GRAPH_TOKENS = 4096  # larger padded (or packed) prefills run eagerly
PACKED_STEP = 256  # packed prefills' token buckets: powers of two up to this, then its multiples
PACKED_WARM_TOKENS = 1024  # packed prefill graphs captured by warm_up (the larger ones: warm_graphs)
PREFILL_WARM_BATCHES = (1, 2, 4, 8, 16, 32)  # prefill graphs captured by warm_up: prompts per prefill ...
PREFILL_WARM_LENGTHS = (16, 32, 64, 128)  # ... times prompt-length bucket
WARM_DECODE_LEN = 512  # warm_graphs: decode graphs of every batch bucket up to this attention length


def bucket_sizes(step: int, largest: int) -> list[int]:
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
    `Engine.run_prefill` (slots as a tensor, so one graph serves any slots). Packed prefills
    (`Engine.packed_prefill`): one graph per token bucket (PACKED_STEP) up to PREFILL_GRAPH_TOKENS, whatever the
    prompts' count and lengths.
    All are captured on first use into one shared memory pool; with capture=False (CPU tests) the
    same buckets run eagerly.
    """

    def __init__(self, engine: Engine, capture: bool = True):
        super().__init__(engine.device, capture)
        self.e = engine
        self.prefill_inputs: dict[tuple, tuple[Tensor, ...]] = {}
        self.last_events = None  # see step

    def buckets(self, b: int, attn_len: int) -> tuple[int, int]:
        e = self.e
        if e.decode_kernel:  # each row reads its own keys whatever attn_len: one graph per batch bucket
            return bucket(b, BATCH_STEP, e.max_slots), LEN_STEP
        return bucket(b, BATCH_STEP, e.max_slots), bucket(max(attn_len, LEN_STEP), LEN_STEP, e.max_context)

    def prefill_buckets(self, k: int, t: int) -> tuple[int, int]:
        e = self.e
        return bucket(k, BATCH_STEP, e.max_slots), bucket(t, PREFILL_LEN_STEP, e.max_context)

    def step(self, b: int, attn_len: int, mode: str) -> Tensor | None:
        """eos_hit [bucket] of one step of the live rows 0..b-1, or None: run it eagerly.
        `last_events`: the timing events of the graph it replayed (None: eager, or untimed)."""
        self.last_events = None
        run = self.decode_graph(mode, *self.buckets(b, attn_len))
        if run is None:
            return None
        self.e._set_live(b)
        self.last_events = getattr(run, "events", None)
        return run()

    def decode_graph(self, mode: str, bb: int, lb: int) -> Callable[[], Tensor] | None:
        return self._graph((mode, bb, lb), lambda: self._warm(mode, bb, lb), lambda: self._step(mode, bb, lb),
                           timed=True)

    def failed_decode_buckets(self) -> list[tuple]:
        """Decode buckets whose capture failed (they run eagerly); failed prefill buckets are not
        counted (they run eagerly too, and a compiled prefill that fails falls back by itself)."""
        return [key for key, run in self.graphs.items() if run is None and key[0] not in ("prefill", "packed")]

    def prefill(self, b0: int, reqs: Sequence[GenRequest]) -> Tensor | None:
        """`Engine.run_prefill` of the prompts `reqs` padded into slots b0.. from the graph of their bucket:
        [bucket rows, hidden], the first len(reqs) rows theirs; None over PREFILL_GRAPH_TOKENS."""
        kb, tb = self.prefill_buckets(len(reqs), max(r.prompt_len for r in reqs))
        if kb * tb > PREFILL_GRAPH_TOKENS:  # compute-bound anyway: not worth a graph per shape
            return None
        return self._replay_prefill(("prefill", kb, tb), self.e._prompt_batch(reqs, kb, tb, b0))

    def prefill_packed(self, b0: int, reqs: Sequence[GenRequest]) -> Tensor | None:
        """`Engine.run_prefill` of the prompts `reqs` packed into slots b0.. (`_packed_batch`) from the graph of
        their token bucket: the last position's hidden state of each [len(reqs), hidden]; None over
        PREFILL_GRAPH_TOKENS."""
        tb = self.packed_bucket(sum(r.prompt_len for r in reqs))
        if tb > PREFILL_GRAPH_TOKENS:
            return None
        *inputs, last = self.e._packed_batch(reqs, tb, b0)
        return self._replay_prefill(("packed", tb), inputs).index_select(0, last)

    def _replay_prefill(self, key: tuple, inputs: Sequence[Tensor]) -> Tensor:
        """The prefill graph of `key` over static copies of `inputs` (captured on first use)."""
        e = self.e
        static = self.prefill_inputs.get(key)
        if static is None:
            static = self.prefill_inputs[key] = tuple(torch.empty_like(t) for t in inputs)
        for buf, t in zip(static, inputs, strict=True):
            buf.copy_(t)
        # warm-up and capture runs compute this very prefill (the same writes each time)
        run = self._graph(key, lambda: [e.run_prefill(*static) for _ in range(3)], lambda: e.run_prefill(*static))
        return e.run_prefill(*static) if run is None else run()

    def first_tokens(self, b0: int, k: int, h: Tensor, redraw: Sequence[bool], attempts: int) -> Tensor | None:
        """`Runner.sample_first` of k freshly prefilled code rows in slots b0.. (h [k, hidden]: their last
        positions' hidden states; redraw: each row's ensure_non_empty) from the graph of their prompt-count
        bucket: the EOS flags [bucket], the first k theirs; None where the bucket's padding rows would reach past
        the last slot. Eagerly the draws are ≈ 200 small kernels of host launch time per admission; one replay
        instead. The slots, the count and the redraw flags go to the device in one copy."""
        e = self.e
        kb = bucket(k, BATCH_STEP, e.max_slots)
        if b0 + kb > e.max_slots:
            return None
        meta, hs = self._first_inputs(kb)
        hs[:k].copy_(h)
        key = ("first", kb, attempts)
        host = torch.zeros(kb + 2, dtype=torch.int64)
        host[0] = b0
        if key not in self.graphs:  # captured with k = 0: its warm-up and capture runs touch no row's state
            e._h2d_into(meta, host)
            self.first_graph(kb, attempts)
        host[1] = k
        host[2 : 2 + k] = torch.tensor(redraw, dtype=torch.int64)
        e._h2d_into(meta, host)
        run = self.graphs[key]
        return self._first(kb, attempts) if run is None else run()

    def first_graph(self, kb: int, attempts: int) -> Callable[[], Tensor] | None:
        """The first-token graph of `kb` rows (captured now if new, over its inputs as they are: at
        start-up, slots 0.. with no row counted)."""
        self._first_inputs(kb)

        def warm() -> None:
            for _ in range(3):
                self._first(kb, attempts)

        return self._graph(("first", kb, attempts), warm, lambda: self._first(kb, attempts))

    def _first_inputs(self, kb: int) -> tuple[Tensor, Tensor]:
        """The static inputs of the first-token graphs of `kb` rows: meta [kb + 2] int64 (first slot, rows counted,
        then each row's redraw flag) and the hidden states [kb, hidden] (float)."""
        key = ("first", kb)
        static = self.prefill_inputs.get(key)
        if static is None:
            dev = self.e.device
            static = self.prefill_inputs[key] = (torch.zeros(kb + 2, dtype=torch.int64, device=dev),
                                                 torch.zeros(kb, self.e.hidden, dtype=torch.float32, device=dev))
        return static  # type: ignore[return-value]

    def _first(self, kb: int, attempts: int) -> Tensor:
        """What a first-token graph runs: rows past the count are padding over the free slots after them (their
        draws land there, their counts and attempts do not move)."""
        e = self.e
        meta, hs = self.prefill_inputs[("first", kb)]
        rows = torch.arange(kb, device=e.device)
        st = meta[0] + rows
        return e.sample_first(st, e.row_params.select(st), hs, "code", meta[2:].bool(), attempts,
                              valid=rows < meta[1])

    def packed_bucket(self, tokens: int) -> int:
        return bucket(tokens, PACKED_STEP, tokens + PACKED_STEP)  # (never below tokens)

    def _step(self, mode: str, bb: int, lb: int) -> Tensor:
        e = self.e
        # text mode (refine text, rare) keeps the plain step: inductor 2.11 fails to generate its
        # top-P scan over the 21178-id text vocabulary at a dynamic batch
        step = e.compiled_step(bb)
        if step is None or mode != "code":
            return e.step_core(0, bb, lb, mode, e.n_live)
        # frozen: a bucket the warm-up did not compile for runs the plain step (still in a graph)
        with torch.compiler.set_stance(e.compile_stance()):
            return step(0, bb, lb, mode, e.n_live)

    def _warm(self, mode: str, bb: int, lb: int) -> None:
        # n_live = 0: every row is padding, so a live row only gets the writes (its KV at its current
        # position, its next token/hidden) that its next real step makes again before reading them
        e = self.e
        e._set_live(0)
        for _ in range(3):
            self._step(mode, bb, lb)
