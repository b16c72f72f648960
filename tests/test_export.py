"""`python -m export`'s choices that need no export (export/__main__.py): the dtype `--dtype auto` picks for the
cards listed. Exports themselves run in the e2e and parity tests (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from export.__main__ import resolve_dtype


@pytest.fixture
def cards(monkeypatch):
    """Stand-in CUDA devices: `cards(cap, ...)` makes this machine see GPUs of those compute capabilities."""
    def see(*caps):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    return see


def test_auto_dtype_is_bf16_only_where_every_listed_card_has_it(cards):
    said = []
    cards((9, 0), (7, 5))  # an H200 and a T4
    assert resolve_dtype("auto", [0], progress=said.append) == "bf16"
    assert resolve_dtype("auto", [1], progress=said.append) == "fp16"  # Turing: no bf16
    assert resolve_dtype("auto", [0, 1], progress=said.append) == "fp16"  # one engine format for both
    assert resolve_dtype("auto", [0], ["torchscript", "onnx"], progress=said.append) == "fp16"  # ONNX: no bf16 convs
    assert all(line.startswith("[export] --dtype auto: ") for line in said) and "7.5" in said[1]
    cards((8, 0))  # an A100
    assert resolve_dtype("auto", [0], progress=said.append) == "bf16"


def test_auto_dtype_on_the_cpu_and_for_cards_this_machine_does_not_see(cards):
    cards()
    said = []
    assert resolve_dtype("auto", [], progress=said.append) == "fp32"
    assert resolve_dtype("auto", [0], progress=said.append) == "fp16" and "not visible here" in said[-1]
    cards((9, 0))
    assert resolve_dtype("auto", [3], progress=said.append) == "fp16"  # GPU 3 is not on this machine


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int8"])
def test_a_named_dtype_is_kept(cards, dtype):
    cards((7, 5))
    assert resolve_dtype(dtype, [0], progress=lambda _: None) == dtype
