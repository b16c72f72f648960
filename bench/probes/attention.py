"""The decode-attention kernel alone, by launch layout and rows: µs per layer and the memory bandwidth it reaches.

    python -m bench.probes.attention --out FILE [--rows 1,8,64,256,512,1024] [--lengths 16:272] [--configs ...]

No engine, no server: a paged cache of the served shape (`--heads` heads of `--head-dim`, pages of
`config.KV_PAGE_TOKENS` positions handed out in shuffled order, one pool per layer of `--layers`, so that no
launch finds its keys in L2), rows with lengths uniform in `--lengths`, queries random. Each layout is launched
once per layer inside one CUDA graph, replayed `--iters` times (CUDA events, median); per layer: µs, the bytes of
keys and values the rows attend over that time (GB/s), and the largest difference to `attention.reference`.
`current` is `attention.run_kernel` as the step launches it (`attention.launch_layout`); `BLOCK/WARPS[/sSPLITS]`
the same kernel with BLOCK keys per loop, WARPS warps and a row's keys in SPLITS programs merged by a second kernel.
`--kv-dtype fp8`: keys and values stored as float8 e4m3 (queries and the output in `--dtype`): what the kernel
would take from a cache of half the bytes (the reference reads the same values widened).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from bench.common import int_list, time_launch_way
from chattts_triton.config import KV_PAGE_TOKENS
from chattts_triton.model import attention

DEFAULT_CONFIGS = "current,64/4,16/1,32/2,16/1/s2,16/1/s4,16/1/s8,32/2/s8"


def parse_config(text: str) -> dict:
    """`current` -> {}; `BLOCK/WARPS[/sN]` -> run_kernel's keywords (ValueError naming the text)."""
    if text == "current":
        return {}
    parts = text.split("/")
    try:
        kw = {"block": int(parts[0]), "warps": int(parts[1]), "splits": 1}
        for extra in parts[2:]:
            kw[{"s": "splits"}[extra[0]]] = int(extra[1:])
    except (IndexError, KeyError, ValueError):
        raise ValueError(f"config {text!r}: want current or BLOCK/WARPS[/sSPLITS]") from None
    return kw


def make_case(rows: int, heads: int, head_dim: int, layers: int, lo: int, hi: int, dtype, kv_dtype, seed: int = 0):
    """Queries [rows, H, D], per-layer key and value pools, block tables and lengths of a served mix."""
    g = torch.Generator().manual_seed(seed + rows)
    lengths = torch.randint(lo, hi, (rows,), generator=g)
    width = -(-hi // KV_PAGE_TOKENS)
    pages = rows * width + 1
    tables = (torch.randperm(pages - 1, generator=g)[: rows * width].view(rows, width) + 1).cuda()
    shape = (pages, KV_PAGE_TOKENS, heads, head_dim)
    pools = [(torch.randn(shape, device="cuda", dtype=dtype).to(kv_dtype),
              torch.randn(shape, device="cuda", dtype=dtype).to(kv_dtype)) for _ in range(layers)]
    q = torch.randn(rows, heads, head_dim, device="cuda", dtype=dtype)
    return q, pools, tables, lengths.cuda()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="1,8,64,256,512,1024")
    ap.add_argument("--lengths", default="16:272", help="LO:HI, rows' key counts uniform in [LO, HI)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--kv-dtype", default="same", choices=["same", "fp8"],
                    help="keys and values as --dtype, or float8 e4m3 (half the bytes)")
    a = ap.parse_args(argv)
    rows = int_list(ap, a.rows, "--rows")
    try:
        lo, hi = (int(v) for v in a.lengths.split(":"))
        configs = {c: parse_config(c) for c in a.configs.split(",") if c}
    except ValueError as e:
        ap.error(f"--lengths / --configs: {e}")
    if not 1 <= lo < hi:
        ap.error("--lengths must be LO:HI with 1 <= LO < HI")
    if not torch.cuda.is_available():
        print("bench.probes.attention needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    kv_dtype = dtype if a.kv_dtype == "same" else torch.float8_e4m3fn
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
           "lengths": [lo, hi], "dtype": a.dtype, "kv_dtype": a.kv_dtype, "rows": {}}
    for b in rows:
        q, pools, tables, lengths = make_case(b, a.heads, a.head_dim, a.layers, lo, hi, dtype, kv_dtype)
        ref = attention.reference(q, *(t.to(dtype) for t in pools[0]), tables, lengths).float()
        moved = int(lengths.sum()) * a.heads * a.head_dim * 2 * pools[0][0].element_size()  # keys + values attended
        res = {}
        for name, kw in configs.items():
            fn = functools.partial(attention.run_kernel, **kw)
            res[name] = time_launch_way(fn, [(q, k, v, tables, lengths) for k, v in pools], ref, moved, a.iters,
                                        f"rows {b:5d} {name:14s}")
        best = min((n for n in res if "us" in res[n]), key=lambda n: res[n]["us"])
        out["rows"][b] = {"attended_mb": round(moved / 1e6, 2), "best": best, "configs": res}
        now = res.get("current", {}).get("us", "-")
        print(f"rows {b:5d}: best {best} {res[best]['us']} µs against current {now}", flush=True)
        del pools
        torch.cuda.empty_cache()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
