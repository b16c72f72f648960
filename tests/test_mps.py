"""The CUDA MPS daemon for one server's lifetime (chattts_triton.launcher.mps), against a stand-in
`nvidia-cuda-mps-control` that records how it was called (no GPU here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chattts_triton.launcher import tritonserver as ts
from chattts_triton.launcher.mps import MPS_CONTROL, MpsError, mps_daemon

ROOT = Path(__file__).resolve().parents[1]
SPIKE_REPO = ROOT / "tests" / "fixtures" / "spike_repo"


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """A stand-in control program on PATH: logs its arguments, pipe folder and stdin; FAKE_MPS_RC sets its
    exit; `-d` leaves a background process holding its stdout, as a daemon does."""
    bindir, log = tmp_path / "bin", tmp_path / "mps-calls.log"
    bindir.mkdir()
    exe = bindir / MPS_CONTROL
    exe.write_text(f"""#!/usr/bin/env bash
stdin=""; [ "$#" -eq 0 ] && stdin=$(cat)
echo "args=[$*] pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=[$stdin]" >> {log}
[ "${{FAKE_MPS_RC:-0}}" = 0 ] || {{ echo "An instance of this daemon is already running" >&2; exit "$FAKE_MPS_RC"; }}
[ "$1" = "-d" ] && {{ sleep 20 & }}
exit 0
""")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_daemon_gets_its_own_folders_and_is_told_to_quit_on_exit(fake_control, tmp_path):
    t0 = time.monotonic()
    with mps_daemon(tmp_path / "mps") as env:
        assert time.monotonic() - t0 < 10  # not waiting for the daemon's inherited output to close
        assert env == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / "pipe"),
                       "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps" / "log")}
        assert all(Path(d).is_dir() for d in env.values())
        calls = fake_control.read_text().splitlines()
        assert calls == [f"args=[-d] pipe={env['CUDA_MPS_PIPE_DIRECTORY']} log={env['CUDA_MPS_LOG_DIRECTORY']} "
                         "stdin=[]"]
    calls = fake_control.read_text().splitlines()
    assert len(calls) == 2 and calls[1].startswith("args=[] pipe=") and calls[1].endswith("stdin=[quit]")


def test_an_error_inside_the_block_still_stops_the_daemon(fake_control):
    with pytest.raises(KeyError):
        with mps_daemon():
            raise KeyError("boom")
    assert fake_control.read_text().splitlines()[-1].endswith("stdin=[quit]")


def test_a_missing_control_program_or_a_failed_start_is_a_clear_error(fake_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_RC", "1")
    with pytest.raises(MpsError, match="exited with 1: An instance of this daemon is already running"):
        with mps_daemon():
            pass
    assert "stdin=[quit]" not in fake_control.read_text()  # nothing started, nothing to stop
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MpsError, match="not found on PATH"):
        with mps_daemon():
            pass


def test_serve_without_the_control_program_refuses_mps_with_a_message(tmp_path, monkeypatch, capsys):
    from chattts_triton.launcher import serve

    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None)
    assert serve.main(["--repo", str(SPIKE_REPO), "--mps"]) == 1
    assert f"{MPS_CONTROL} not found" in capsys.readouterr().err


@pytest.mark.e2e
def test_serve_with_mps_gives_the_model_processes_the_daemons_pipe(fake_control, tmp_path):
    cmd = [sys.executable, "-m", "chattts_triton.serve", "--repo", str(SPIKE_REPO), "--http-port", "0",
           "--grpc-port", "0",
           "--metrics-port", "0", "--log-file", str(tmp_path / "serve.log"), "--exit-timeout", "5", "--mps"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        pipe, pid = None, None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("MPS daemon: pipe "):
                pipe = line.split("pipe ", 1)[1].strip()
            if line.startswith("tritonserver pid"):
                pid = int(line.split()[2])
                break
        assert pipe and pid, proc.stderr.read() if proc.poll() is not None else "no ready line"
        stubs = list(ts.python_stubs(pid))
        assert stubs
        for p in [pid] + stubs:  # the server and every python-backend stub reach the daemon
            environ = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in environ
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert fake_control.read_text().splitlines()[-1].endswith("stdin=[quit]")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
