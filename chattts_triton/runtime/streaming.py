"""Streaming synthesis: audio chunks while the GPT generates, equal to the whole-utterance audio.

The windows and their seams are `chattts_triton.model.chunks`'s.

`StreamService` runs one utterance per stream on its own in-flight engine (a decoupled Triton
model cannot be a step of the non-streaming ensemble: an ensemble with a decoupled step is
decoupled itself and gRPC ModelInfer refuses it), the preprocess steps and the vocoder in-process.
Engine callbacks only queue tokens; one codec thread batches the due windows of all streams into
one vocoder call and sends the chunks, and polls cancellation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import FIRST_CHUNK_BUCKETS_MS, USE_DECODER_DEFAULT, first_chunk_bucket
from ..model.chunks import ChunkPlanner, Window, chunk_samples, largest_window
from .inputs import Outputs, Overloaded, get_bool
from .vocoder import CODEC_GRAPH_BATCH

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # the codec thread checks cancellations this often
WARM_STREAM_FRAMES = 256  # codec graphs captured at start-up: every frame bucket up to the largest window
# of the streams up to this long, for 1, 2, 4 .. CODEC_GRAPH_BATCH streams' windows in one call


def set_omp_threads(n: int | None) -> None:
    """This thread's torch intra-op (OpenMP) threads: `n`, or None to leave them."""
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)


@contextlib.contextmanager
def omp_threads(n: int | None):
    """The calling thread's torch ops on `n` OpenMP threads inside the block (None: as they are); its count is
    restored after (the count is per thread; the value later threads start from is torch's global, restored too)."""
    before = torch.get_num_threads()
    set_omp_threads(n)
    try:
        yield
    finally:
        set_omp_threads(before)


class Cancelled(RuntimeError):
    """The client cancelled the request (Triton CANCELLED)."""


@dataclass
class StreamCall:
    """One streaming request: `send(outputs, final)` a chunk (final ends it), `fail(exc)` ends it
    with an error, `cancelled()` says whether the client went away."""

    inputs: dict[str, Any]
    send: Callable[[Outputs, bool], None]
    fail: Callable[[BaseException], None]
    cancelled: Callable[[], bool]



def _is_first(w: Window) -> bool:
    """A stream's first chunk: its window starts at frame 0 and sends from its first sample."""
    return w.start == 0 and w.first == 0


class _Stream:
    __slots__ = ("call", "planner", "use_decoder", "codes", "hiddens", "req", "done", "error", "ended", "t_start",
                 "t_tokens", "held", "spoken")

    def __init__(self, call: StreamCall, planner: ChunkPlanner, use_decoder: bool, t_start: float,
                 spoken: np.ndarray | None = None):
        self.call, self.planner, self.use_decoder = call, planner, use_decoder
        self.spoken = spoken  # SPOKEN_TEXT, sent with the stream's first response
        self.t_start = t_start  # when its preprocessing began (monotonic)
        self.t_tokens: float | None = None  # when its first tokens reached the codec thread
        self.codes: list[torch.Tensor] = []
        self.hiddens: list[torch.Tensor] = []
        self.req = None
        self.done = False
        self.error: BaseException | None = None
        self.ended = False
        self.held: np.ndarray | None = None  # the last window's samples past its chunk, to fade from

    def frames(self) -> int:
        return sum(int(c.shape[0]) for c in self.codes)

    def window_input(self, w: Window) -> torch.Tensor:
        src = self.hiddens if self.use_decoder else self.codes
        return torch.cat(src, 0)[w.start:w.stop] if src else torch.zeros(0)


