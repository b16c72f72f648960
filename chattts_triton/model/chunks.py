"""Streaming chunks: which code-frame windows a stream decodes, and which of their samples it sends, so that
its chunks equal the whole-utterance audio.

Each chunk is decoded from a window of code frames holding `lookahead` frames of left and right
context around the frames it sends. With `lookahead >= codec.stream_lookahead_codes(arch)` (the
decoder + vocoder receptive field) every sent sample sees exactly the frames it sees in the
whole-utterance decode, so the concatenated chunks equal the `chattts` audio for the same seed
(up to float rounding of a different batch shape). A smaller lookahead sends earlier at the cost of
an approximation at the seams.

The first chunk may have its own, shorter lookahead (`first_lookahead`): it is sent after
`first_chunk + first_lookahead` frames instead of `first_chunk + lookahead`. Its samples are then the
first window's decode, which sees fewer frames to its right than the whole-utterance decode does.
With `fade` frames each approximate window (right context below the receptive field) also decodes the
`fade` frames after the samples it sends and holds them; the next window's first `fade` frames are a
raised-cosine blend from the held samples to its own. Exact windows hold nothing: their seams are
exact. Every blended sample is a convex combination of two decodes of the same frames, so it is never
further from the whole-utterance audio than the worse of the two, and the stream has no step at the
seam: between consecutive samples it moves by at most what one of the two decodes moves plus
π / (2 · fade samples) times their difference there (tests/test_streaming.py checks both bounds).
With the later chunks exact, everything after the first chunk's fade equals the whole-utterance audio.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import SAMPLES_PER_CODE, samples_for_codes
from .codec import stream_lookahead_codes


@dataclass(frozen=True)
class Window:
    """Decode code frames [start, stop) and send samples [first, last) of its audio; hold the `hold`
    samples after `last` to fade into the next window's first samples."""

    start: int
    stop: int
    first: int
    last: int
    final: bool
    hold: int = 0


class ChunkPlanner:
    """Which window to decode, and which of its samples to send, as code frames arrive.
    `lookahead`: context frames on each side of a chunk; `first_lookahead`: right context of the
    first chunk (None: `lookahead`); `fade`: frames cross-faded at each seam (module docstring);
    `exact`: the lookahead from which a window's decode equals the whole one
    (codec.stream_lookahead_codes): such windows hold nothing, their seams need no fade (None: every
    window holds); `max_window`: the most frames one window decodes (None: no cap) — frames that
    arrive in a burst (a codec call that lagged) are sent as several windows of at most this many,
    so a burst never needs a codec graph that was not captured at start-up. `next` then returns the
    next window each time it is called, until it returns None."""

    def __init__(self, first_chunk: int, chunk: int, lookahead: int, first_lookahead: int | None = None,
                 fade: int = 0, exact: int | None = None, max_window: int | None = None):
        first_lookahead = lookahead if first_lookahead is None else first_lookahead
        if min(first_chunk, chunk, lookahead, first_lookahead) < 1:
            raise ValueError("chunk sizes and lookaheads must be ≥ 1 code frame, got first chunk "
                             f"{first_chunk}, chunk {chunk}, lookahead {lookahead}, first lookahead {first_lookahead}")
        most = min(chunk, lookahead - 1, first_lookahead - 1)
        if not 0 <= fade <= most:
            raise ValueError(f"fade must be 0..{most} frames (at most the chunk, and shorter than either lookahead: "
                             f"the held frames need frames to their right), got {fade}")
        self.min_window = max(first_chunk + first_lookahead, lookahead + chunk + lookahead)  # a window without a burst
        if max_window is not None and max_window < self.min_window:
            raise ValueError(f"max_window must be at least {self.min_window} frames (a chunk with its left and right "
                             f"context), got {max_window}")
        self.first_chunk, self.chunk, self.lookahead = first_chunk, chunk, lookahead
        self.first_lookahead, self.fade, self.exact, self.max_window = first_lookahead, fade, exact, max_window
        self.sent = 0  # code frames whose samples were sent (all samples, once final)
        self.finished = False

    def _right(self) -> int:
        return self.first_lookahead if self.sent == 0 else self.lookahead

    def tokens_needed(self) -> int:
        """Frames that must exist before the next non-final chunk can be sent."""
        return self.sent + (self.first_chunk if self.sent == 0 else self.chunk) + self._right()

    def next(self, frames: int, done: bool) -> Window | None:
        """The window to send now, given `frames` generated so far (`done`: no more will come)."""
        if self.finished:
            return None
        start = max(0, self.sent - self.lookahead)
        first = (self.sent - start) * SAMPLES_PER_CODE
        # the window decodes [start, stop)
        stop = frames if self.max_window is None else min(frames, start + self.max_window)
        if done and stop == frames:
            self.finished = True
            return Window(start, frames, first, samples_for_codes(frames) - start * SAMPLES_PER_CODE, True)
        if frames < self.tokens_needed():
            return None
        right = self._right()
        end = stop - right  # everything that already has its right context
        hold = self.fade if self.exact is None or right < self.exact else 0
        w = Window(start, stop, first, (end - start) * SAMPLES_PER_CODE, False, hold * SAMPLES_PER_CODE)
        self.sent = end
        return w


