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

    return export_repository(assets, out, ["torchscript", "onnx"], deployment=Deployment(**deployment), progress=lambda m: None)


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
