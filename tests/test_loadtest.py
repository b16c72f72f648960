"""Load-test tooling: unit tests of the figures and reports (no server), and end-to-end runs of Locust
and the concurrency sweep against the real server (`served_tiny`, marked e2e)."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from chattts_triton.config import LIMITS, SAMPLE_RATE
from client.contract import build_inputs
from loadtest import run as lt_run
from loadtest import sweep
from loadtest.corpus import CorpusError, length_bucket, load_corpus
from loadtest.tts_stats import TTSStats, format_summary, percentile, real_time_factor

ROOT = Path(__file__).resolve().parents[1]
FORCED_TOKENS = 20  # MIN = MAX new tokens: short utterances of a fixed length for e2e runs


# --- figures ----------------------------------------------------------------------------------------
def test_tts_stats_summary_merge_and_drain():
    worker, master = TTSStats(), TTSStats()
    worker.record_success(0.5, SAMPLE_RATE)  # 1 s of audio in 0.5 s: RTF 0.5
    worker.record_success(3.0, 2 * SAMPLE_RATE)  # RTF 1.5
    worker.record_failure("UNAVAILABLE")
    master.record_failure("INVALID_ARGUMENT")
    master.merge(json.loads(json.dumps(worker.drain())))  # what travels to the Locust master
    assert worker.summary()["requests"] == 0
    s = master.summary(wall_s=6.0)
    assert (s["requests"], s["successes"], s["failures"]) == (4, 2, 2)
    assert s["failures_by_status"] == {"INVALID_ARGUMENT": 1, "UNAVAILABLE": 1}
    assert s["audio_seconds"] == 3.0 and s["audio_seconds_per_second"] == 0.5
    assert s["rtf_p50"] == pytest.approx(1.0) and s["rtf_p90"] == pytest.approx(1.4)
    assert s["latency_p50_ms"] == pytest.approx(1750.0)
    text = format_summary(s)
    assert "audio produced 3.0 s" in text and "p50 1.000" in text and "UNAVAILABLE" in text


def test_stream_figures_merge_and_summary():
    worker, master = TTSStats(), TTSStats()
    worker.record_success(1.0, SAMPLE_RATE)
    worker.record_stream(0.2, [0.1, 0.3], stalled=False)
    worker.record_success(2.0, SAMPLE_RATE)
    worker.record_stream(0.4, [0.9], stalled=True)
    master.merge(json.loads(json.dumps(worker.drain())))
    assert "streams" not in worker.summary() and worker.streams == 0
    s = master.summary()
    assert (s["streams"], s["stalled_streams"]) == (2, 1)
    assert s["first_chunk_p50_ms"] == pytest.approx(300.0) and s["chunk_gap_max_ms"] == pytest.approx(900.0)
    assert s["chunk_gap_p50_ms"] == pytest.approx(300.0)
    text = format_summary(s)
    assert "first chunk ms  p50 300" in text and "max 900" in text and "streams 2" in text
    master.merge({"latencies_s": [1.0], "audio_samples": [1], "failures": {}})  # an older worker's report
    assert master.summary()["successes"] == 3
    no_audio = TTSStats()
    no_audio.record_stream(None, [], False)
    assert no_audio.summary()["first_chunk_p50_ms"] is None and "n/a" in format_summary(no_audio.summary())


def test_rtf_and_percentile_edges():
    assert real_time_factor(1.0, 0) is None and real_time_factor(2.0, SAMPLE_RATE) == 2.0
    assert percentile([], 50) is None and percentile([1, 2, 3, 4], 50) == 2.5
    empty = TTSStats()
    empty.record_success(0.1, 0)
    assert empty.summary()["empty_audio"] == 1 and empty.summary()["rtf_p50"] is None
    assert "WARNING" in format_summary(empty.summary())


def test_corpus_is_realistic_and_valid():
    texts = load_corpus()
    assert 50 <= len(texts) <= 80
    chinese = [t for t in texts if re.search(r"[\u4e00-\u9fff]", t)]
    english = [t for t in texts if re.fullmatch(r"[\x20-\x7e]+", t)]
    assert len(chinese) >= 15 and len(english) >= 15
    assert {length_bucket(t) for t in chinese} == {length_bucket(t) for t in english} == {"short", "medium", "long"}
    for t in texts:
        assert len(t) <= LIMITS.max_text_chars
        build_inputs(t)
    assert len(set(texts)) == len(texts)


def test_corpus_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("# only a comment\n\n", encoding="utf-8")
    with pytest.raises(CorpusError, match="no utterances"):
        load_corpus(tmp_path / "empty.txt")
    with pytest.raises(CorpusError, match="cannot read"):
        load_corpus(tmp_path / "missing.txt")


# --- sweep helpers --------------------------------------------------------------------------------
def test_concurrency_levels():
    assert sweep.concurrency_levels(64) == [1, 2, 4, 8, 16, 32, 64]
    assert sweep.concurrency_levels(10) == [1, 2, 4, 8, 10]
    assert sweep.concurrency_levels(1) == [1]
    assert sweep.concurrency_levels(12, start=3) == [3, 6, 12]
    with pytest.raises(ValueError):
        sweep.concurrency_levels(0)


def test_rates_agree_needs_work_in_both_windows():
    assert sweep.rates_agree(10.0, 9.0, 0.2) and not sweep.rates_agree(10.0, 7.0, 0.2)
    assert not sweep.rates_agree(0.0, 0.0, 0.2) and not sweep.rates_agree(1.0, 0.0, 0.9)


def test_summarize_window():
    C = sweep.Completion
    done = [C(0.0, 1.0, None, SAMPLE_RATE), C(0.0, 2.0, None, SAMPLE_RATE), C(1.0, 1.5, "UNAVAILABLE"),
            C(0, 9, None, 1)]
    window = sweep.completions_between(done, 0.5, 5.0)
    assert len(window) == 3
    s = sweep.summarize_window(window, duration_s=4.0)
    assert (s["requests"], s["errors"], s["errors_by_status"]) == (3, 1, {"UNAVAILABLE": 1})
    assert s["error_rate"] == pytest.approx(1 / 3) and s["throughput_utt_s"] == 0.5 and s["audio_s_per_s"] == 0.5
    assert s["latency_p50_ms"] == 1500.0 and s["rtf_p50"] == 1.5


class _LengthClient:
    """Answers each request at once with the audio its forced frames give (`short`: a frame less)."""

    def __init__(self, short: bool = False):
        self.sent, self.short = [], short

    async def infer_one(self, text, options):
        import asyncio

        from chattts_triton.config import samples_for_codes

        assert options["max_new_tokens"] == options["min_new_tokens"]
        self.sent.append(options["max_new_tokens"])
        await asyncio.sleep(0.001)
        return np.zeros(samples_for_codes(options["max_new_tokens"] - self.short), np.float32)


@pytest.mark.parametrize("short", [False, True])
def test_sweep_step_forces_each_request_its_drawn_length(short):
    """A sweep step with a length source: each worker's requests force the lengths of its own seeded stream
    (MIN = MAX), the window reports their mean, and answers not of the forced length are counted."""
    import asyncio

    from loadtest.lengths import Lengths

    lengths = Lengths(5, 40, seed=2)
    client = _LengthClient(short)

    async def go(concurrency):
        step = sweep._Step(client, ["a", "b"], {"seed": 1}, concurrency, seed=0, lengths=lengths)
        await asyncio.sleep(0.2)
        await step.stop(drain_s=5)
        return step

    one = asyncio.run(go(1))  # one worker: its stream's lengths, in order
    assert [c.frames for c in one.completions] == lengths.draw(len(one.completions), "sweep", 1, 0)
    step = asyncio.run(go(3))
    assert len(step.completions) > 30 and all(5 <= f <= 40 for f in client.sent) and len(set(client.sent)) > 10
    s = sweep.summarize_window(step.completions, 0.2)
    assert s["frames_mean"] == pytest.approx(np.mean([c.frames for c in step.completions]))
    assert s["frames_mismatched"] == (len(step.completions) if short else 0)
    assert sweep.summarize_window([sweep.Completion(0, 1, None, 10)], 1.0)["frames_mean"] is None  # nothing forced


def _stats(inference, execution, queue_ns, infer_ns, batches, as_strings=False):
    """A `get_inference_statistics` answer in Triton's layout (gRPC JSON carries uint64 as strings)."""
    v = str if as_strings else int
    def stat(n, ns):
        return {"count": v(n), "ns": v(ns)}
    model = {
        "name": "chattts_gpt", "version": "1", "inference_count": v(inference), "execution_count": v(execution),
        "inference_stats": {"success": stat(inference, 1), "fail": {}, "queue": stat(inference, queue_ns),
                            "compute_infer": stat(inference, infer_ns)},
        "batch_stats": [{"batch_size": v(b), "compute_infer": stat(n, 1)} for b, n in batches.items()],
    }  # fmt: skip
    idle = {"name": "idle", "version": "1", "inference_count": v(5), "execution_count": v(5)}
    return {"model_stats": [model, idle]}