class StreamService:
    """`chattts_stream`: contract inputs → audio chunks, through its own engine and codec."""

    def __init__(self, preprocess, gpt, vocoder, first_chunk: int, chunk: int, lookahead: int,
                 max_streams: int, drain_file: str = "", first_lookahead: int | None = None, fade: int = 0,
                 exact: int | None = None, codec_stream: bool = False, first_chunks_first: bool = False,
                 side_threads: int | None = None):
        """side_threads: OpenMP threads of the codec thread and of each preprocess thread a stream starts on
        (None: the process's). On the CPU the factory gives 1, so that the engine's is the process's only OpenMP
        team: libgomp lets a team's idle workers spin only while the process's OpenMP threads fit the cores; with
        a second team the engine's worker sleeps and each of a step's parallel regions waits for a futex wake,
        a third slower decode step than `chattts_gpt`'s on an idle 2-core machine.
        codec_stream: on a GPU the codec thread launches on a CUDA stream of its own (its inputs are
        host memory the engine has finished with, its outputs are copied back before use), so a codec
        call's kernels can run beside the engine's step instead of queueing with it.
        first_chunks_first: a codec step decodes new streams' first windows in a call of their own, and
        sends them, before the other due windows (a first chunk then waits for a small call instead of
        one holding every running stream's next chunk; the others wait for one more call)."""
        schedule = dict(first_chunk=first_chunk, chunk=chunk, lookahead=lookahead,
                        first_lookahead=first_lookahead, fade=fade, exact=exact)
        smallest = ChunkPlanner(**schedule).min_window  # validates the schedule at start, not per request
        # bursts are split into windows no longer than the ones warm_codec captures graphs for
        self.schedule = dict(schedule, max_window=max(largest_window(schedule, WARM_STREAM_FRAMES), smallest))
        self.pre, self.gpt, self.voc = preprocess, gpt, vocoder
        self.codec_stream = (torch.cuda.Stream(device=vocoder.device) if codec_stream and vocoder.device.type == "cuda"
                             else None)
        self.first_chunks_first = first_chunks_first
        self.side_threads = side_threads
        self.max_streams = max_streams
        self.drain_file = drain_file
        self.events: queue.Queue = queue.Queue()
        self.streams: list[_Stream] = []  # owned by the codec thread
        self.admitted = 0  # streams started and not ended (any thread; under lock)
        self.lock = threading.Lock()
        self.stopping = False
        self.polled = 0.0  # when cancellations were last polled
        # cumulative, for metrics (written by the codec thread): where a first chunk's time goes
        self.counters = {"stream_first_chunks": 0, "stream_first_tokens_seconds": 0.0,
                         "stream_first_chunk_seconds": 0.0, "stream_chunks": 0, "stream_codec_calls": 0,
                         "stream_codec_seconds": 0.0, **{first_chunk_bucket(ms): 0 for ms in FIRST_CHUNK_BUCKETS_MS}}
        self.warm_codec()
        self.thread = threading.Thread(target=self._codec_loop, name="chattts-stream-codec", daemon=True)
        self.thread.start()

    def warm_codec(self) -> None:
        """With codec graphs: capture, now at start-up rather than in some client's chunk (a capture
        runs the codec four times and synchronises the whole GPU), the graph of every frame bucket a
        window can fall in, for every batch bucket of 1 .. CODEC_GRAPH_BATCH windows decoded together
        (decoder path)."""
        graphs = self.voc.graphs
        if graphs is None:
            return
        hidden = self.voc.arch.gpt.hidden
        frame_buckets = sorted({graphs.buckets(1, n)[1] for n in range(1, self.schedule["max_window"] + 1)})
        batches = sorted({graphs.buckets(n, 1)[0] for n in range(1, min(CODEC_GRAPH_BATCH, self.max_streams) + 1)})
        for batch in batches:
            for tb in frame_buckets:
                self.voc.synthesize([(True, torch.zeros(tb, hidden))] * batch)

    # -- intake (Triton's thread, then the preprocess pool) -------------------------------------
    def execute(self, calls: Sequence[StreamCall]) -> None:
        draining = self.stopping or (bool(self.drain_file) and os.path.exists(self.drain_file))
        for c in calls:
            if draining:
                c.fail(Overloaded("server is shutting down, retry on another instance"))
                continue
            with self.lock:
                busy = self.admitted >= self.max_streams
                if not busy:
                    self.admitted += 1
            if busy:
                c.fail(Overloaded(f"server busy: {self.max_streams} streams in flight, retry later"))
                continue
            self.pre.pool.submit(self._start, c)

    def _start(self, call: StreamCall) -> None:
        stream = None
        t_start = time.monotonic()
        set_omp_threads(self.side_threads)  # a pool thread: no OpenMP team of its own beside the engine's
        try:
            if call.cancelled():
                raise Cancelled("request cancelled")
            inputs = dict(call.inputs)
            inputs.update(self.pre.prepare(call.inputs))
            stream = _Stream(call, ChunkPlanner(**self.schedule),
                             get_bool(inputs, "USE_DECODER", USE_DECODER_DEFAULT), t_start, inputs.get("SPOKEN_TEXT"))
            req = self.gpt.request(inputs, lambda result, s=stream: self.events.put((s, "done", result)))
            req.on_tokens = lambda toks, hid, s=stream: self.events.put((s, "tokens", (toks, hid)))
            req.stream_every = stream.planner.tokens_needed()
            stream.req = req
            self.events.put((stream, "start", None))
            self.gpt.engine.submit(req)
        except Exception as e:  # noqa: BLE001  every failure ends this request only
            if stream is not None and stream.req is not None:  # already known to the codec thread
                self.events.put((stream, "done", e))
            else:
                self._end(call, e)

    def _end(self, call: StreamCall, error: BaseException | None = None, outputs: Outputs | None = None) -> None:
        with self.lock:
            self.admitted -= 1
        try:
            if error is not None:
                call.fail(error)
            else:
                call.send(outputs, True)
        except Exception:
            log.exception("ending a stream failed")

    # -- codec thread ---------------------------------------------------------------------------
    def _codec_loop(self) -> None:
        torch.set_grad_enabled(False)
        set_omp_threads(self.side_threads)
        if self.voc.device.type == "cuda":  # per thread, like the engine's
            torch.cuda.set_device(self.voc.device)
        if self.codec_stream is not None:
            with torch.cuda.stream(self.codec_stream):
                return self._codec_events()
        return self._codec_events()

    def _codec_events(self) -> None:
        while True:
            try:
                events = [self.events.get(timeout=CANCEL_POLL_S)]
            except queue.Empty:
                events = []
            while True:
                try:
                    events.append(self.events.get_nowait())
                except queue.Empty:
                    break
            closing = any(e is None for e in events)
            try:
                self._step([e for e in events if e is not None])
            except Exception as e:
                log.exception("stream codec step failed")
                self._fail_all(e)
            if closing:
                self._fail_all(Overloaded("stream model is shutting down"))
                return

    def _take(self, stream: _Stream, kind: str, payload) -> None:
        """One event of the engine's for `stream`: its start, tokens, error or whole result."""
        if kind == "start":
            self.streams.append(stream)
        elif kind == "tokens":
            toks, hid = payload
            if stream.t_tokens is None:
                stream.t_tokens = time.monotonic()
            stream.codes.append(toks)
            if hid is not None:
                stream.hiddens.append(hid)
        elif isinstance(payload, BaseException):
            stream.done, stream.error = True, payload
        else:  # the engine's whole result: keep the tail past what was streamed
            n = stream.frames()
            stream.codes.append(torch.from_numpy(payload["CODES"][0, n:]))
            if stream.use_decoder:
                stream.hiddens.append(torch.from_numpy(payload["HIDDENS"][0, n:]))
            stream.done = True

    def _step(self, events) -> None:
        touched = []
        for stream, kind, payload in events:
            self._take(stream, kind, payload)
            touched.append(stream)
        now = time.monotonic()
        if now - self.polled >= CANCEL_POLL_S:  # each poll is a round trip to Triton: not per event
            self.polled = now
            for s in self.streams:
                if not s.done and s.call.cancelled():
                    s.req.cancel()  # the engine frees the slot at its next step and reports "cancelled"
        due = []
        for s in dict.fromkeys(touched):
            if s.ended:
                continue
            if s.error is not None:
                self._finish(s, error=Cancelled("request cancelled") if s.call.cancelled() else s.error)
                continue
            frames = s.frames()
            w = s.planner.next(frames, s.done)
            while w is not None:  # several after a burst
                due.append((s, w))
                w = s.planner.next(frames, s.done)
        if not self.first_chunks_first:
            self._decode(due)
            return
        for group in ([d for d in due if _is_first(d[1])], [d for d in due if not _is_first(d[1])]):
            self._decode(group)

    def _decode(self, due: list[tuple[_Stream, Window]]) -> None:
        """One codec call for the windows `due` (in order per stream), then their chunks sent; a stream
        an earlier call of this step ended (its codec call failed) is skipped."""
        due = [(s, w) for s, w in due if not s.ended]
        if not due:
            return
        items = [(s.use_decoder, s.window_input(w)) for s, w in due]
        t0 = time.monotonic()
        try:
            audios = self.voc.synthesize(items)
        except Exception as e:
            log.exception("stream vocoder batch failed")
            for s, _ in due:
                s.req.cancel()
                self._finish(s, error=e)
            return
        c = self.counters
        c["stream_codec_calls"] += 1
        c["stream_codec_seconds"] += time.monotonic() - t0
        for (s, w), audio in zip(due, audios, strict=True):
            samples, s.held = chunk_samples(w, audio, s.held)
            chunk = {"AUDIO": samples.reshape(1, -1)}
            if _is_first(w) and s.spoken is not None:
                chunk["SPOKEN_TEXT"] = s.spoken
            c["stream_chunks"] += 1
            if w.final:
                self._finish(s, outputs=chunk)
            else:
                try:
                    s.call.send(chunk, False)
                except Exception:
                    log.exception("sending a stream chunk failed")
                    s.req.cancel()
                s.req.stream_every = max(1, s.planner.tokens_needed() - s.frames())
            if _is_first(w):
                now = time.monotonic()
                c["stream_first_chunks"] += 1
                c["stream_first_chunk_seconds"] += now - s.t_start
                for ms in FIRST_CHUNK_BUCKETS_MS:
                    if now - s.t_start <= ms / 1000.0:
                        c[first_chunk_bucket(ms)] += 1
                c["stream_first_tokens_seconds"] += (s.t_tokens or now) - s.t_start

    def _finish(self, s: _Stream, error: BaseException | None = None, outputs: Outputs | None = None) -> None:
        s.ended = True
        self.streams.remove(s)
        self._end(s.call, error, outputs)

    def _fail_all(self, error: BaseException) -> None:
        for s in list(self.streams):
            if s.req is not None:
                s.req.cancel()
            self._finish(s, error=error)

    # -- stats and lifecycle --------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {"streams": self.admitted, **self.gpt.stats(), **self.pre.stats(),
                **{k: round(v, 6) for k, v in self.counters.items()}}

    def close(self) -> None:
        """Stop taking streams, let the running ones finish, then stop the codec thread."""
        self.stopping = True
        self.pre.close()  # waits for requests still in preprocess: they reach the engine
        self.gpt.close()  # drains the engine: every stream gets its last tokens
        self.events.put(None)
        self.thread.join(60)
