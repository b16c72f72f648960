"""The stream's chunk plan (chattts_triton/model/chunks.py): windows that tile the utterance and see their context,
the first chunk's own lookahead, bursts capped, the schedule read from the config, the fade's weights."""

from __future__ import annotations

import random

import numpy as np
import pytest

from chattts_triton.config import FULL_ARCH, SAMPLES_PER_CODE, TINY_ARCH, samples_for_codes
from chattts_triton.model.chunks import ChunkPlanner, crossfade, fade_in
from chattts_triton.model.codec import stream_lookahead_codes

TEXT = "你好，欢迎使用流式合成。"


def plan_all(planner: ChunkPlanner, total: int, arrivals):
    """Feed frames in the given arrival sizes; returns the windows, final one last."""
    wins, n = [], 0
    for k in arrivals:
        n = min(total, n + k)
        w = planner.next(n, False)
        while w is not None:
            wins.append((n, w))
            w = planner.next(n, False)
        if n == total:
            break
    w = planner.next(total, True)
    while w is not None:
        wins.append((total, w))
        w = planner.next(total, True)
    return wins


@pytest.mark.parametrize("total", [0, 1, 2, 30, 61, 62, 200])
@pytest.mark.parametrize("first,chunk,look,first_look,fade",
                         [(8, 32, 53, None, 0), (1, 1, 1, None, 0), (3, 5, 14, None, 0), (8, 32, 53, 8, 4),
                          (3, 5, 14, 3, 2), (2, 3, 4, 2, 1)])
@pytest.mark.parametrize("burst,cap", [(9, None), (90, None), (90, 0), (90, 7)])
def test_planned_chunks_tile_the_utterance_and_see_their_context(total, first, chunk, look, first_look, fade,
                                                                 burst, cap):
    """Frames arrive in random bursts of up to `burst`; `cap`: max_window above the smallest allowed."""
    rng = random.Random(total * 7 + first)
    smallest = ChunkPlanner(first, chunk, look, first_look, fade).min_window
    max_window = None if cap is None else smallest + cap
    planner = ChunkPlanner(first, chunk, look, first_look, fade, max_window=max_window)
    wins = plan_all(planner, total, [rng.randint(1, burst) for _ in range(1000)])
    assert wins[-1][1].final and all(not w.final for _, w in wins[:-1])
    if max_window is not None:
        assert max(w.stop - w.start for _, w in wins) <= max_window
        if total > 2 * max_window:
            assert len(wins) > total // max_window  # the bursts were split
    pos, held = 0, 0
    for k, (n, w) in enumerate(wins):
        g0, g1 = w.start * SAMPLES_PER_CODE + w.first, w.start * SAMPLES_PER_CODE + w.last
        assert g0 == pos and g1 >= g0  # contiguous, no overlap, no gap
        assert g1 - g0 >= held  # the samples the previous window held are faded into this one's
        pos = g1
        assert w.stop <= n and w.last <= samples_for_codes(w.stop - w.start)
        if not w.final:  # sent samples see `look` frames on the left and their lookahead on the right
            right = (first_look or look) if k == 0 else look
            assert w.start == 0 or g0 >= (w.start + look) * SAMPLES_PER_CODE
            assert g1 <= (w.stop - right) * SAMPLES_PER_CODE
            assert w.hold == fade * SAMPLES_PER_CODE
            assert w.last + w.hold <= samples_for_codes(w.stop - w.start)  # held samples exist, none at the edge
        held = min(w.hold, samples_for_codes(w.stop - w.start) - w.last)
    assert wins[-1][1].hold == 0
    assert pos == samples_for_codes(total)
    assert planner.next(total, True) is None  # nothing after the final chunk