@pytest.mark.parametrize("as_strings", [False, True])
def test_triton_statistics_diff_shows_batching(as_strings):
    before = _stats(10, 10, 10_000_000, 50_000_000, {1: 10}, as_strings)
    after = _stats(30, 15, 50_000_000, 250_000_000, {1: 12, 4: 3}, as_strings)
    d = sweep.diff_model_statistics(before, after)
    assert set(d) == {"chattts_gpt"}  # idle models are left out
    m = d["chattts_gpt"]
    assert (m["inference_count"], m["execution_count"], m["avg_batch"]) == (20, 5, 4.0)
    assert m["queue_ms"] == pytest.approx(2.0) and m["compute_infer_ms"] == pytest.approx(10.0)
    assert m["batch_sizes"] == {1: 2, 4: 3} and m["compute_input_ms"] is None


def test_gpu_memory_from_prometheus_text():
    text = (
        "# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes\n"
        'nv_gpu_memory_used_bytes{gpu_uuid="GPU-a"} 1.5e+09\n'
        'nv_gpu_memory_used_bytes{gpu_uuid="GPU-b"} 500000000\n'
        'nv_gpu_memory_total_bytes{gpu_uuid="GPU-a"} 8e+10\n'
    )
    assert sweep.parse_gpu_memory_bytes(text) == 2.0e9
    assert sweep.parse_gpu_memory_bytes("nv_cpu_memory_used_bytes 1\n") is None
    assert sweep.default_metrics_url("10.0.0.2:8001") == "10.0.0.2:8002"
    assert sweep.metrics_endpoint("10.0.0.2:8002") == "http://10.0.0.2:8002/metrics"
    assert sweep.metrics_endpoint("http://h:1/metrics") == "http://h:1/metrics"


def _row(c, p50):
    return {
        "concurrency": c, "stable": c < 4, "settle_s": 3.0, "duration_s": 10.0, "requests": 10 * c, "errors": 0,
        "error_rate": 0.0, "errors_by_status": {}, "latency_p50_ms": p50, "latency_p90_ms": p50 * 1.2,
        "latency_p99_ms": None, "throughput_utt_s": c / p50 * 1000, "audio_s_per_s": 2.0 * c, "rtf_p50": 0.3,
        "rtf_p90": 0.4, "gpu_memory_mib": None,
        "triton": {"chattts": {"inference_count": 10 * c, "execution_count": 10, "avg_batch": float(c),
                               "queue_ms": 1.0, "compute_infer_ms": 20.0, "batch_sizes": {c: 10}}},
    }  # fmt: skip


def test_sweep_reports(tmp_path):
    rows = [_row(1, 100.0), _row(2, 110.0), _row(4, 150.0)]
    cfg = sweep.SweepConfig(url="h:1", step_seconds=10)
    paths = sweep.write_outputs(tmp_path, rows, cfg)
    md = paths["md"].read_text()
    assert ("| 2 | 110 | 132 | n/a | 18.18 | 4.00 | n/a | 0.300 | 0.400 | 20 | 0.0% "
            "| n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | yes |") in md
    assert "| 4 | chattts | 40 | 10 | 4.00 | 1.0 | 20.0 | 4×10 |" in md
    with paths["csv"].open() as f:
        table = list(csv.DictReader(f))
    assert [r["concurrency"] for r in table] == ["1", "2", "4"] and table[2]["chattts.avg_batch"] == "4.0"
    assert json.loads(paths["json"].read_text())["steps"][1]["latency_p50_ms"] == 110.0
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv", [["--tolerance", "1.5"], ["--max-concurrency", "0"], ["--step-seconds", "0"], ["--protocol", "udp"]]
)
def test_sweep_argument_errors(argv):
    with pytest.raises(SystemExit) as e:
        sweep.main(argv)
    assert e.value.code == 2


