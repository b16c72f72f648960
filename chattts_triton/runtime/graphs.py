"""CUDA graphs captured on first use, by key, into one memory pool (the engine's decode steps and
prefills, the codec's padded batches), and device-to-host copies that wait on an event. Plain
PyTorch: no Triton here."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Hashable, Optional, Tuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# One capture at a time per process: entering torch.cuda.graph synchronises the device and empties the
# allocator's cache, which asserts that no other capture is under way (the stream model's engine and
# codec threads both capture)
_CAPTURE_LOCK = threading.Lock()


def to_host(t: Tensor) -> Tensor:
    """`t` on the host. CUDA: an async copy into pinned memory, then a wait on an event recorded after
    it, instead of a blocking copy (which can hold up other threads' launches while it waits for the
    GPU). A CPU tensor is returned as it is."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # on t's device's current stream
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return host


def graph_events() -> Optional[Tuple[torch.cuda.Event, torch.cuda.Event]]:
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
        self.graphs: Dict[Hashable, Optional[Callable[[], Tensor]]] = {}
        if capture:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device=device)

    def _graph(self, key: Hashable, warm: Callable[[], object], fn: Callable[[], Tensor],
               timed: bool = False) -> Optional[Callable[[], Tensor]]:
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

    def _record(self, fn: Callable[[], Tensor], events) -> Tuple[torch.cuda.CUDAGraph, Tensor]:
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
