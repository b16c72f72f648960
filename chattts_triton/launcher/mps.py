"""CUDA MPS (Multi-Process Service) for one server's lifetime.

Each model instance of the python backend is a process with its own CUDA context, and a GPU
time-slices contexts: the GPT engine's decode steps and the decoder/vocoder processes take turns
instead of sharing the GPU (served, a large batch's decode step took about twice its time alone;
docs/performance.md). Under MPS their kernels run side by side. `mps_daemon` starts a control daemon
with its own pipe and log folders and yields the environment the server's processes need to reach it;
the daemon is told to quit on exit. Where the host already runs MPS (a node-level setting), leave
this off: clients find that daemon by themselves.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

MPS_CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    pass


def _control(exe: str, env: dict[str, str], args=(), stdin: str | None = None, out=None) -> subprocess.CompletedProcess:
    """One call of the control program. `out`: a file for its output instead of pipes (the daemon that `-d`
    forks keeps inherited pipes open, and reading them to their end would wait for the daemon)."""
    streams = dict(stdout=out, stderr=subprocess.STDOUT) if out is not None else dict(capture_output=True)
    try:
        return subprocess.run([exe, *args], input=stdin, env={**os.environ, **env}, text=True, timeout=30,
                              **({"stdin": subprocess.DEVNULL} if stdin is None else {}), **streams)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MpsError(f"{exe} {' '.join(args)} failed: {e}") from e


def _quit(exe: str, env: dict[str, str]) -> None:
    try:
        _control(exe, env, stdin="quit\n")  # the daemon ends once its clients have exited
    except MpsError as e:  # the server's own exit status matters more
        print(f"warning: stopping the MPS daemon failed: {e}", file=sys.stderr)


@contextlib.contextmanager
def mps_daemon(base_dir: os.PathLike | None = None, control: str = MPS_CONTROL) -> Iterator[dict[str, str]]:
    """Run an MPS control daemon while the block runs; yields CUDA_MPS_PIPE_DIRECTORY and
    CUDA_MPS_LOG_DIRECTORY for the processes that should use it (the server's environment)."""
    exe = shutil.which(control)
    if exe is None:
        raise MpsError(f"{control} not found on PATH: MPS needs the NVIDIA driver's utilities")
    # the pipe folder holds unix sockets, whose paths are limited to ~100 characters: keep it short
    own = base_dir is None
    base = Path(tempfile.mkdtemp(prefix="chattts-mps-")) if own else Path(base_dir)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log")}
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    start_log = base / "log" / "start.out"
    try:
        with open(start_log, "w") as out:
            started = _control(exe, env, ["-d"], out=out)
        if started.returncode != 0:
            raise MpsError(f"{control} -d exited with {started.returncode}: {start_log.read_text().strip()}")
        try:
            yield env
        finally:
            _quit(exe, env)
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
