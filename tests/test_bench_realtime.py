"""bench.realtime: the gap margins on hand-made timelines, the LLM-token split, its flags; end to end, briefly,
against the served tiny repository: every figure of the report is filled and nothing failed."""

from __future__ import annotations

import json

import pytest

RATE = 1000  # samples per second: a sample is a millisecond
PCM = 2  # bytes per sample


def test_a_piece_that_arrives_before_the_audio_ahead_of_it_has_played_has_a_positive_margin():
    from bench.realtime import margins

    # piece 0: 500 samples at t=10.0; piece 1 (starting at sample 500) arrives at 10.3: needed at 10.5
    frames = [(10.0, 500 * PCM), (10.3, 400 * PCM)]
    assert margins(frames, [500], RATE, PCM) == pytest.approx([0.2])


def test_a_piece_that_arrives_after_the_audio_ahead_of_it_has_played_is_a_gap():
    from bench.realtime import margins

    frames = [(0.0, 200 * PCM), (0.1, 100 * PCM), (0.45, 300 * PCM)]  # piece 1 from sample 300 is needed at 0.3
    assert margins(frames, [300], RATE, PCM) == pytest.approx([-0.15])


def test_margins_find_a_piece_start_inside_a_frame_and_over_several_pieces():
    from bench.realtime import margins

    # one frame holds piece 0's end and piece 1's start (sample 150 inside the frame of samples 100-299)
    frames = [(0.0, 100 * PCM), (0.05, 200 * PCM), (0.25, 100 * PCM), (0.9, 100 * PCM)]
    m = margins(frames, [150, 300, 400], RATE, PCM)
    assert m == pytest.approx([0.15 - 0.05, 0.3 - 0.25, 0.4 - 0.9])


def test_margins_count_bytes_of_one_byte_samples_for_g711():
    from bench.realtime import margins

    frames = [(1.0, 800), (1.05, 800)]  # 8 kHz u-law: 800 bytes are 0.1 s
    assert margins(frames, [800], 8000, 1) == pytest.approx([0.05])


def test_margins_of_a_piece_whose_audio_never_came_name_the_sample():
    from bench.realtime import margins

    with pytest.raises(ValueError, match="no audio byte at sample 300"):
        margins([(0.0, 200 * PCM)], [300], RATE, PCM)
    assert margins([], [300], RATE, PCM) == []


def test_frame_margins_see_a_stall_inside_one_piece():
    from bench.realtime import frame_margins, margins

    frames = [(0.0, 100 * PCM), (0.05, 100 * PCM), (0.35, 100 * PCM)]  # the third frame is needed at 0.2
    assert frame_margins(frames, RATE, PCM) == pytest.approx([0.05, -0.15])
    assert margins(frames, [], RATE, PCM) == []  # one piece: no piece margin


@pytest.mark.parametrize("text", ["Hello there, how are you today?", "第一句话很好。第二句有问题，对吧？",
                                  " Mixed 中文和 English text。 Yes!"])
def test_llm_tokens_join_back_to_the_text_a_word_or_a_few_cjk_characters_each(text):
    from bench.realtime import llm_tokens

    toks = llm_tokens(text)
    assert "".join(toks) == text
    assert all(len(t.strip()) <= 3 for t in toks if not t.strip().isascii())
    assert all(" " not in t.strip() for t in toks)


@pytest.mark.parametrize("args, flag", [
    (["--sessions", "0"], "--sessions"),
    (["--tokens-per-s", "0"], "--tokens-per-s"),
    (["--frames", "-3"], "--frames"),
    (["--sample-rate", "11025"], "--sample-rate"),
    (["--response-format", "mp3"], "--response-format"),
    (["--turns", "x"], "--turns"),
    (["--gateway-url", "ws://h:1/v1/audio/speech/stream"], "--gateway-url"),
    ([], "--repo"),
])
def test_bench_realtime_refuses_a_bad_flag_naming_it(args, flag, capsys):
    from bench.realtime import main

    with pytest.raises(SystemExit) as e:
        main(["--out", "o", *(["--repo", "r"] if flag != "--repo" else []), *args])
    assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.e2e