# --- Locust runner ------------------------------------------------------------------------------
def test_locust_command(tmp_path):
    args = lt_run.build_parser().parse_args(
        ["--protocol", "http", "--users", "3", "--duration", "15s", "--max-new-tokens", "20", "--seed", "4",
         "--", "--loglevel", "WARNING"]
    )  # fmt: skip
    cmd = lt_run.locust_command(args, "h:8000", tmp_path)
    assert cmd[1:3] == ["-m", "locust"] and "--headless" in cmd and cmd[-1] == "TritonHttpUser"
    flags = dict(pairwise(cmd))
    assert flags["--users"] == "3" and flags["--run-time"] == "15s" and flags["--host"] == "h:8000"
    assert flags["--csv"] == str(tmp_path / "stats") and flags["--html"] == str(tmp_path / "report.html")
    assert flags["--tts-max-new-tokens"] == "20" and flags["--tts-seed"] == "4" and "--tts-min-new-tokens" not in flags
    assert flags["--loglevel"] == "WARNING" and flags["--tts-model"] == "chattts"
    with pytest.raises(SystemExit):
        lt_run.build_parser().parse_args(["--duration", "soon"])
    args = lt_run.build_parser().parse_args(["--stream"])
    cmd = lt_run.locust_command(args, "h:8001", tmp_path)
    flags = dict(pairwise(cmd))
    assert cmd[-1] == "TritonGrpcStreamUser" and flags["--tts-stream-model"] == "chattts_stream"
    assert "--tts-model" not in flags
    args = lt_run.build_parser().parse_args(["--stream", "--protocol", "http", "--model", "m"])
    cmd = lt_run.locust_command(args, "h:8000", tmp_path)
    assert cmd[-1] == "TritonHttpStreamUser" and dict(pairwise(cmd))["--tts-stream-model"] == "m"


