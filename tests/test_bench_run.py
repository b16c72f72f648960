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
    from tests.conftest import export_repo

    repo = export_repo(tiny_assets, tmp_path / "repo")  # the defaults, as `python -m export` writes them
    saved = []
    lengths = Lengths(4, 12)
    out = bench_served(repo, tokens=lengths, max_concurrency=2, step_s=2.0, burst_from_idle=True, perf_levels=[1],
                       save=lambda o: saved.append(dict(o)), perf_stability=999)  # a busy 2-core box
    la = out["launcher"]
    assert la["restarts"] == 0 and la["exits"] == [] and la["exit_status_on_sigterm"] == 0
    assert la["command"].startswith("python -m chattts_triton.serve --repo")
    assert "successfully loaded 'chattts_gpt'" in (repo.parent / la["server_log"]).read_text()  # kept beside it
    assert out["gpt_slots"] == 8  # the CPU default, read from the engine's own gauge
    assert out["burst"]["requests"] == 16 and out["burst"]["refused"] == 0 and out["burst"]["served"] == 16
    assert [r["concurrency"] for r in out["served"]] == [1, 2] and all(r["error_rate"] == 0 for r in out["served"])
    assert out["perf_analyzer"][0]["concurrency"] == 1 and out["perf_analyzer"][0]["throughput_utt_s"] > 0
    assert out["memory"][0]["when"] == "idle" and saved  # results saved as phases finish
    # the burst's answers: the audio of exactly the lengths drawn for it
    drawn = lengths.draw(16, "burst", 0)
    assert out["burst"]["frames_mismatched"] == 0 and len(set(drawn)) > 3
    assert out["burst"]["audio_s"] == round(sum(map(samples_for_codes, drawn)) / SAMPLE_RATE, 2)
    # 16 over 8 slots: the second half's prefills come between the first half's steps
    assert 0 < out["burst"]["engine_step_gap_ms"] <= out["burst"]["engine_step_gap_max_ms"]
    assert all(r["engine_step_gap_ms"] > 0 for r in out["served"])
    for r in out["served"]:  # the sweep's: each answer as long as its request forced, lengths of the range
        assert r["frames_mismatched"] == 0 and 4 <= r["frames_mean"] <= 12 and r["audio_s_per_s"] > 0
    assert out["perf_analyzer"][0]["audio_s_per_s"] > 0
    md = to_markdown({"date": "d", "device_name": "cpu", "tokens": "4-12", "dtype": "fp32", **out})
    assert "**0 launcher restarts**" in md and "16 served, 0 refused" in md and "perf_analyzer" in md
    assert f"the worst {out['burst']['engine_step_gap_max_ms']:.1f} ms" in md
    assert "drawn per utterance uniformly from 4–12 (seed 0; mean 8 frames" in md and "audio s/s" in md
    voc = out["served"][-1]["triton"]["chattts_vocoder"]  # the codec's share of the window, beside the GPT's
    row = [line for line in md.splitlines() if line.startswith(f"| {out['served'][-1]['concurrency']} | ")][-1]
    assert "| vocoder batch | vocoder queue ms | vocoder ms per call | vocoder busy |" in md
    call_ms = voc["compute_input_ms"] + voc["compute_infer_ms"] + voc["compute_output_ms"]
    busy = voc["execution_count"] * call_ms / (1000 * out["served"][-1]["duration_s"])
    assert row.endswith(f"| {voc['avg_batch']:.1f} | {voc['queue_ms']:.0f} | {call_ms:.1f} | {busy:.0%} |")
    assert voc["avg_batch"] >= 1 and call_ms > 0 and 0 < busy < 1.5  # one instance: at most the window, and rounding
    failed = dict(out, perf_analyzer=[{"concurrency": 3, "error": "perf_analyzer at concurrency 3 failed (2): Failed "
                                       "to obtain stable measurement within 6 measurement windows for concurrency 3. "
                                       "Please try to increase the --measurement-interval.\n"
                                       "Failed to obtain stable measurement."}])  # its words, as the tool ends them
    md = to_markdown({"date": "d", "device_name": "cpu", "tokens": "4-12", "dtype": "fp32", **failed})
    assert "| 3 | failed: Failed to obtain stable measurement. | | | | |" in md


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
        assert wait_for(lambda: server.restarts == 1 and server.server_pid not in (None, first), 180,
                        0.2), server.output[-5:]
        assert [code for _, code in server.exits] == [STUB_DIED_EXIT]
        assert grpc_synth(server.grpc_url, TEXT="你好", MAX_NEW_TOKENS=4, MIN_NEW_TOKENS=4).size > 0
    assert not server.alive


def test_the_servers_own_memory_is_read_apart_from_the_whole_gpus():
    """bench.run's memory series: Triton's gauge counts every process on the GPU (a test suite beside a soak
    included); the server's own allocators are summed from its models' gauges, and each series' span and
    growth over the second half are its own."""
    from bench.run import memory_span, server_allocators_mib

    mib = 2**20
    text = "\n".join([
        f'chattts_gpu_memory_reserved_bytes{{model="chattts_gpt",instance="chattts_gpt_0"}} {1000 * mib}',
        f'chattts_gpu_memory_peak_reserved_bytes{{model="chattts_gpt",instance="chattts_gpt_0"}} {1200 * mib}',
        f'chattts_gpu_memory_reserved_bytes{{model="chattts_stream",instance="chattts_stream_0"}} {300 * mib}',
        f'chattts_gpu_memory_reserved_bytes{{model="chattts_vocoder",instance="chattts_vocoder_0"}} {20 * mib}',
        f'nv_gpu_memory_used_bytes{{gpu_uuid="GPU-1"}} {90000 * mib}',
    ])
    assert server_allocators_mib(text) == 1320
    assert server_allocators_mib("nv_gpu_memory_used_bytes 1") is None
    samples = [(t, {"gpu_memory_mib": g, "server_allocators_mib": a})
               for t, g, a in [(0, 30000, 1300), (10, 60000, 1320), (20, 45000, 1320), (30, 90000, 1330)]]
    span = memory_span(samples, 20)
    assert (span["gpu_memory_min_mib"], span["gpu_memory_max_mib"],
            span["gpu_memory_growth_second_half_mib"]) == (30000, 90000, 45000)
    assert (span["server_allocators_min_mib"], span["server_allocators_max_mib"],
            span["server_allocators_growth_second_half_mib"]) == (1300, 1330, 10)
    none = memory_span([(0, {"gpu_memory_mib": None, "server_allocators_mib": None})], 0)
    assert set(none.values()) == {None}
