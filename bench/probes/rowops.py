"""One row's layer products alone, by launch layout: µs per call and the weight bandwidth each reaches.

    python -m bench.probes.rowops --out FILE [--layouts 16/256/4,8/256/4,...] [--dtype bf16]

No engine, no server: the four products of a decode step of one row (`rowops.row_matvec`: norm + q/k/v, o + skip,
norm + gate/up + silu·up, down + skip) on the served shapes, one weight per layer of `--layers` so that no launch
finds its weight in L2. Each way is launched once per layer inside one CUDA graph, replayed `--iters` times (CUDA
events, median); per call: µs, the weight's bytes over that time (GB/s), and the largest difference to
`rowops.reference` computed in fp32. `current` is `rowops.run_kernel` as the step launches it
(`rowops.default_layout`, `rowops.PDL`); `N/K/W` the same kernel with N outputs per program, K columns per load and
W warps; either with `/nopdl`: launched one after the other, not as programmatic dependents (in a chain of the same
product, as here, each launch lets the next fetch its weights early: the step interleaves other kernels);
`inductor` the reference compiled by torch.compile (what the step ran before the kernels: inductor's own
reductions for a product summed in fp32 take `gemv_linear`'s place); `cublas` the reference eagerly (cuBLAS's GEMM and
PyTorch's elementwise kernels around it).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from bench.common import time_launch_way
from chattts_triton.config import Arch
from chattts_triton.model import rowops
from chattts_triton.model.gpt import gemv_linear

DEFAULT_LAYOUTS = ("current,current/nopdl,8/1024/4,4/1024/2,4/1024/4,2/1024/2,2/1024/1,1/1024/1,16/1024/8,2/4096/2,"
                   "4/4096/4,1/4096/1,2/512/1")


def parse_layout(text: str) -> dict:
    """`inductor`, `cublas` -> themselves; `current` or `N/K/W`, either with `/nopdl` -> run_kernel's layout and
    launch (ValueError naming the text)."""
    if text in ("inductor", "cublas"):
        return {"way": text}
    body = text.removesuffix("/nopdl")
    pdl = {"pdl": False} if body != text else {}
    if body == "current":
        return {"way": "kernel", **pdl}
    try:
        n, k, w = (int(v) for v in body.split("/"))
    except ValueError:
        raise ValueError(f"layout {text!r}: want current, inductor, cublas or N/K/W, the first or last with /nopdl") \
            from None
    return {"way": "kernel", "layout": (n, k, w), **pdl}


def products(arch: Arch) -> dict:
    """name -> (N, K, norm, residual, gated) of the layer's four one-row products."""
    d = arch.gpt
    qkv = (d.heads + 2 * d.kv_heads) * d.head_dim
    return {"qkv": (qkv, d.hidden, True, False, False), "o": (d.hidden, d.heads * d.head_dim, False, True, False),
            "gate_up": (d.intermediate, d.hidden, True, False, True),
            "down": (d.hidden, d.intermediate, False, True, False)}


def _inductor_reference(x, weight, norm_weight, residual, eps, gated):
    """The layer's product as the compiled one-row step wrote it before the kernels (`gemv_linear`)."""
    dtype = x.dtype
    h = x
    if norm_weight is not None:
        f = x.float()
        h = norm_weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = gemv_linear(h, weight)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else residual + y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS + ",inductor,cublas")
    ap.add_argument("--products", default="qkv,o,gate_up,down")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    a = ap.parse_args(argv)
    try:
        ways = {t: parse_layout(t) for t in a.layouts.split(",") if t}
    except ValueError as e:
        ap.error(f"--layouts: {e}")
    arch = Arch()
    shapes = products(arch)
    wanted = [p for p in a.products.split(",") if p]
    if unknown := [p for p in wanted if p not in shapes]:
        ap.error(f"--products: unknown {unknown}; choose from {sorted(shapes)}")
    if not torch.cuda.is_available():
        print("bench.probes.rowops needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    eps = arch.gpt.rms_eps
    compiled = torch.compile(_inductor_reference, dynamic=False)
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
           "dtype": a.dtype, "products": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in wanted:
        n, k, norm, res, gated = shapes[name]
        rows = n * (2 if gated else 1)
        cases = [(torch.randn(k, device="cuda", generator=g).to(dtype),
                  (torch.randn(rows, k, device="cuda", generator=g) / k ** 0.5).to(dtype),
                  (torch.rand(k, device="cuda", generator=g) + 0.5).to(dtype) if norm else None,
                  torch.randn(n, device="cuda", generator=g).to(dtype) if res else None, eps, gated)
                 for _ in range(a.layers)]
        x, w, nw, r = (t.float() if t is not None else None for t in cases[0][:4])
        ref = rowops.reference(x, w, nw, r, eps, gated)
        weight_bytes = rows * k * cases[0][1].element_size()
        res_out = {}
        for label, way in ways.items():
            if way["way"] == "inductor":
                fn = compiled
            elif way["way"] == "cublas":
                fn = rowops.reference
            else:
                fn = functools.partial(rowops.run_kernel, layout=way.get("layout"), pdl=way.get("pdl"))
            res_out[label] = time_launch_way(fn, cases, ref, weight_bytes, a.iters, f"{name:8s} {label:12s}")
        timed = [t for t in res_out if "us" in res_out[t]]
        best = min(timed, key=lambda t: res_out[t]["us"]) if timed else None
        out["products"][name] = {"shape": [rows, k], "weight_mb": round(weight_bytes / 1e6, 2), "best": best,
                                 "ways": res_out}
        print(f"{name:8s}: best {best} against current {res_out.get('current', {}).get('us', '-')} µs", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
