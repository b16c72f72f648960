"""bench.gateway: its closed-loop rate; end to end, briefly, against the served tiny repository: every table it
promises is filled, and without PyAV (as tools.bundle ships the gateway) what FFmpeg makes is reported as not
measured."""

from __future__ import annotations

import json
import os
import sys

import pytest

SHORT = ["--requests", "3", "--concurrency", "4", "--seconds", "1.5", "--phases", "1", "--encode-repeats", "1",
         "--tokens", "8"]


def _waves(concurrency: int, period: float, until: float, latency=lambda i: None):
    """Closed loops whose requests all begin together and take `period` (or latency(wave)): (begun, ended)."""
    spans, t, i = [], 0.0, 0
    while t < until:
        d = latency(i) or period
        spans += [(t, t + d)] * concurrency
        t, i = t + d, i + 1
    return spans


@pytest.mark.parametrize("offset", [0.0, 1.3, 2.9, 5.1, 7.7])
def test_closed_loop_rate_of_waves_is_concurrency_over_latency_wherever_the_window_falls(offset):
    from bench.gateway import closed_loop_rate

    spans = _waves(256, 8.0, 60.0)
    r = closed_loop_rate(spans, 256, 10.0 + offset, 30.0 + offset)
    assert r["rps"] == pytest.approx(32.0) and r["mean_latency_s"] == pytest.approx(8.0)
    assert r["steady_requests"] in (512, 768)  # two or three waves begun in the window


def test_closed_loop_rate_counts_move_by_a_wave_and_the_latency_rate_does_not():
    from bench.gateway import closed_loop_rate

    spans = _waves(256, 8.0, 60.0)
    counted = {round(closed_loop_rate(spans, 256, s, s + 20.0)["counted_rps"], 1) for s in (10.0, 14.0)}
    assert counted == {25.6, 38.4}  # 2 or 3 waves end in a 20-s window
    slower = _waves(256, 8.0, 60.0, latency=lambda i: 8.0 if i % 2 else 12.0)  # waves of 12 s and 8 s: mean 10
    assert closed_loop_rate(slower, 256, 0.0, 40.0)["rps"] == pytest.approx(25.6)


def test_closed_loop_rate_without_requests_in_the_window_is_zero():
    from bench.gateway import closed_loop_rate

    r = closed_loop_rate([(0.0, 50.0)] * 4, 4, 10.0, 30.0)
    assert r["rps"] == 0.0 and r["steady_requests"] == 0 and r["counted_rps"] == 0.0


@pytest.mark.e2e
def test_bench_gateway_measures_both_paths_and_every_encoder(served_tiny, tmp_path):
    from bench.gateway import main
    from gateway.audio import FORMATS

    out = tmp_path / "gw"
    assert main(["--repo", str(served_tiny.model_repository), "--grpc-url", served_tiny.grpc_url, "--out", str(out),
                 "--workers", "1,2", *SHORT]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert [v["workers"] for v in res["variants"]] == [1, 2]
    for v in res["variants"]:  # each gateway size measured whole
        assert v["c1_wav"]["direct_p50_ms"] > 0 and v["c1_wav"]["gateway_p50_ms"] > 0
        assert set(v["c1_first_byte"]) == {"pcm", "mp3"}
        tp = v["throughput"]
        assert tp["errors"] == {"direct": 0, "gateway": 0} and tp["direct_rps"] > 0 and tp["gateway_rps"] > 0
        assert tp["gateway_cpu_ms_per_request"] > 0 and len(tp["phase_ratios"]) == 1
    assert (out.parent / "gw.gateway-2.log").is_file()
    enc = res["encoding"]
    assert set(enc["formats"]) == set(FORMATS)
    assert all(f["decoded_samples"] >= enc["samples"] for f in enc["formats"].values())  # every file decodes whole
    assert res["pyav"]["available"] and res["skipped"] == [] and res["launcher"] is None
    md = out.with_suffix(".md").read_text()
    assert "| 1 process: concurrency 4, whole wav |" in md and "| 2 processes: concurrency 4, whole wav |" in md
    assert "| mp3 |" in md and "Not measured" not in md


@pytest.mark.e2e
def test_bench_gateway_without_pyav_measures_wav_and_pcm_through_the_launcher(tiny_repo, tmp_path, monkeypatch):
    """PyAV hidden from this process and from the gateway it starts (an `av` that fails to import first on
    PYTHONPATH); the server is started by bench.gateway itself, through the launcher."""
    from bench.gateway import main
    from gateway.audio import WHOLE_WITHOUT_PYAV

    fake = tmp_path / "no-av"
    (fake / "av").mkdir(parents=True)
    (fake / "av" / "__init__.py").write_text('raise ImportError("PyAV hidden by the test")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.delitem(sys.modules, "av", raising=False)  # an earlier test's import: restored afterwards
    out = tmp_path / "gw"
    assert main(["--repo", str(tiny_repo), "--out", str(out), *SHORT]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["pyav"] == {"available": False, "error": "ImportError: PyAV hidden by the test"}
    assert res["launcher"]["ready_s"] > 0 and res["launcher"]["restarts"] == 0 and res["launcher"]["exit_status"] == 0
    (v,) = res["variants"]  # one size: the gateway's default
    assert v["workers"] == 2 and v["c1_wav"]["gateway_p50_ms"] > 0 and set(v["c1_first_byte"]) == {"pcm"}
    tp = v["throughput"]
    assert tp["errors"] == {"direct": 0, "gateway": 0} and tp["gateway_rps"] > 0  # the gateway served wav without PyAV
    enc = res["encoding"]["formats"]
    assert (set(enc) == set(WHOLE_WITHOUT_PYAV) and all(f["decoded_samples"] >= res["encoding"]["samples"]
                                                        for f in enc.values()))
    assert enc["pcm"]["stream_ms_per_audio_s"] > 0 and enc["wav"]["stream_ms_per_audio_s"] is None
    skipped = " | ".join(s["what"] for s in res["skipped"])
    assert "first mp3 byte" in skipped and "mp3, opus, aac" in skipped and "mp3, opus, aac, flac, wav" in skipped
    md = out.with_suffix(".md").read_text()
    assert ("**Not measured** (PyAV cannot be imported (ImportError: PyAV hidden by the test)" in md
            and "first mp3 byte" in md)
    assert "| wav |" in md and "not measured" in md and "| mp3 |" not in md
    assert "python -m chattts_triton.serve --repo" in md and "| concurrency 4, whole wav |" in md


def test_gateway_cpu_counts_its_worker_processes():
    """`--workers N` serves from child processes: their CPU time is the gateway's too."""
    import subprocess
    import time

    from bench.gateway import cpu_seconds

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"c = subprocess.Popen([sys.executable, '-c', {burn!r}])\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while cpu_seconds(parent.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cpu_seconds(parent.pid) >= 0.6  # the parent itself only sleeps
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()
        parent.wait()


@pytest.mark.parametrize("bad", ["0", "1,x", "", "2,-1"])
def test_bench_gateway_refuses_a_bad_workers_list_naming_the_flag(bad, capsys):
    from bench.gateway import main

    with pytest.raises(SystemExit) as e:
        main(["--repo", "r", "--out", "o", "--workers", bad])
    assert e.value.code == 2 and "--workers" in capsys.readouterr().err


def test_bench_gateway_keeps_the_workers_list_its_own(capsys):
    from bench.gateway import main

    with pytest.raises(SystemExit):
        main(["--repo", "r", "--out", "o", "--gateway-arg=--workers=2"])
    assert "--workers is bench.gateway's own flag" in capsys.readouterr().err
