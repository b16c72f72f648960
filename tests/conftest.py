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
