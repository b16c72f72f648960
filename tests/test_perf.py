"""`python -m bench.perf` (`make perf`): Triton's perf_analyzer against the served `chattts` ensemble."""

from __future__ import annotations

import json

import pytest

from bench import perf

pytestmark = pytest.mark.e2e


def test_input_data_forces_the_frames_and_names_only_contract_inputs(tmp_path):
    from chattts_triton.config import ENSEMBLE_INPUTS

    data = json.loads(perf.write_input_data(tmp_path / "in.json", 42).read_text())["data"][0]
    assert set(data) <= set(ENSEMBLE_INPUTS)
    assert data["MAX_NEW_TOKENS"]["content"] == data["MIN_NEW_TOKENS"]["content"] == [42]
    assert all(v["shape"] == [1] for v in data.values())


def test_input_data_for_a_range_holds_one_entry_per_length_each_forcing_its_own(tmp_path):
    """perf_analyzer sends a file's "data" entries in turn (its docs, "Real Input Data"): a range writes 16 entries
    spread over it, both ends included, each MIN = MAX its own length, the rest as a single length's entry."""
    from loadtest.lengths import Lengths

    entries = json.loads(perf.write_input_data(tmp_path / "in.json", Lengths(50, 400)).read_text())["data"]
    frames = [e["MAX_NEW_TOKENS"]["content"][0] for e in entries]
    assert len(entries) == perf.ENTRIES == 16 and frames == sorted(set(frames)) and (frames[0], frames[-1]) == (50, 400)
    assert all(e["MIN_NEW_TOKENS"]["content"] == e["MAX_NEW_TOKENS"]["content"] for e in entries)
    single = json.loads(perf.write_input_data(tmp_path / "one.json", 42).read_text())["data"][0]
    assert all({k: v for k, v in e.items() if "NEW_TOKENS" not in k} ==
               {k: v for k, v in single.items() if "NEW_TOKENS" not in k} for e in entries)
    md = perf.to_markdown([{"concurrency": 8, "throughput_utt_s": 10.0, "latency_p50_ms": 1.0, "latency_p90_ms": 2.0,
                            "latency_p99_ms": 3.0}], "50-400", "h:1")
    assert ("16 lengths spread over 50-400 (50, 73," in md
            and f"| 8 | 10.0 | {10 * perf.mean_audio_s('50-400'):.1f} |" in md)


def test_perf_analyzer_measures_the_served_ensemble(served_tiny, tmp_path):
    """The real binary (prepared as `make perf` does) drives the tiny CPU server at two concurrencies: every
    request succeeds (perf_analyzer fails the run on an error) and the table has plausible figures."""
    # a busy 2-core CI box: windows may differ several-fold; the stability check is the tool's, not under test here
    rows = perf.run(served_tiny.grpc_url, [1, 2], frames=8, out=tmp_path, window_ms=2000, stability=999)
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["throughput_utt_s"] > 0 and 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
    assert (tmp_path / "perf-c2.csv").is_file()
    assert "| 2 |" in perf.to_markdown(rows, 8, served_tiny.grpc_url)


def test_a_failing_run_names_the_level_and_the_tool_s_words(served_tiny, tmp_path):
    with pytest.raises(perf.PerfError, match="concurrency 1"):
        perf.run("127.0.0.1:1", [1], frames=8, out=tmp_path, window_ms=500)


def test_with_keep_going_a_failing_level_is_a_row_naming_it_and_the_next_level_runs(tmp_path):
    """A benchmark keeps its later phases: each failing level is a row with the tool's words (no server here, so
    both fail), logged, and its table row says so instead of figures."""
    said = []
    rows = perf.run("127.0.0.1:1", [1, 2], frames=8, out=tmp_path, window_ms=500, log=said.append, keep_going=True)
    assert [r["concurrency"] for r in rows] == [1, 2] and all("throughput_utt_s" not in r for r in rows)
    assert "concurrency 1 failed" in rows[0]["error"] and "concurrency 2 failed" in rows[1]["error"]
    assert len(said) == 2
    md = perf.to_markdown(rows, 8, "127.0.0.1:1")
    assert "| 1 | failed: " in md and "| 2 | failed: " in md