def test_locustfile_loads_under_gevent_with_both_users():
    out = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--list"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    users = ("TritonGrpcUser", "TritonHttpUser", "TritonGrpcStreamUser", "TritonHttpStreamUser")
    assert all(u in out.stdout for u in users)
    check = subprocess.run(
        [sys.executable, "-c", "import runpy, sys; g = runpy.run_path('loadtest/locustfile.py'); "
         f"print([[t.__name__ for t in g[u].tasks] for u in {users!r}]); print('torch' in sys.modules)"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 0 and check.stdout.strip().endswith("False"), check.stderr
    # one task each: a streaming user does not also run the unary request
    assert check.stdout.splitlines()[-2] == str([["synthesize"], ["synthesize"], ["stream"], ["stream"]])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_locust_stream_users_report_first_chunk_gaps_and_total(protocol, tmp_path):
    """The streaming users under gevent, against the in-process fake stream servers (no Triton)."""
    from tests.test_client_stream import FakeStreamServers

    servers = FakeStreamServers()
    try:
        user = "TritonGrpcStreamUser" if protocol == "grpc" else "TritonHttpStreamUser"
        cmd = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "2", "-r", "2",
               "-t", "3s", "--stop-timeout", "10", "--host", servers.url(protocol), "--csv", str(tmp_path / "stats"),
               "--tts-stats-out", str(tmp_path / "tts.json"), user]  # fmt: skip
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        servers.stop()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with (tmp_path / "stats_stats.csv").open() as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    assert {"stream first chunk", "stream chunk gap", "stream total"} <= set(rows)
    assert all(r["Type"] == protocol for n, r in rows.items() if n != "Aggregated")
    assert int(rows["stream total"]["Failure Count"]) == 0 and int(rows["stream total"]["Request Count"]) > 0
    assert int(rows["stream chunk gap"]["Request Count"]) > int(rows["stream total"]["Request Count"])
    tts = json.loads((tmp_path / "tts.json").read_text())
    assert tts["streams"] == tts["successes"] > 0 and tts["first_chunk_p50_ms"] > 0 and tts["failures"] == 0


def test_runner_refuses_an_unreachable_server(tmp_path, capsys):
    rc = lt_run.main(["--host", "127.0.0.1:9", "--out", str(tmp_path), "--wait-ready", "0.5"])
    assert rc == lt_run.EXIT_NOT_READY and "not ready" in capsys.readouterr().err


# --- end to end against the real server ----------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_locust_headless_run_has_no_failures(served_tiny, protocol, tmp_path):
    host = served_tiny.grpc_url if protocol == "grpc" else served_tiny.http_url
    cmd = [sys.executable, "-m", "loadtest.run", "--host", host, "--protocol", protocol, "--users", "2",
           "--spawn-rate", "2", "--duration", "15s", "--max-new-tokens", str(FORCED_TOKENS),
           "--min-new-tokens", str(FORCED_TOKENS), "--seed", "1", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with (tmp_path / "stats_stats.csv").open() as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0
    assert all(r["Type"] == protocol for name, r in rows.items() if name != "Aggregated")
    tts = json.loads((tmp_path / "tts_stats.json").read_text())
    assert tts["failures"] == 0 and tts["successes"] > 0 and tts["audio_seconds"] > 0 and tts["rtf_p50"] > 0
    assert (tmp_path / "report.html").stat().st_size > 0


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_locust_stream_run_against_chattts_stream(served_tiny, protocol, tmp_path):
    if not (Path(served_tiny.model_repository) / "chattts_stream").is_dir():
        pytest.skip("the served repository has no chattts_stream model")
    host = served_tiny.grpc_url if protocol == "grpc" else served_tiny.http_url
    cmd = [sys.executable, "-m", "loadtest.run", "--stream", "--host", host, "--protocol", protocol, "--users", "2",
           "--spawn-rate", "2", "--duration", "10s", "--max-new-tokens", "80", "--min-new-tokens", "80",
           "--seed", "1", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with (tmp_path / "stats_stats.csv").open() as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    assert int(rows["stream total"]["Request Count"]) > 0 and int(rows["Aggregated"]["Failure Count"]) == 0
    # every finished stream had a first chunk (one cut off at the stop may count only that)
    assert int(rows["stream first chunk"]["Request Count"]) >= int(rows["stream total"]["Request Count"])
    tts = json.loads((tmp_path / "tts_stats.json").read_text())
    assert tts["failures"] == 0 and tts["streams"] > 0 and tts["first_chunk_p50_ms"] > 0


@pytest.mark.e2e
def test_sweep_produces_table_and_plot(served_tiny, tmp_path):
    cmd = [sys.executable, "-m", "loadtest.sweep", "--url", served_tiny.grpc_url, "--max-concurrency", "2",
           "--warmup-seconds", "1", "--window-seconds", "2", "--step-seconds", "4", "--max-settle-seconds", "20",
           "--max-new-tokens", str(FORCED_TOKENS), "--min-new-tokens", str(FORCED_TOKENS), "--seed", "1",
           "--out", str(tmp_path)]  # fmt: skip
    cmd += ["--metrics-url", getattr(served_tiny, "metrics_url", None) or ""]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = json.loads((tmp_path / "sweep.json").read_text())["steps"]
    assert [s["concurrency"] for s in steps] == [1, 2]
    for s in steps:
        assert s["error_rate"] == 0.0 and s["throughput_utt_s"] > 0 and s["latency_p50_ms"] > 0
        assert s["triton"]["chattts"]["inference_count"] > 0  # Triton's own view of the same step
    md = (tmp_path / "sweep.md").read_text()
    assert "| 1 |" in md and "| 2 |" in md and "avg batch" in md
    assert (tmp_path / "sweep.csv").read_text().startswith("concurrency,")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stream_window_bounds_the_servers_first_chunk_percentiles_from_its_buckets():
    """chattts_stream's cumulative within-N-ms counts, two instances, read as bench.run reads them:
    p50 and p99 are the smallest bounds holding half and 99 % of the window's first chunks."""
    from bench.run import STREAM_COUNTERS, bucket_percentile, stream_window
    from chattts_triton.config import FIRST_CHUNK_BUCKETS_MS, first_chunk_bucket
    from loadtest.sweep import parse_counters

    def text(times_ms):  # per instance: the first-chunk times so far
        rows = []
        for inst, times in times_ms.items():
            lab = f'{{model="chattts_stream",instance="{inst}"}}'
            rows += [f"chattts_stream_first_chunks{lab} {len(times)}",
                     f"chattts_stream_first_chunk_seconds{lab} {sum(times) / 1000}"]
            rows += [f"chattts_{first_chunk_bucket(ms)}{lab} {sum(t <= ms for t in times)}"
                     for ms in FIRST_CHUNK_BUCKETS_MS]
        return "\n".join(rows) + "\n"

    early = {"a": [30.0] * 5, "b": [1500.0]}  # before the window: a slow one the window must not count
    late = {"a": early["a"] + [40.0] * 60 + [120.0] * 38, "b": early["b"] + [180.0]}
    w = stream_window(parse_counters(text(early), STREAM_COUNTERS, "chattts_stream"),
                      parse_counters(text(late), STREAM_COUNTERS, "chattts_stream"))
    # the window's 99 chunks: 60 at 40 ms, 38 at 120 ms, 1 at 180 ms
    assert w["server_first_chunk_p50_within_ms"] == 50 and w["server_first_chunk_p99_within_ms"] == 200
    assert w["server_first_chunk_ms"] == pytest.approx((60 * 40 + 38 * 120 + 180) / 99)
    assert w["server_first_chunks_within_ms"]["125"] == 98 and w["server_first_chunks_within_ms"]["1000"] == 99
    assert w["server_first_chunks"] == 99
    assert (bucket_percentile({100: 0, 200: 1}, 1, 50) == 200
            and bucket_percentile({100: 0, 200: 0}, 1, 50) == float("inf"))
    assert bucket_percentile({100: 0}, 0, 99) is None
    over = stream_window(parse_counters(text({"a": []}), STREAM_COUNTERS, "chattts_stream"),
                         parse_counters(text({"a": [20000.0]}), STREAM_COUNTERS, "chattts_stream"))
    assert over["server_first_chunk_p99_within_ms"] is None and over["server_first_chunk_ms"] == pytest.approx(20000)
    assert over["server_first_chunks"] == 1  # past the last bound: counted, no bound


def test_engine_counters_are_read_per_instance_and_summarised_over_a_window():
    from loadtest.sweep import engine_window, parse_engine_counters

    def text(a_steps, a_rows, a_step_s, b_steps, b_rows, b_step_s, prefill_s, gpu=True):
        rows = []
        for inst, (steps, rows_, step_s) in {"chattts_gpt_0_0": (a_steps, a_rows, a_step_s),
                                             "chattts_gpt_1_0": (b_steps, b_rows, b_step_s)}.items():
            rows += [f'chattts_engine_steps{{instance="{inst}",model="chattts_gpt"}} {steps}',
                     f'chattts_engine_step_rows{{instance="{inst}",model="chattts_gpt"}} {rows_}',
                     f'chattts_engine_step_seconds{{model="chattts_gpt",instance="{inst}"}} {step_s}',
                     f'chattts_engine_step_device_seconds{{model="chattts_gpt",instance="{inst}"}} {step_s / 2}',
                     f'chattts_engine_step_gpu_seconds{{model="chattts_gpt",instance="{inst}"}} '
                     f'{step_s / 8 if gpu else 0}',
                     f'chattts_engine_step_gpu_samples{{model="chattts_gpt",instance="{inst}"}} '
                     f'{steps // 8 if gpu else 0}',
                     f'chattts_engine_prefill_seconds{{instance="{inst}",model="chattts_gpt"}} {prefill_s}',
                     f'chattts_engine_gil_wait_seconds{{instance="{inst}",model="chattts_gpt"}} {step_s / 100}',
                     f'chattts_engine_prefills{{instance="{inst}",model="chattts_gpt"}} {steps // 4}',
                     f'chattts_engine_prefill_rows{{instance="{inst}",model="chattts_gpt"}} {steps}',
                     f'chattts_engine_step_gaps{{instance="{inst}",model="chattts_gpt"}} {steps - 1}',
                     f'chattts_engine_step_gap_seconds{{instance="{inst}",model="chattts_gpt"}} {step_s + prefill_s}',
                     f'chattts_engine_step_gap_max_seconds{{instance="{inst}",model="chattts_gpt"}} {step_s / 50}',
                     f'chattts_engine_gil_wait_samples{{instance="{inst}",model="chattts_gpt"}} {steps // 8}',
                     f'chattts_engine_step_graph_seconds{{model="chattts_gpt",instance="{inst}"}} '
                     f'{step_s / 16 if gpu else 0}',
                     f'chattts_engine_step_graph_samples{{model="chattts_gpt",instance="{inst}"}} '
                     f'{steps // 8 if gpu else 0}',
                     f'chattts_gc_pause_max_seconds{{instance="{inst}",model="chattts_gpt"}} {prefill_s / 10}',
                     f'chattts_engine_active{{instance="{inst}",model="chattts_gpt"}} 7']
        rows.append('chattts_engine_steps{instance="chattts_stream_0_0",model="chattts_stream"} 999')
        return "# HELP chattts_engine_steps x\n" + "\n".join(rows) + "\n"

    before = parse_engine_counters(text(100, 1000, 0.5, 50, 100, 0.2, 0.1))
    assert set(before) == {"chattts_gpt_0_0", "chattts_gpt_1_0"}
    assert "engine_active" not in before["chattts_gpt_0_0"]
    after = parse_engine_counters(text(300, 3000, 1.3, 250, 900, 1.0, 0.3))
    w = engine_window(before, after, 2.0)
    assert w["engine_step_ms"] == pytest.approx(1000 * (0.8 + 0.8) / (200 + 200))
    assert w["engine_step_device_ms"] == pytest.approx(1000 * (0.4 + 0.4) / (200 + 200))
    # sampled steps on the GPU's clock: (1.3 - 0.5) / 8 s over (300 - 100) // 8 samples, and the same for b
    assert w["engine_step_gpu_ms"] == pytest.approx(1000 * (0.1 + 0.1) / (25 + 25))
    assert w["engine_step_graph_ms"] == pytest.approx(1000 * (0.05 + 0.05) / (25 + 25))  # inside the graphs
    cpu = engine_window(parse_engine_counters(text(100, 1000, 0.5, 50, 100, 0.2, 0.1, gpu=False)),
                        parse_engine_counters(text(300, 3000, 1.3, 250, 900, 1.0, 0.3, gpu=False)), 2.0)
    assert cpu["engine_step_gpu_ms"] is None and cpu["engine_step_ms"] == w["engine_step_ms"]  # no samples: n/a
    assert cpu["engine_step_graph_ms"] is None
    assert w["engine_prefill_ms_per_step"] == pytest.approx(1000 * (0.2 + 0.2) / (200 + 200))
    # per prefill: (0.3 - 0.1) s over (300 - 100) // 4 prefills, the same for b; 4 prompts each
    assert w["engine_prefill_ms"] == pytest.approx(1000 * (0.2 + 0.2) / (50 + 50))
    assert w["engine_prefill_prompts"] == pytest.approx(4.0)
    # the GIL probe, sampled like the GPU clock but on any device: (1.3 - 0.5) / 100 s over 25 samples, same for b
    assert w["engine_gil_wait_ms"] == pytest.approx(1000 * (0.008 + 0.008) / (25 + 25))
    assert cpu["engine_gil_wait_ms"] == w["engine_gil_wait_ms"]
    assert w["engine_batch"] == pytest.approx((2000 + 800) / 400)
    assert w["engine_busy"] == pytest.approx((0.8 + 0.8 + 0.2 + 0.2) / (2.0 * 2))
    assert engine_window({}, {}, 2.0)["engine_step_ms"] is None
    old = {i: {k: v for k, v in c.items() if k != "engine_step_device_seconds"} for i, c in after.items()}
    w_old = engine_window(before, old, 2.0)  # a server from before the device counter
    assert w_old["engine_step_device_ms"] is None and w_old["engine_step_ms"] == w["engine_step_ms"]
    old = {i: {k: v for k, v in c.items() if not k.startswith("engine_step_gpu")} for i, c in after.items()}
    assert engine_window(before, old, 2.0)["engine_step_gpu_ms"] is None  # a server from before the GPU clock
    old = {i: {k: v for k, v in c.items() if k not in ("engine_prefills", "engine_prefill_rows")}
           for i, c in after.items()}
    assert engine_window(before, old, 2.0)["engine_prefill_ms"] is None  # a server from before the prefill counts
    old = {i: {k: v for k, v in c.items() if not k.startswith("engine_gil")} for i, c in after.items()}
    assert engine_window(before, old, 2.0)["engine_gil_wait_ms"] is None  # ... or before the GIL probe
    # the running rows' cadence: (0.8 + 0.2) s of gaps per instance over 200 each; the worst so far, a's 1.3 / 50 s
    assert w["engine_step_gap_ms"] == pytest.approx(1000 * (1.0 + 1.0) / (200 + 200))
    assert w["engine_step_gap_max_ms"] == pytest.approx(1000 * 1.3 / 50)
    old = {i: {k: v for k, v in c.items() if not k.startswith("engine_step_gap")} for i, c in after.items()}
    assert engine_window(before, old, 2.0)["engine_step_gap_ms"] is None  # ... or before the step gaps
    assert engine_window(before, old, 2.0)["engine_step_gap_max_ms"] is None
    # the GPT processes' longest garbage collection so far: the larger of a's and b's (0.3 / 10 s)
    assert w["gc_pause_max_ms"] == pytest.approx(1000 * 0.3 / 10)
    old = {i: {k: v for k, v in c.items() if not k.startswith("gc_")} for i, c in after.items()}
    assert engine_window(before, old, 2.0)["gc_pause_max_ms"] is None  # a server from before the GC gauges


def test_stream_stand_in_splits_a_first_chunk_into_its_way_in_the_schedule_and_its_way_out():
    """bench.probes.client_capacity --stream (two client processes): chunks on the stand-in's schedule (8
    frames, then 32), and their stamps read back: the stand-in's wait, the request's way in and the
    chunks' way out."""
    from bench.probes.client_capacity import read_stamp, stamp, stand_in_server, stream_capacity, stream_schedule
    from chattts_triton.config import samples_for_codes

    t = time.monotonic()
    assert read_stamp(stamp(np.zeros(8, np.float32), t, t + 0.0123)) == pytest.approx((t, t + 0.0123), abs=1e-6)
    assert stream_schedule(70, 30.0, 10.0) == [(0.03, samples_for_codes(8)), (0.04, samples_for_codes(32)),
                                               (0.05, samples_for_codes(30))]
    with stand_in_server(70, stream_schedule(70, 30.0, 10.0)) as url:
        row = stream_capacity(url, 2, 1.5, 70, procs=2)
    assert row["client_processes"] == 2 and row["streams_per_s"] > 5
    assert 30.0 <= row["stand_in_wait_p50_ms"] < 50.0  # the stamps read back: the stand-in's 30-ms wait
    assert 0 <= row["request_in_p50_ms"] < 50.0 and 0 <= row["first_chunk_out_p50_ms"] < 50.0
    assert 0 <= row["later_chunk_out_p50_ms"] < 50.0
    assert row["first_chunk_p50_ms"] >= row["stand_in_wait_p50_ms"]


async def _fake_clients(n: int, fail: str, window_mark: str, sync) -> dict:
    """bench.clients entry for the tests: `n` results, a sync between warm-up and window (a file
    written at `window_mark` when its window runs)."""
    import asyncio

    if fail == "warm-up":
        raise ValueError("no server")
    await asyncio.to_thread(sync)
    if window_mark:
        Path(window_mark).write_text("ran")
    if fail == "window":
        raise ValueError("lost the server")
    return {"first": [float(n)] * n, "errors": n, "elapsed_s": float(n)}


def test_clients_spread_a_load_over_processes_and_fail_with_a_processs_error(tmp_path):
    from bench import clients

    assert clients.shares(64, 4) == [16] * 4 and clients.shares(5, 3) == [2, 2, 1] and clients.shares(2, 8) == [1, 1]
    with pytest.raises(ValueError):
        clients.shares(0, 2)
    assert clients.merge([{"a": [1], "n": 2, "t_s": 3.0},
                          {"a": [2], "n": 5, "t_s": 1.0}]) == {"a": [1, 2], "n": 7, "t_s": 3.0}
    calls = []
    r = clients.run(_fake_clients, [(2, "", ""), (3, "", "")], lambda: calls.append("window"), timeout_s=60)
    assert (calls == ["window"] and sorted(r["first"]) == [2.0, 2.0, 3.0, 3.0, 3.0] and r["errors"] == 5
            and r["elapsed_s"] == 3.0)
    assert (clients.run(_fake_clients, [(1, "", "")], lambda: calls.append("one"))["first"] == [1.0]
            and calls[-1] == "one")
    for stage in ("warm-up", "window"):
        with pytest.raises(RuntimeError, match="a client process failed: ValueError"):
            clients.run(_fake_clients, [(1, "", ""), (1, stage, "")], lambda: None, timeout_s=60)
    # one process failing its warm-up: the other never starts its window, and nothing is read
    mark = tmp_path / "window-ran"
    with pytest.raises(RuntimeError, match="no server"):
        clients.run(_fake_clients, [(1, "", str(mark)), (1, "warm-up", "")], lambda: calls.append("read"), timeout_s=60)
    assert not mark.exists() and calls[-1] == "one"


@pytest.mark.parametrize("argv", [["run", "--stream-concurrency", "1,0"], ["run", "--stream-concurrency", "x"],
                                  ["run", "--stream-procs", "0"], ["capacity", "--stream", "--concurrency", "0"],
                                  ["capacity", "--stream", "--procs", "0"]])
def test_stream_bench_options_out_of_range_are_refused_before_anything_runs(argv, capsys):
    from bench import run
    from bench.probes import client_capacity

    tool, args = argv[0], argv[1:]
    with pytest.raises(SystemExit) as e:
        (run.main(["--assets", "/nonexistent", *args]) if tool == "run" else client_capacity.main(args))
    assert e.value.code == 2 and "at least 1" in capsys.readouterr().err


def test_bench_hold_reports_the_steady_state_latency_beside_memory():
    """bench.run's hold (GPU memory over a long constant load) also reports the latency of the
    utterances finished in its second half, against a stand-in server that answers at once."""
    import asyncio

    from bench.probes.client_capacity import stand_in_server
    from bench.run import hold, to_markdown

    with stand_in_server(frames=20) as url:
        h = asyncio.run(hold(url, None, tokens=20, concurrency=4, seconds=4.0, every_s=0.5))
    assert h["utterances"] > 20 and h["errors"] == 0 and h["samples"]
    assert 0 < h["latency_p50_ms_second_half"] <= h["latency_p99_ms_second_half"] < 4000
    assert h["gpu_memory_min_mib"] is None  # no metrics endpoint here
    md = to_markdown({"date": "d", "device_name": "cpu", "tokens": 20, "dtype": "fp32", "hold": h})
    assert f"p99 {h['latency_p99_ms_second_half']:.0f} ms" in md


def test_bench_table_puts_each_engine_figure_under_its_header():
    """bench.run's served table: one cell per header, each figure in its own column (a row missing
    the newer figures, as from an older server, leaves those cells empty)."""
    from bench.run import to_markdown

    row = {"concurrency": 512, "latency_p50_ms": 1426.0, "latency_p90_ms": 1459.0, "latency_p99_ms": 1486.0,
           "throughput_utt_s": 360.45, "rtf_p50": 0.447, "error_rate": 0.0, "gpu_memory_mib": 30951.0,
           "engine_step_ms": 6.85, "engine_step_device_ms": 6.2, "engine_step_gpu_ms": 6.15,
           "engine_step_graph_ms": 3.3,
           "engine_prefill_ms_per_step": 2.28, "engine_prefill_ms": 9.12, "engine_prefill_prompts": 13.04,
           "engine_gil_wait_ms": 0.092, "engine_step_gap_ms": 7.21, "engine_step_gap_max_ms": 41.26,
           "engine_batch": 485.6, "engine_busy": 0.96}
    older = {k: v for k, v in row.items() if k not in ("engine_step_graph_ms", "engine_prefill_ms",
                                                       "engine_prefill_prompts",
                                                      "engine_gil_wait_ms", "engine_step_gap_ms",
                                                      "engine_step_gap_max_ms")}
    md = to_markdown({"date": "d", "device_name": "H200", "tokens": 150, "dtype": "bf16", "served": [row, older]})
    lines = md.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| concurrency | p50 ms"))
    names = [c.strip() for c in lines[head].strip("|").split("|")]
    cells = [dict(zip(names, (c.strip() for c in lines[i].strip("|").split("|")), strict=True))
             for i in (head + 2, head + 3)]
    assert all(len(lines[i].strip("|").split("|")) == len(names) for i in (head + 1, head + 2, head + 3))
    assert (cells[0]["GPU clock ms"], cells[0]["graph ms"], cells[0]["prefill ms/step"]) == ("6.15", "3.30", "2.28")
    assert (cells[0]["ms per prefill (prompts)"], cells[0]["GIL wait ms"],
            cells[0]["GPT batch"]) == ("9.12 (13.0)", "0.092", "485.6")
    assert (cells[0]["step gap ms (worst so far)"], cells[1]["step gap ms (worst so far)"]) == ("7.21 (41.3)", "")
    assert (cells[1]["graph ms"], cells[1]["ms per prefill (prompts)"], cells[1]["GIL wait ms"]) == ("", "", "")
    assert cells[1]["GPT busy"] == "96%"


def test_bench_stream_table_gives_streams_per_second():
    from bench.run import to_markdown

    row = {"concurrency": 64, "streams": 2271, "errors": 0, "streams_per_s": 149.6, "first_chunk_p50_ms": 116.5,
           "first_chunk_p99_ms": 254.1, "chunk_gap_p50_ms": 98.0, "chunk_gap_p99_ms": 214.0, "stream_p50_ms": 423.0}
    md = to_markdown({"date": "d", "device_name": "H200", "tokens": 150, "dtype": "bf16", "stream": [row]})
    lines = md.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| concurrency | first chunk p50 ms"))
    names = [c.strip() for c in lines[head].strip("|").split("|")]
    cells = dict(zip(names, (c.strip() for c in lines[head + 2].strip("|").split("|")), strict=True))
    assert len(lines[head + 1].strip("|").split("|")) == len(names) == len(lines[head + 2].strip("|").split("|"))
    assert (cells["streams"], cells["streams/s"], cells["first chunk p99 ms"]) == ("2271", "149.6", "254")


def test_codec_load_bench_times_each_batch_per_utterance(tiny_repo, tmp_path):
    """bench.probes.codec_load on a CPU: the vocoder service of the repository, one row per batch size, the
    per-utterance figure the call's over its items (no GPU clock, no graphs on a CPU)."""
    import json

    from bench.probes import codec_load

    out = tmp_path / "codec.json"
    assert codec_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--batches", "1,3", "--frames", "12",
                            "--calls", "2", "--profile", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["graphs"]) for r in rows] == [(1, False), (3, False)]
    for r in rows:
        assert r["wall_ms"] > 0 and r["wall_ms_per_utt"] == pytest.approx(r["wall_ms"] / r["batch"])
        assert "gpu_ms" not in r
        prof = r["profile"]  # the decoder's and Vocos's operators (leaf ops on a CPU), the costliest first
        assert prof["kernels_per_step"] > 20 and prof["kernel_ms_per_step"] > 0
        ms = [k["ms_per_step"] for k in prof["top"]]
        assert ms == sorted(ms, reverse=True), prof["top"]
        assert "aten::gelu" in [k["name"] for k in prof["top"]]  # the ConvNeXt blocks' activation, a costly leaf
    with pytest.raises(SystemExit):
        codec_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--batches", "0"])


def test_gil_bench_reads_py_spy_samples_as_ms_per_request_per_thread():
    from bench.probes.gil import gil_ms_per_request

    raw = [
        "thread (101): MainThread;execute (backend.py:280);_count (backend.py:196) 30",
        "thread (101): MainThread;execute (backend.py:280) 50",
        "thread (101): MainThread 20",  # the stub's own code, no Python frame
        "thread (102): chattts-engine;_loop (engine.py:1);_decode_step (engine.py:2) 40",
        "",
    ]
    rows = gil_ms_per_request(raw, rate_hz=100, requests=10, focus=["_count", "GPTService.execute"])
    assert list(rows) == ["MainThread", "chattts-engine"]  # most held first
    assert rows["MainThread"] == {"held_ms": 100.0, "in _count": 30.0}  # 100 samples at 100 Hz over 10 requests
    assert rows["chattts-engine"] == {"held_ms": 40.0}
    assert gil_ms_per_request([], 100, 0) == {}


def test_engine_load_bench_keeps_requests_in_flight_on_the_served_engine(tiny_repo, tmp_path):
    """bench.probes.engine_load on a CPU: the GPT model's own service under a closed loop of corpus prompts;
    every window's utterance ran its forced frames and the engine's figures come with it."""
    import json

    from bench.probes import engine_load

    out = tmp_path / "engine.json"
    assert engine_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--concurrency", "1,3", "--seconds", "2",
                             "--settle", "0.5", "--tokens", "8", "--slots", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert res["slots"] == 2  # --slots over the repository's max_slots
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["utterances"] > 0 and r["not_max_tokens"] == 0 and r["throughput_utt_s"] > 0
        assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"] and r["engine_step_ms"] > 0
        assert r["engine_step_gpu_ms"] is None  # no GPU clock on a CPU
        assert r["prefill"] == "padded"  # gpt_packed_prefill is off (and a CPU's TorchScript has no kernel)
        # the running rows' worst gap of the window alone and of the level's first wave (the host's clock here)
        assert 0 < r["engine_step_gap_ms"] <= r["engine_step_gap_max_ms"] and r["first_wave_step_gap_max_ms"] > 0
    # one request in flight: one row per step (the window's counters are read while the engine runs, so
    # its edge may fall between a step's count and its rows: one step's worth of slack)
    assert rows[0]["engine_batch"] == pytest.approx(1.0, abs=0.01)
    assert 1.0 < rows[1]["engine_batch"] <= 2.01  # three in flight, two slots: the third waits (the same slack)


@pytest.mark.parametrize("flag,value", [("--prefill", "packed,dense"), ("--overlap", "")])
def test_engine_load_refuses_a_switch_list_naming_the_flag(tiny_repo, capsys, flag, value):
    from bench.probes import engine_load

    with pytest.raises(SystemExit):
        engine_load.main(["--repo", str(tiny_repo), "--device", "cpu", flag, value])
    assert f"{flag} must be a comma list of" in capsys.readouterr().err


def test_engine_load_timeline_names_the_engine_parts_of_a_window(tiny_repo, tmp_path):
    """--timeline: the level once more under torch.profiler, each engine part in a range of its own. On a CPU the
    parts' host time and calls are real (device time is the GPU's); the engine's methods are its own again after."""
    import json

    from bench.probes import engine_load

    out = tmp_path / "timeline.json"
    assert engine_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--concurrency", "2", "--seconds", "1",
                             "--settle", "0.3", "--tokens", "8", "--timeline", "--out", str(out),
                             "--trace", str(tmp_path / "trace.json")]) == 0
    plain, timed = json.loads(out.read_text())["rows"]
    assert "timeline" not in plain and timed["utterances"] > 0
    t = timed["timeline"]
    # every decode step is launched and landed once; a launch that finds every row ending with the step in flight
    # counts no step, and an admission's first tokens are landed too: a little over one of each per step
    assert 0.95 <= t["step"]["calls"] < 1.5 and 0.95 <= t["land"]["calls"] < 1.5
    assert 0 < t["prefill"]["calls"] < 1 and 0 < t["finish"]["calls"] < 1
    assert t["step"]["host_ms"] > 0 and t["prefill"]["host_ms"] > 0
    # a prefill's inputs and first tokens are parts of it: as many calls (but one cut by the window's end), within
    # its host time
    for part in ("prefill_inputs", "prefill_first"):
        assert abs(t[part]["calls"] - t["prefill"]["calls"]) <= 0.02
        assert 0 < t[part]["host_ms"] < t["prefill"]["host_ms"]
    assert t["kernels_ms_per_step"] == 0.0 and t["cuda_calls"] == {}  # no GPU
    trace = json.loads((tmp_path / "trace-2-on-padded.json").read_text())  # the window's Chrome trace, named by level
    assert any(e.get("name") == "engine.prefill" for e in trace["traceEvents"])