def test_bench_realtime_fills_every_figure_against_a_served_repository(served_tiny, tmp_path):
    from bench.realtime import REPLY, main

    out = tmp_path / "rt"
    assert main(["--grpc-url", served_tiny.grpc_url, "--metrics-url",
                 f"http://127.0.0.1:{served_tiny.metrics_port}/metrics", "--out", str(out),
                 # the CPU server admits 4 streams: one piece at a time per session keeps 2 sessions inside it
                 "--gateway-arg=--piece-concurrency=1", "--sessions", "2", "--turns", "2", "--warmup", "1",
                 "--barge-ins", "1", "--frames", "16", "--long-frames", "400", "--max-new-tokens", "24",
                 "--audio-seconds", "0.5", "--audio-repeats", "1"]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["errors"] == []
    fa, ng, bi = res["first_audio"], res["no_gaps"], res["barge_in"]
    assert fa["turns"] == 2 and 0 < fa["chunk_p50_ms"] and 0 < fa["ws_p50_ms"] <= fa["ws_max_ms"]
    assert ng["sessions_ok"] == 2 and ng["margins"] == ng["pieces"] - 2  # a margin for each piece after the first
    for s in ng["per_session"]:  # the whole reply spoken, piece by piece (long sentences at their clauses)
        assert "".join(s["texts"]).replace(" ", "") == "".join(REPLY).replace(" ", "") and len(s["texts"]) >= 6
        assert len(s["margins_ms"]) == len(s["texts"]) - 1 and all(d > 0 for d in s["piece_s"])
    assert ng["worst_margin_ms"] <= ng["p1_margin_ms"] <= ng["p50_margin_ms"] and ng["audio_s"] > 0
    assert 0 <= ng["negative"] <= 10 and ng["frames"] > 0
    assert ng["text_bound"] + ng["floor_bound"] <= ng["margins"] and ng["floor_bound"] >= 0
    assert 0 < ng["cut_to_audio_p50_ms"] <= ng["cut_to_audio_p99_ms"] <= ng["cut_to_audio_max_ms"]
    (row,) = bi["rows"]
    assert row["busy_at_turn_cancelled"] >= 0 and row["freed_ms"] > 0 and bi["not_freed"] == 0
    assert 0 < row["inflight_freed_ms"] <= row["freed_ms"]
    assert 0 <= bi["last_audio_p50_ms"] and 0 < bi["cancelled_p50_ms"] and bi["step_ms"] > 0
    rel = bi["engine_released"]  # the cancelled piece's row, on the engine's own clock
    assert rel["rows"] >= 1 and rel["late"] == 0 and 0 < rel["mean_ms"] <= rel["max_ms"]
    rates = {r["rate"] for r in res["audio_cost"]["rows"] if r["what"] == "ulaw"}
    assert rates >= {8000, 24000}
    md = out.with_suffix(".md").read_text()
    for line in ("| first audio − first chunk, p50", "| no gaps: 2 sessions", "cancel → last audio byte",
                 "cancel → turn.cancelled", "decode steps of", "late **0**", "| ulaw | 8000 |", "Errors: 0"):
        assert line in md, line


def test_cut_times_are_when_the_sessions_chunker_gave_each_piece_out():
    from bench.realtime import cut_times

    tokens = ["Hello ", "there", ". How ", "are you", "? Fine", "."]
    sent = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    # "there." waits for a space or the next token? a "." after a letter ends it at once: the token ". How " does
    assert cut_times(tokens, sent, 0.9, 384, 0) == [0.2, 0.4, 0.5]
    assert cut_times(["no end"], [0.0], 0.9, 384, 0) == [0.9]  # the flush gives it out