def stream_windows(schedule: dict[str, int], frames: int) -> list[Window]:
    """The windows one stream of `frames` code frames decodes when they arrive one by one."""
    planner, wins = ChunkPlanner(**schedule), []
    for n in range(1, frames + 1):
        w = planner.next(n, n == frames)
        while w is not None:
            wins.append(w)
            w = planner.next(n, n == frames)
    return wins


def largest_window(schedule: dict[str, int], longest: int) -> int:
    """The most code frames one window decodes, over the streams of 1 .. `longest` frames arriving one
    by one (frames that arrive in a burst make longer windows unless `max_window` caps them)."""
    return max(w.stop - w.start for frames in range(1, longest + 1) for w in stream_windows(schedule, frames))


def stream_schedule(arch, first_chunk: int, chunk: int, lookahead: int = 0, first_lookahead: int = 0,
                    fade: int = 0) -> dict[str, int]:
    """The ChunkPlanner arguments a `chattts_stream` instance runs with, from its config values:
    lookahead 0 is the codec's receptive field (exact chunks), first_lookahead 0 is the later chunks'
    lookahead, and either is capped at the receptive field (more context only delays a chunk).
    Raises ValueError on a schedule the planner refuses."""
    exact = stream_lookahead_codes(arch)
    look = min(lookahead or exact, exact)
    schedule = dict(first_chunk=first_chunk, chunk=chunk, lookahead=look,
                    first_lookahead=min(first_lookahead or look, exact), fade=fade, exact=exact)
    ChunkPlanner(**schedule)
    return schedule


def fade_in(n: int) -> np.ndarray:
    """Raised-cosine weights of the newer window over n samples: 0 < w < 1, rising, symmetric
    (w[i] + w[n-1-i] = 1); consecutive weights differ by at most π / (2n)."""
    return (0.5 - 0.5 * np.cos(np.pi * (np.arange(n) + 0.5) / n)).astype(np.float32)


def crossfade(held: np.ndarray, new: np.ndarray) -> np.ndarray:
    """`new` with its first len(held) samples faded in from `held` (the same samples, decoded by the
    previous window)."""
    k = min(held.shape[0], new.shape[0])
    out = np.array(new, dtype=np.float32, copy=True)
    w = fade_in(k)
    out[:k] = (1.0 - w) * held[:k] + w * new[:k]
    return out


def chunk_samples(w: Window, audio: np.ndarray, held: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """What window `w` sends from its decoded `audio` (faded in from the previous window's `held`
    samples), and what it holds for the next window."""
    samples = audio[w.first:w.last]
    if held is not None:
        samples = crossfade(held, samples)
    return np.ascontiguousarray(samples, dtype=np.float32), (
        np.array(audio[w.last:w.last + w.hold], dtype=np.float32) if w.hold else None)