def test_engine_load_think_time_spreads_the_arrivals(tiny_repo, tmp_path):
    """--think-ms: a client waits between a result and its next request, so fewer requests are in the
    engine than clients (here 4 clients thinking ≈ 2 generations' time each), and the level still ends."""
    import json

    from bench.probes import engine_load

    out = tmp_path / "think.json"
    assert engine_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--concurrency", "4", "--seconds", "2",
                             "--settle", "0.5", "--tokens", "8", "--think-ms", "0,150", "--out", str(out)]) == 0
    at_once, row = json.loads(out.read_text())["rows"]  # a list of think times: the levels with each
    assert (at_once["think_ms"], row["think_ms"]) == (0, 150)
    assert row["utterances"] > 0 and row["not_max_tokens"] == 0
    assert row["engine_batch"] < 3.0  # of 4 clients, most are thinking at any time
    assert row["engine_batch"] < at_once["engine_batch"]
    with pytest.raises(SystemExit):
        engine_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--think-ms", "-1"])
    with pytest.raises(SystemExit):
        engine_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--think-ms", "a"])
    with pytest.raises(SystemExit):
        engine_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--concurrency", "x"])


def test_engine_load_bench_says_why_when_the_engine_refuses_its_requests(tiny_repo, monkeypatch):
    """A request the engine refuses (here: empty prompts): the level stops at once with the engine's
    reason instead of waiting for requests that were never admitted."""
    import time

    import torch

    from bench.probes import engine_load

    monkeypatch.setattr(engine_load, "load_prompts", lambda repo: [torch.zeros(0, dtype=torch.int64)])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="refused a request: empty prompt"):
        engine_load.main(["--repo", str(tiny_repo), "--device", "cpu", "--concurrency", "2", "--seconds", "0.5",
                          "--settle", "0.2", "--tokens", "8"])
    assert time.monotonic() - t0 < 60


