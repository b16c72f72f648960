"""What the one-process GPU benches (`engine_load`, `codec_load`) share: where they run and what they write."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def add_device_args(ap: argparse.ArgumentParser) -> None:
    """--repo, --device, --gpu, --out."""
    ap.add_argument("--repo", type=Path, required=True, help="an exported repository (python -m export)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")


def int_list(ap: argparse.ArgumentParser, text: str, flag: str) -> list:
    """A comma-separated list of whole numbers, or the parser's error naming `flag`."""
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        ap.error(f"{flag} must be whole numbers, comma-separated")


def cuda_missing(a: argparse.Namespace) -> bool:
    """True (having said so) when --device cuda was asked for on a host without CUDA."""
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return True
    return False


def write_rows(a: argparse.Namespace, rows: list, **meta) -> None:
    """The rows as JSON at --out (if given), with the repository, device, versions and command."""
    if not a.out:
        return
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"repo": str(a.repo), "device": a.device, **meta,
                                 "gpu": torch.cuda.get_device_name(a.gpu) if a.device == "cuda" else "cpu",
                                 "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows}, indent=1))


def profile_kernels(fn, steps: int, cuda: bool, top: int = 12) -> dict:
    """Kernels of `steps` calls of `fn` (after one unprofiled call): per call ("step"), how many and their summed ms,
    and the `top` kernels by time (on a CPU: leaf operators, a proxy for what a GPU would launch)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    kernels = [e for e in prof.events() if e.device_type == want and (cuda or not e.cpu_children)]
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us() / 1000
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_step": round(len(kernels) / steps, 1),
            "kernel_ms_per_step": round(sum(v[1] for v in by_name.values()) / steps, 4),
            "top": [{"name": name[:120], "per_step": round(n / steps, 2), "ms_per_step": round(ms / steps, 4)}
                    for name, (n, ms) in ranked]}


def graph_us_per_call(fn, cases: list[tuple], iters: int) -> float:
    """Median µs per call of `fn(*case)`, each case launched once inside one CUDA graph replayed `iters` times (CUDA
    events): the GPU time of a kernel launched back to back, as a step's graph launches it."""
    import statistics

    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for case in cases:
            fn(*case)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for case in cases:
            fn(*case)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(cases))
    return statistics.median(times)


def time_launch_way(fn, cases: list[tuple], ref, nbytes: int, iters: int, tag: str) -> dict:
    """One way of launching a kernel in a layout probe: its largest difference to `ref` on the first case and its µs
    per call (`graph_us_per_call`), with the bandwidth of `nbytes` a call, printed after `tag`; a way the compiler
    refuses (registers, shared memory) is said and recorded as {"error": ...}, not fatal."""
    try:
        err = (fn(*cases[0]).float() - ref).abs().max().item()
        us = graph_us_per_call(fn, cases, iters)
    except Exception as e:  # noqa: BLE001  said, not fatal: the other ways still run
        row = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(f"{tag} failed: {row['error']}", flush=True)
        return row
    print(f"{tag} {us:8.2f} µs  {nbytes / us / 1e3:7.1f} GB/s  err {err:.2e}", flush=True)
    return {"us": round(us, 2), "gb_s": round(nbytes / us / 1e3, 1), "max_err": err}
