"""What the decoder + Vocos cost per utterance by batch size: the GPU time the codec takes from the engine.

    python -m bench.probes.codec_load --repo REPO [--batches 1,4,8,16,32,64] [--frames 150] [--calls 20]
                                      [--profile N] [--codec-compile] [--out FILE]

Builds `chattts_vocoder`'s service from an exported repository (its dtype and artifacts), then times
`synthesize` on `--batches` items of `--frames` code frames each (the decoder path, as served by
default): wall ms per call (host to audio on the host) and the span on the GPU's own clock (CUDA
events), eager and from the codec's CUDA graphs. Per utterance, the GPU ms times the served rate is
the share of the GPU the codec needs (e.g. 1 ms per utterance at 400 utt/s: 40 %). `--profile N`: also N eager
calls per batch under torch.profiler (the graphs replay the same kernels): the kernels per call, their summed ms and
the most expensive, i.e. which of the decoder's and Vocos's operations the codec's GPU time goes to.
`--codec-compile`: the graphs replay the networks through torch.compile (`Deployment.codec_compile`; compiled before
the timed calls), the eager rows stay the artifacts'.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import add_device_args, cuda_missing, int_list, profile_kernels, write_rows


def time_calls(voc, items, calls: int, graphs: bool) -> dict:
    run = voc.synthesize if graphs else voc.synthesize_eager
    for _ in range(3):  # warm-up (and the graphs' captures)
        run(items)
    walls, gpus = [], []
    cuda = voc.device.type == "cuda"
    for _ in range(calls):
        if cuda:
            torch.cuda.synchronize(voc.device)
            ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev[0].record()
        t0 = time.perf_counter()
        run(items)  # returns audio on the host: synchronised
        walls.append(time.perf_counter() - t0)
        if cuda:
            ev[1].record()
            ev[1].synchronize()
            gpus.append(ev[0].elapsed_time(ev[1]) / 1000)
    n = len(items)
    wall = statistics.median(walls)
    row = {"batch": n, "graphs": graphs, "wall_ms": 1000 * wall, "wall_ms_per_utt": 1000 * wall / n}
    if gpus:
        gpu = statistics.median(gpus)
        row.update(gpu_ms=1000 * gpu, gpu_ms_per_utt=1000 * gpu / n)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.codec_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,8,16,32,64")
    ap.add_argument("--frames", type=int, default=150, help="code frames per item")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per batch (median)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile N eager calls per batch: kernels per call, their ms, the most expensive")
    ap.add_argument("--codec-compile", action="store_true",
                    help="the graphs replay the networks through torch.compile (as --codec-compile serves them)")
    add_device_args(ap)
    a = ap.parse_args(argv)
    if cuda_missing(a):
        return 2
    batches = int_list(ap, a.batches, "--batches")
    if not batches or min(batches) < 1 or a.frames < 1 or a.calls < 1 or a.profile < 0:
        ap.error("--batches, --frames and --calls must be ≥ 1, --profile ≥ 0")
    from chattts_triton.config import VOCODER
    from chattts_triton.triton.backend import ModelContext, vocoder_service

    ctx = ModelContext.from_repo(a.repo, VOCODER, kind="GPU" if a.device == "cuda" else "CPU", device_id=a.gpu,
                                 vocoder_graphs=int(a.device == "cuda"), codec_compile=int(a.codec_compile))
    voc = vocoder_service(ctx)
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for b in batches:
            items = [(True, torch.randn(a.frames, voc.arch.gpt.hidden, generator=g)) for _ in range(b)]
            for graphs in ([False, True] if voc.graphs is not None else [False]):
                row = time_calls(voc, items, a.calls, graphs)
                rows.append(row)
                gpu = (f", GPU {row['gpu_ms']:.2f} ms ({row['gpu_ms_per_utt']:.3f} per utterance)"
                       if "gpu_ms" in row else "")
                print(f"[codec_load] batch {b} {'graphs' if graphs else 'eager '}: wall {row['wall_ms']:.2f} ms "
                      f"({row['wall_ms_per_utt']:.3f} per utterance){gpu}", flush=True)
            if a.profile:
                prof = profile_kernels(lambda items=items: voc.synthesize_eager(items), a.profile,
                                       voc.device.type == "cuda")
                rows[-1]["profile"] = prof
                print(f"[codec_load] batch {b} profile: {prof['kernels_per_step']} kernels, "
                      f"{prof['kernel_ms_per_step']:.3f} ms per call; most: "
                      + "; ".join(f"{k['name'][:60]} {k['ms_per_step']:.3f} ms" for k in prof["top"][:4]), flush=True)
    write_rows(a, rows, frames=a.frames, codec_compile=a.codec_compile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