def test_bench_append_run_with_only_compile_batches_keeps_the_eager_rows(tmp_path, monkeypatch):
    """A run split over device calls (`--append`): the second call's upstream compile rows join the first
    call's file, its empty --upstream-batches leaves the eager rows there (it once replaced them by []) and,
    serving nothing, it leaves the settings the served rows ran with."""
    from bench import run

    calls = []

    def fake_upstream(assets, dev, batches, tokens, repeats, compile):
        calls.append((tuple(batches), compile))
        return [{"batch": b, "latency_s": 1.0 + compile, "throughput_utt_s": b / (1.0 + compile), "rtf": 0.5,
                 "gpu_memory_mib": 1.0} for b in batches]

    monkeypatch.setattr(run, "bench_upstream", fake_upstream)
    common = ["--assets", str(tmp_path / "assets"), "--out", str(tmp_path), "--name", "split", "--device", "cpu",
              "--max-concurrency", "0", "--stream-concurrency="]
    assert run.main([*common, "--upstream-batches", "1,8"]) == 0
    first = json.loads((tmp_path / "split.json").read_text())
    first["served"] = [{"concurrency": 1, "error_rate": 0.0, "latency_p50_ms": 140.0, "latency_p99_ms": 150.0,
                        "throughput_utt_s": 7.0}]  # as if it had served
    first["vocoder_graphs"], first["max_queue_delay_us"] = False, 2000  # not the defaults
    (tmp_path / "split.json").write_text(json.dumps(first))
    assert run.main([*common, "--append", "--upstream-batches=", "--upstream-compile-batches", "1"]) == 0
    res = json.loads((tmp_path / "split.json").read_text())
    # the served rows keep the settings they ran with, not the appending call's defaults
    assert res["served"] == first["served"] and res["vocoder_graphs"] is False and res["max_queue_delay_us"] == 2000
    assert calls == [((1, 8), False), ((1,), True)]
    assert [r["batch"] for r in res["upstream_eager"]] == [1, 8]
    assert [r["batch"] for r in res["upstream_compile"]] == [1]
    assert " ; " in res["command"]
    md = (tmp_path / "split.md").read_text()
    assert "## upstream eager" in md and "## upstream compile" in md and "vocoder batching delay 2000 µs" in md


def test_bench_table_names_the_switches_a_run_set_and_its_note():
    from bench.run import to_markdown

    res = {"date": "2026-12-02", "device_name": "GPU", "tokens": 150, "dtype": "bf16", "vocoder_graphs": True,
           "max_queue_delay_us": 2000, "stream_first_chunks_first": True, "note": "eager rows restored",
           "stream": [{"concurrency": 1, "streams": 1, "errors": 0}]}
    head = to_markdown(res)
    assert "vocoder from CUDA graphs, vocoder batching delay 2000 µs, closed-loop clients" in head
    assert "; first chunks in a codec call of their own" in head  # the stream switches: in the Schedule line, once
    assert head.count("first chunks") == 1 and "own CUDA stream" not in head
    assert "Note: eager rows restored" in head
    assert "batching delay" not in to_markdown({**res, "max_queue_delay_us": 0})  # the default goes unsaid
    assert ", eager vocoder," in to_markdown({**res, "vocoder_graphs": False})
    assert "vocoder" not in to_markdown({k: v for k, v in res.items()
                                         if k not in ("vocoder_graphs", "max_queue_delay_us")})
