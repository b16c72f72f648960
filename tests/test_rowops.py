"""One row's layer products (chattts_triton/model/rowops.py): the reference is the decoder layer's own arithmetic,
the Triton kernel (under Triton's CPU interpreter) equals the reference, and the operator's fake has its shape."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chattts_triton.model import rowops
from chattts_triton.model.gpt import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_the_layers_norm_linear_gate_and_skip(dtype):
    g = torch.Generator().manual_seed(0)
    k, n = 24, 10
    norm = RMSNorm(k, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
    x = torch.randn(k, generator=g).to(dtype)
    w = torch.randn(2 * n, k, generator=g).to(dtype)
    r = torch.randn(n, generator=g).to(dtype)
    assert torch.equal(rowops.reference(x, w[:n], norm.weight, None, 1e-6), F.linear(norm(x), w[:n]))
    gate, up = F.linear(norm(x), w).chunk(2)
    assert torch.equal(rowops.reference(x, w, norm.weight, None, 1e-6, gated=True), F.silu(gate) * up)
    assert torch.equal(rowops.reference(x[:n], w[:n, :n], None, r), r + F.linear(x[:n], w[:n, :n]))


def test_on_a_cpu_row_matvec_is_the_reference_and_the_fake_has_the_outputs_shape():
    g = torch.Generator().manual_seed(1)
    x, w, r = torch.randn(16, generator=g), torch.randn(8, 16, generator=g), torch.randn(4, generator=g)
    assert not rowops.kernel_available(torch.device("cpu"))
    assert torch.equal(rowops.row_matvec(x, w, None, r[:4].repeat(2)), rowops.reference(x, w, None, r[:4].repeat(2)))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx, fw = torch.empty(16), torch.empty(8, 16)
        assert torch.ops.chattts_triton.row_matvec(fx, fw, None, None, 0.0, False).shape == (8,)
        assert torch.ops.chattts_triton.row_matvec(fx, fw, None, None, 0.0, True).shape == (4,)


def test_each_product_gets_a_layout_by_its_inputs():
    assert rowops.default_layout(768) == rowops.LAYOUT_SMALL_K
    assert rowops.default_layout(768, gated=True) == rowops.LAYOUT_GATED
    assert rowops.default_layout(3072) == rowops.LAYOUT_LARGE_K
    assert not rowops.pdl_available(torch.device("cpu"))


_INTERPRETED_KERNEL = """
import json, torch
from unittest import mock
from chattts_triton.model import rowops as R
g = torch.Generator().manual_seed(0)
out = []
# (outputs, inputs, norm, skip, gated, layout): block edges inside and past both sizes, every epilogue
cases = [(48, 40, True, False, False, (16, 16, 1)), (20, 64, False, True, False, (4, 32, 1)),
         (24, 40, True, False, True, (8, 64, 2)), (10, 100, False, True, False, None),
         (33, 1100, True, True, True, None)]
for dtype in (torch.float32, torch.bfloat16):
    for n, k, norm, skip, gated, layout in cases:
        x = torch.randn(k, generator=g).to(dtype)
        w = (torch.randn(n * (2 if gated else 1), k, generator=g) / k ** 0.5).to(dtype)
        nw = (torch.rand(k, generator=g) + 0.5).to(dtype) if norm else None
        r = torch.randn(n, generator=g).to(dtype) if skip else None
        want = R.reference(x, w, nw, r, 1e-5, gated)
        exact = R.reference(*(t.double() if t is not None else None for t in (x, w, nw, r)), 1e-5, gated)
        with mock.patch.object(R, "kernel_available", lambda *a: True):  # the interpreter runs it on the CPU
            got = R.run_kernel(x, w, nw, r, 1e-5, gated, layout=layout)
        out.append(dict(dtype=str(dtype), n=n, shape=list(got.shape), got_dtype=str(got.dtype),
                        err=(got.double() - want.double()).abs().max().item(),
                        exact_err=(got.double() - exact).abs().max().item(),
                        scale=want.double().abs().max().item(),
                        ref_err=(want.double() - exact).abs().max().item()))
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_kernel_in_triton_s_interpreter_equals_the_reference():
    """The Triton kernel itself, run by Triton's CPU interpreter, on each epilogue (norm, gate, skip, all three) with
    output blocks and column blocks that do not divide the sizes: in fp32 equal to the reference to float rounding;
    in bf16 within four of bf16's steps of the exact result at the largest value (the reference is within two: the
    kernel rounds the norm, the sums and the gate as the layer does, but in another order, and the interpreter
    emulates bf16's casts)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _INTERPRETED_KERNEL], capture_output=True, text=True, env=env,
                         timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(got) == 10
    for case in got:
        assert case["shape"] == [case["n"]] and case["got_dtype"] == case["dtype"], case
        if case["dtype"] == "torch.float32":
            assert case["err"] <= 1e-5 * max(1.0, case["scale"]), case
        else:
            assert case["exact_err"] <= 2 ** -5 * case["scale"], case  # four of bf16's steps at the largest value