def test_first_chunk_waits_only_for_its_frames_plus_lookahead():
    p = ChunkPlanner(8, 32, 53)
    assert p.tokens_needed() == 61 and p.next(60, False) is None
    w = p.next(61, False)
    assert (w.start, w.stop, w.first, w.last, w.hold) == (0, 61, 0, 8 * SAMPLES_PER_CODE, 0)
    assert p.tokens_needed() == 8 + 32 + 53
    p = ChunkPlanner(8, 32, 53, first_lookahead=8, fade=4)  # the served default on full-size weights
    assert p.tokens_needed() == 16 and p.next(15, False) is None
    w = p.next(16, False)
    assert (w.start, w.stop, w.first, w.last, w.hold) == (0, 16, 0, 8 * SAMPLES_PER_CODE, 4 * SAMPLES_PER_CODE)
    assert p.tokens_needed() == 8 + 32 + 53  # the later chunks keep the full lookahead
    p = ChunkPlanner(8, 32, 53, first_lookahead=8, fade=4, exact=53)
    holds = [w.hold for w in (p.next(16, False), p.next(93, False), p.next(125, False), p.next(150, True))]
    assert holds == [4 * SAMPLES_PER_CODE, 0, 0, 0]  # exact windows hold nothing: their seams are exact
    for bad in [(8, 32, 0), (8, 32, 53, 0), (8, 32, 53, 8, 9), (8, 3, 53, 8, 4), (8, 32, 4, 8, 4), (8, 32, 53, 8, 8),
                (8, 32, 53, 8, -1), (8, 32, 53, 8, 4, 53, 137)]:
        with pytest.raises(ValueError):
            ChunkPlanner(*bad)


def test_a_burst_of_frames_is_sent_as_windows_no_longer_than_the_cap():
    p = ChunkPlanner(8, 32, 53, first_lookahead=8, fade=4, exact=53, max_window=138)
    assert p.min_window == 138  # 53 frames each side of a 32-frame chunk
    wins = [p.next(300, False) for _ in range(5)]  # 300 frames at once: not one window of 300
    assert [(w.start, w.stop, w.last // SAMPLES_PER_CODE) for w in wins[:4]] == [
        (0, 138, 130), (77, 215, 85), (109, 247, 85), (141, 279, 85)]  # each sends what has its right context
    assert wins[4] is None  # the next chunk needs 53 frames after the 226 sent
    last = [p.next(400, True) for _ in range(5)]  # done with 400: still capped, the final one last
    assert [(w.start, w.stop, w.final) for w in last[:4]] == [
        (173, 311, False), (205, 343, False), (237, 375, False), (269, 400, True)]
    assert last[4] is None


def test_stream_schedule_reads_zero_as_exact_and_caps_at_the_receptive_field():
    from chattts_triton.model.chunks import stream_schedule

    exact = stream_lookahead_codes(FULL_ARCH)
    assert stream_schedule(FULL_ARCH, 8, 32) == dict(first_chunk=8, chunk=32, lookahead=exact, first_lookahead=exact,
                                                     fade=0, exact=exact)
    assert stream_schedule(FULL_ARCH, 8, 32, 0, 8, 4)["first_lookahead"] == 8
    assert stream_schedule(FULL_ARCH, 8, 32, 500, 500, 4)["lookahead"] == exact
    assert stream_schedule(FULL_ARCH, 8, 32, 12, 0, 4)["first_lookahead"] == 12
    with pytest.raises(ValueError, match="fade"):
        stream_schedule(FULL_ARCH, 8, 32, 0, 4, 4)


def test_fade_weights_rise_smoothly_and_sum_to_one_with_their_mirror():
    for n in (1, 2, 7, 2048):
        w = fade_in(n).astype(np.float64)
        assert w.shape == (n,) and (w > 0).all() and (w < 1).all() and (np.diff(w) > 0).all()
        assert np.allclose(w + w[::-1], 1.0, atol=1e-6)
        assert np.abs(np.diff(np.concatenate([[0.0], w, [1.0]]))).max() <= np.pi / (2 * n) + 1e-6
    held, new = np.full(4, 2.0, np.float32), np.arange(6, dtype=np.float32)
    out = crossfade(held, new)
    assert np.array_equal(out[4:], new[4:]) and np.array_equal(new, np.arange(6))  # the input is untouched
    assert np.allclose(out[:4], (1 - fade_in(4)) * 2.0 + fade_in(4) * new[:4])


def test_lookahead_is_the_codec_receptive_field():
    # full size: decoder 2 + 12*6 + 1, vocos 3 * 9, ISTFT 2 mel frames = 104 → 52 code frames + 1
    assert stream_lookahead_codes(FULL_ARCH) == 53
    assert stream_lookahead_codes(TINY_ARCH) < 53
