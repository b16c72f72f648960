"""bench.run's served path (the launcher, bursts, perf_analyzer, soak cycles) and serve.Launched, on the tiny CPU
server: what the GPU figures go through."""

from __future__ import annotations

import os
import signal
import time

import pytest

from chattts_triton.launcher.serve import STUB_DIED_EXIT, Launched
from chattts_triton.launcher.tritonserver import python_stubs
from tests.reliability_util import grpc_synth, wait_for

pytestmark = pytest.mark.e2e


def test_bench_serves_the_default_export_through_the_launcher(tiny_assets, tmp_path):
    """Mixed lengths (--tokens 4-12): every phase forces each request its own drawn length, and the server
    answers each with that length's audio."""
    from bench.run import bench_served, to_markdown
    from chattts_triton.config import SAMPLE_RATE, samples_for_codes
    from loadtest.lengths import Lengths
    from tests.conftest import _export

    repo = _export(tiny_assets, tmp_path / "repo")  # the defaults, as `python -m export` writes them
    saved = []
    lengths = Lengths(4, 12)
    out = bench_served(repo, tokens=lengths, max_concurrency=2, step_s=2.0, burst_from_idle=True, perf_levels=[1],
                       save=lambda o: saved.append(dict(o)), perf_stability=999)  # a busy 2-core box
    la = out["launcher"]
    assert la["restarts"] == 0 and la["exits"] == [] and la["exit_status_on_sigterm"] == 0
    assert la["command"].startswith("python -m chattts_triton.serve --repo")
    assert out["gpt_slots"] == 8  # the CPU default, read from the engine's own gauge
    assert out["burst"]["requests"] == 16 and out["burst"]["refused"] == 0 and out["burst"]["served"] == 16
    assert [r["concurrency"] for r in out["served"]] == [1, 2] and all(r["error_rate"] == 0 for r in out["served"])
    assert out["perf_analyzer"][0]["concurrency"] == 1 and out["perf_analyzer"][0]["throughput_utt_s"] > 0
    assert out["memory"][0]["when"] == "idle" and saved  # results saved as phases finish
    # the burst's answers: the audio of exactly the lengths drawn for it
    drawn = lengths.draw(16, "burst", 0)
    assert out["burst"]["frames_mismatched"] == 0 and len(set(drawn)) > 3
    assert out["burst"]["audio_s"] == round(sum(map(samples_for_codes, drawn)) / SAMPLE_RATE, 2)
    for r in out["served"]:  # the sweep's: each answer as long as its request forced, lengths of the range
        assert r["frames_mismatched"] == 0 and 4 <= r["frames_mean"] <= 12 and r["audio_s_per_s"] > 0
    assert out["perf_analyzer"][0]["audio_s_per_s"] > 0
    md = to_markdown({"date": "d", "device_name": "cpu", "tokens": "4-12", "dtype": "fp32", **out})
    assert "**0 launcher restarts**" in md and "16 served, 0 refused" in md and "perf_analyzer" in md
    assert "drawn per utterance uniformly from 4–12 (seed 0; mean 8 frames" in md and "audio s/s" in md


def test_soak_cycles_burst_from_idle_and_hold_with_no_refusal(tiny_repo, tmp_path):
    from bench.run import soak_cycles

    with Launched(tiny_repo, tmp_path / "server.log") as server:
        r = soak_cycles(server, tokens=6, concurrency=2, burst_n=8, until=time.monotonic() + 12, hold_s=3, idle_s=1)
        assert server.restarts == 0
    assert r["bursts"] >= 2 and r["burst_requests"] == 8 * r["bursts"] and r["burst_refused"] == 0
    assert r["hold_utterances"] > 0 and r["hold_errors"] == 0


def test_launched_counts_and_recovers_an_exit_as_a_supervisor_does(tiny_repo, tmp_path):
    """The launcher exits 70 when a stub dies; a supervisor starts it again: `Launched` counts that as a
    restart (what bench.run and the soak report) and the server serves again on the same ports."""
    with Launched(tiny_repo, tmp_path / "server.log") as server:
        first = server.server_pid
        stub = next(iter(python_stubs(first)))
        os.kill(stub, signal.SIGKILL)
        assert wait_for(lambda: server.restarts == 1 and server.server_pid not in (None, first), 180, 0.2), server.output[-5:]
        assert [code for _, code in server.exits] == [STUB_DIED_EXIT]
        assert grpc_synth(server.grpc_url, TEXT="你好", MAX_NEW_TOKENS=4, MIN_NEW_TOKENS=4).size > 0
    assert not server.alive
