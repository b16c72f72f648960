"""bench.http_clients' arithmetic and report, and loadtest.standin's repository (no server here)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench import http_clients as hc
from chattts_triton import config as C
from loadtest import standin


def test_summarize_counts_the_window_only():
    spans = [(0.0, 0.5, True), (0.2, 1.5, True), (1.0, 2.5, False), (1.1, 2.9, True), (2.0, 3.5, True)]
    got = hc.summarize(spans, 1.0, 3.0)
    assert got["requests"] == 3 and got["errors"] == 1
    assert got["throughput_utt_s"] == pytest.approx(2 / 2.0)
    assert got["latency_p50_ms"] == pytest.approx((1300 + 1800) / 2)


def _history(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Timestamp", "User Count", "Type", "Name", "50%", "99%", "Total Request Count",
                    "Total Failure Count"])
        w.writerows(rows)


def test_locust_window_takes_the_aggregated_rows_inside(tmp_path):
    p = tmp_path / "h.csv"
    _history(p, [[100, 4, "", "Aggregated", "N/A", "N/A", 10, 0], [101, 4, "http", "chattts short", 1, 2, 99, 9],
                 [102, 4, "", "Aggregated", 40, 90, 30, 1], [106, 4, "", "Aggregated", 45, 95, 110, 3],
                 [120, 4, "", "Aggregated", 70, 99, 500, 3]])
    got = hc.locust_window(p, 101.5, 110)
    assert got == {"throughput_utt_s": pytest.approx((80 - 2) / 4), "errors": 2, "requests": 80,
                   "latency_p50_ms": 45.0, "latency_p99_ms": 95.0}  # the last row's: Locust's current percentiles
    assert hc.locust_window(p, 99, 103)["latency_p50_ms"] == 40.0
    _history(p, [[100, 4, "", "Aggregated", "N/A", "N/A", 0, 0], [101, 4, "", "Aggregated", "N/A", "N/A", 0, 0]])
    assert hc.locust_window(p, 100, 101) == {"throughput_utt_s": 0.0, "errors": 0, "requests": 0,
                                             "latency_p50_ms": None, "latency_p99_ms": None}
    with pytest.raises(RuntimeError, match="fewer than two"):
        hc.locust_window(p, 101, 110)


def test_locust_window_of_worker_reports_counts_whole_report_intervals(tmp_path):
    """A --processes master's totals move only when its workers report (every 3 s): the rate is taken over a whole
    number of report intervals from the window's first row, not between the window's ends, which here straddle two
    rows of one total."""
    p = tmp_path / "h.csv"
    totals = {100: 0, 101: 0, 102: 30, 103: 30, 104: 30, 105: 60, 106: 60, 107: 60, 108: 90, 109: 90, 110: 90}
    _history(p, [[t, 4, "", "Aggregated", 40, 90, n, 0] for t, n in totals.items()])
    got = hc.locust_window(p, 100.5, 109.5)
    assert got["requests"] == 60 and got["throughput_utt_s"] == pytest.approx(60 / 6)  # 101 -> 107: 10 a second
    got = hc.locust_window(p, 102.5, 104.5)  # under one interval: the rows' own difference, honestly none
    assert got["requests"] == 0 and got["throughput_utt_s"] == 0.0


def test_locust_window_of_workers_reporting_at_other_phases_does_not_overcount(tmp_path):
    """Two workers, 15 requests each per 3-s report, one a second after the other: 10 requests a second. Between the
    first and the last moved rows (102 -> 109) the totals grow by 75 in 7 s (10.7 a second): one report too many."""
    p = tmp_path / "h.csv"
    totals = {100: 0, 101: 0, 102: 15, 103: 30, 104: 30, 105: 45, 106: 60, 107: 60, 108: 75, 109: 90, 110: 90}
    _history(p, [[t, 4, "", "Aggregated", 40, 90, n, 0] for t, n in totals.items()])
    for t0, t1 in ((100.5, 110), (99, 110), (101.5, 110), (100, 108)):
        got = hc.locust_window(p, t0, t1)
        assert got["throughput_utt_s"] == pytest.approx(10.0), (t0, t1)


def test_stop_group_ends_the_workers_that_outlive_their_leader(tmp_path):
    """Locust's --processes workers outlive a master that exits on SIGINT; stop_group ends the whole group."""
    import os
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "child"
    code = ("import os, signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
            "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    hc.stop_group(proc, timeout=2.0)
    assert proc.returncode == 0  # the leader took its SIGINT
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):  # the child that ignored SIGINT was killed with its group
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)


