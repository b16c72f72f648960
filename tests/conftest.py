"""Shared fixtures: synthetic asset folders (cached under build/), built once per checkout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("CHATTTS_TRITON_BUILD", ROOT / "build"))


def _assets(size: str) -> Path:
    from export.synthetic import write_assets

    out = BUILD / f"assets-{size}"
    stamp = out / ".complete"
    if not stamp.exists():
        write_assets(out, seed=0, size=size, progress=lambda m: None)
        stamp.touch()
    return out


@pytest.fixture(scope="session")
def tiny_assets() -> Path:
    return _assets("tiny")


@pytest.fixture(scope="session")
def full_assets() -> Path:
    return _assets("full")


def export_repo(assets: Path, out: Path, **deployment) -> Path:
    from chattts_triton.triton.repo_config import Deployment
    from export.__main__ import export_repository

    return export_repository(assets, out, ["torchscript", "onnx"], deployment=Deployment(**deployment),
                             progress=lambda m: None)


@pytest.fixture(scope="session")
def tiny_repo(tiny_assets, tmp_path_factory) -> Path:
    return export_repo(tiny_assets, tmp_path_factory.mktemp("repo") / "tiny")


@pytest.fixture(scope="session")
def full_repo(full_assets, tmp_path_factory) -> Path:
    return export_repo(full_assets, tmp_path_factory.mktemp("repo") / "full", gpt_slots=4)


def _serve(repo: Path, tmp_path_factory):
    from chattts_triton.launcher.tritonserver import TritonServer

    log = tmp_path_factory.mktemp("triton-log") / "tritonserver.log"
    return TritonServer(repo, log_file=log, startup_timeout_s=600)


@pytest.fixture(scope="session")
def served_tiny(tiny_repo, tmp_path_factory):
    """A real tritonserver on free ports serving the tiny-weight repository."""
    with _serve(tiny_repo, tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="session")
def served_full(full_repo, tmp_path_factory):
    with _serve(full_repo, tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def tiny(tiny_assets):
    """Upstream's GPT on the tiny weights, and ours: (arch, upstream Embed, upstream GPT, ours)."""
    from chattts_triton.model.gpt import load_gpt
    from tests.engine_util import upstream_gpt

    arch, emb, g = upstream_gpt(tiny_assets)
    return arch, emb, g, load_gpt(tiny_assets, arch)


@pytest.fixture(scope="session")
def upstream_full(full_assets):
    """Upstream `ChatTTS.Chat` loaded on the same full-size synthetic weights."""
    import logging

    import ChatTTS
    import torch

    chat = ChatTTS.Chat(logging.getLogger("upstream"))
    d = full_assets
    ok = chat._load(
        vocos_ckpt_path=f"{d}/Vocos.safetensors", dvae_ckpt_path=f"{d}/DVAE.safetensors", gpt_ckpt_path=f"{d}/gpt",
        embed_path=f"{d}/Embed.safetensors", decoder_ckpt_path=f"{d}/Decoder.safetensors",
        tokenizer_path=f"{d}/tokenizer", device=torch.device("cpu"),
    )
    assert ok
    return chat


@pytest.fixture(scope="module")
def servers():
    """Stand-in Triton servers (gRPC and HTTP) in this process (tests/test_client.py's FakeServers)."""
    from tests.test_client import FakeServers

    s = FakeServers()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _switch_interval_restored():
    """A GPT service sets the process's GIL switch interval (backend.gpt_service), as its Triton
    process would: each test gets the interpreter's own back."""
    import sys

    interval = sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)


# --- shared voice stores (chattts_triton/runtime/stores.py): real servers from the system's packages ----------------
def _wait_until(ready, proc, log: Path, what: str, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"{what} exited: {log.read_text(errors='replace')[-2000:]}"
        assert time.monotonic() < deadline, (f"{what} not ready in {timeout_s:g} s: "
                                             f"{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)


def _stop(proc, timeout_s: float = 30.0) -> None:
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A redis-server of this test run on a free port, nothing saved to disk (.ci/run installs Debian's)."""
    import shutil
    import subprocess

    from chattts_triton.launcher.tritonserver import free_port, set_parent_death_signal

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (Debian's redis-server package: .ci/run installs it)")
    import redis

    folder = tmp_path_factory.mktemp("redis")
    port = free_port()
    log = folder / "redis.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", str(folder)], stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=set_parent_death_signal)
    client = redis.Redis(port=port, socket_connect_timeout=1)

    def ready() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        _wait_until(ready, proc, log, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        _stop(proc)


def _postgres_bin(name: str):
    """A PostgreSQL server program: on PATH, else Debian's versioned folder (the package puts none on PATH)."""
    import glob
    import shutil

    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    return candidates[-1] if candidates else None


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL server of this test run on a free port (initdb into a fresh folder, trust on loopback). PostgreSQL
    refuses to run as root: as root (CI) the cluster belongs to `nobody` and is started through setpriv."""
    import os
    import shutil
    import subprocess
    import tempfile

    from chattts_triton.launcher.tritonserver import free_port, set_parent_death_signal

    initdb, postgres = _postgres_bin("initdb"), _postgres_bin("postgres")
    if initdb is None or postgres is None:
        pytest.skip("PostgreSQL's server is not installed (Debian's postgresql package: .ci/run installs it)")
    import psycopg

    folder = Path(tempfile.mkdtemp(prefix="chattts-pg-"))  # not under pytest's 0700 root folder: `nobody` works here
    as_user: list = []
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam("nobody")
        os.chown(folder, user.pw_uid, user.pw_gid)
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    data, log = folder / "data", folder / "postgres.log"
    port = free_port()
    try:
        subprocess.run(as_user + [initdb, "-D", str(data), "-U", "chattts", "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, env={**os.environ, "LC_ALL": "C"})
        with open(log, "wb") as out:
            proc = subprocess.Popen(as_user + [postgres, "-D", str(data), "-p", str(port), "-k", str(folder),
                                               "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                                    stdout=out, stderr=subprocess.STDOUT, preexec_fn=set_parent_death_signal)
        url = f"postgresql://chattts@127.0.0.1:{port}/postgres"

        def ready() -> bool:
            try:
                psycopg.connect(url, connect_timeout=1).close()
                return True
            except psycopg.OperationalError:
                return False

        try:
            _wait_until(ready, proc, log, "postgres")
            yield url
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