def test_ratios_and_marks_against_perf_analyzer():
    rows = [{"concurrency": 64, "path": "perf_analyzer", "throughput_utt_s": 200.0},
            {"concurrency": 64, "path": "asyncio", "throughput_utt_s": 190.0},
            {"concurrency": 64, "path": "tritonclient-aio", "throughput_utt_s": 50.0},
            {"concurrency": 256, "path": "sync", "throughput_utt_s": 300.0}]
    hc.add_ratios(rows)
    assert [r["of_perf_analyzer"] for r in rows] == [1.0, 0.95, 0.25, None]
    md = hc.to_markdown({"server": "s", "machine": "m", "tokens": 150, "seconds": 30, "warmup": 10, "window_ms": 5000,
                         "stability": 25, "command": "python -m bench.http_clients", "rows": rows})
    assert "| 64 | asyncio | 190.0 | 95 % ✓ |" in md and "| 64 | tritonclient-aio | 50.0 | 25 % ✗ |" in md
    assert "| 256 | sync | 300.0 |  |" in md  # no reference at that level: no share


@pytest.mark.parametrize("argv", [["--url", "h:1", "--paths", "asyncio,nope"], ["--url", "h:1", "--paths", "grpc"],
                                  ["--url", "h:1", "--concurrency", "0"], ["--standin", "--tokens", "0"],
                                  ["--paths", "sync"], ["--standin", "--locust-processes", "0"],
                                  ["--standin", "--paths", "locust", "--locust-processes", "2", "--seconds", "3"]])
def test_bad_arguments_exit_2(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        hc.main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2


def test_standin_has_the_ensembles_inputs_and_outputs(tmp_path):
    repo = standin.write_repo(tmp_path / "r", default_frames=7)
    text = (repo / C.ENSEMBLE / "config.pbtxt").read_text()
    assert f'name: "{C.ENSEMBLE}"' in text and 'backend: "python"' in text
    for name, (dtype, _, required) in C.ENSEMBLE_INPUTS.items():
        block = text.split(f'name: "{name}"\n', 1)[1].split("}", 1)[0]
        assert f"data_type: {dtype}" in block and ("optional: true" in block) == (not required), name
    for name in C.ENSEMBLE_OUTPUTS:
        assert f'output {{\n  name: "{name}"' in text
    assert 'key: "default_frames"\n  value {\n    string_value: "7"' in text
    assert "class TritonPythonModel" in (repo / C.ENSEMBLE / "1" / "model.py").read_text()
    with pytest.raises(ValueError, match="default_frames"):
        standin.write_repo(tmp_path / "x", default_frames=0)


@pytest.fixture(scope="module")
def standin_server(tmp_path_factory):
    from chattts_triton.launcher.tritonserver import TritonServer

    tmp = tmp_path_factory.mktemp("standin")
    with TritonServer(standin.write_repo(tmp / "r"), log_file=tmp / "log") as server:
        yield server


@pytest.mark.e2e
def test_standin_serves_the_forced_length_to_our_clients(standin_server):
    import asyncio

    from client import AsyncChatTTSClient, ChatTTSClient

    server = standin_server
    with ChatTTSClient(server.grpc_url, retries=0) as c:
        audio = c.infer_one("你好。", {"max_new_tokens": 12, "min_new_tokens": 12})
        spoken = c.infer_one("你好。", spoken_text=True)[1]

    async def over_http():
        async with AsyncChatTTSClient(server.http_url, protocol="http", retries=0) as c:
            return await c.infer_one("你好。")

    default = asyncio.run(over_http())
    assert audio.size == C.samples_for_codes(12) and default.size == C.samples_for_codes(standin.DEFAULT_FRAMES)
    assert spoken == "你好。" and 0 < abs(default).max() < 1


@pytest.mark.e2e
def test_locust_row_from_worker_processes(standin_server, tmp_path):
    """The locust path as the GPU stage runs it (Locust's --processes: a master and its workers), into the report:
    its requests, latencies and the server's view of the window, all from a real run."""
    server = standin_server
    argv = ["--url", server.http_url, "--metrics-url", f"{server.host}:{server.metrics_port}", "--paths", "locust",
            "--concurrency", "4", "--tokens", "8", "--warmup", "1", "--seconds", "9", "--pause", "0",
            "--locust-processes", "2", "--out", str(tmp_path)]
    assert hc.main(argv) == 0
    (row,) = json.loads((tmp_path / "http-clients.json").read_text())["rows"]
    assert row["path"] == "locust" and row["concurrency"] == 4 and row["errors"] == 0
    assert row["requests"] > 0 and row["throughput_utt_s"] > 0
    # Locust's percentiles are whole milliseconds: the stand-in answers most requests in under one, so p50 may be 0
    assert row["latency_p50_ms"] is not None and 0 <= row["latency_p50_ms"] <= row["latency_p99_ms"]
    assert row["model_batch"] >= 1  # the server saw the window's requests
    log = (tmp_path / "locust-c4" / "locust.log").read_text()
    assert "--processes 2" in log
    assert "| 4 | locust |" in (tmp_path / "http-clients.md").read_text()
    # no master or worker of the row outlives it (a worker left behind would load the next row's server)
    corpus = str(tmp_path / "locust-c4" / "corpus.txt")
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and corpus.encode() in (proc / "cmdline").read_bytes():
                left.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    assert left == []
