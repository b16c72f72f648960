"""Side-by-side benchmark: upstream `Chat.infer` vs the served pipeline, same weights, same GPU/CPU.

    python -m bench.run --assets build/assets-full --out bench/results [--device cuda] \
        [--tokens 150] [--upstream-batches 1,8,32,128] [--upstream-compile] \
        [--max-concurrency 512] [--dtype bf16] [--step-seconds 10]

Every utterance is forced to `--tokens` code frames (MIN_NEW_TOKENS = MAX_NEW_TOKENS), so work per
utterance is equal on both sides (150 frames ≈ 3.2 s of audio). Upstream runs in-process, as its
users call it (`skip_refine_text`, no splitting), one warm-up then the mean of `--repeats` calls per
batch size; ours runs end to end through tritonserver over gRPC with closed-loop clients
(`loadtest.sweep`). Writes <out>/<date>-<device>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

TEXT = "四川美食确实以辣闻名，但也有不辣的选择。"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} ({__import__('os').cpu_count()} cores)"


def bench_upstream(assets: Path, device: str, batches: List[int], tokens: int, repeats: int, compile: bool) -> List[dict]:
    import torch

    import ChatTTS

    chat = ChatTTS.Chat(logging.getLogger("upstream"))
    d = assets
    chat._load(
        vocos_ckpt_path=f"{d}/Vocos.safetensors", dvae_ckpt_path=f"{d}/DVAE.safetensors", gpt_ckpt_path=f"{d}/gpt",
        embed_path=f"{d}/Embed.safetensors", decoder_ckpt_path=f"{d}/Decoder.safetensors",
        tokenizer_path=f"{d}/tokenizer", device=torch.device(device), compile=compile,
    )
    torch.manual_seed(0)
    spk = chat.sample_random_speaker()
    params = chat.InferCodeParams(spk_emb=spk, min_new_token=tokens, max_new_token=tokens, show_tqdm=False)
    rows = []
    for b in batches:
        texts = [TEXT] * b

        def once():
            t = time.perf_counter()
            chat.infer(texts, skip_refine_text=True, split_text=False, do_text_normalization=False, params_infer_code=params)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            return time.perf_counter() - t

        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        once()  # warm-up (and compilation)
        lat = sum(once() for _ in range(repeats)) / repeats
        mem = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
        row = {"batch": b, "latency_s": lat, "throughput_utt_s": b / lat, "gpu_memory_mib": mem,
               "rtf": lat / (tokens * 512 / 24000)}
        log(f"upstream{' compile' if compile else ''} batch {b}: {lat:.3f} s, {b / lat:.1f} utt/s")
        rows.append(row)
    del chat
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def bench_served(repo: Path, tokens: int, max_concurrency: int, step_s: float, start: int = 1) -> List[dict]:
    import asyncio

    from chattts_triton.tritonserver import TritonServer
    from loadtest.sweep import SweepConfig, run_sweep

    with TritonServer(repo, log_file=repo.parent / "bench-tritonserver.log", startup_timeout_s=900) as server:
        cfg = SweepConfig(
            url=server.grpc_url, max_concurrency=max_concurrency, start_concurrency=start, step_seconds=step_s,
            warmup_seconds=min(3.0, step_s), window_seconds=min(3.0, step_s), max_settle_seconds=3 * step_s,
            metrics_url=server.metrics_url, max_new_tokens=tokens, min_new_tokens=tokens, seed=1, timeout_s=600,
        )
        return asyncio.run(run_sweep(cfg, log=log))


def to_markdown(res: dict) -> str:
    out = [f"# Benchmark {res['date']} on {res['device_name']}", "",
           f"{res['tokens']} forced code frames per utterance (≈ {res['tokens'] * 512 / 24000:.2f} s of audio). "
           f"Ours: tritonserver over gRPC, dtype {res['dtype']}, closed-loop clients. Upstream: `Chat.infer` in-process.", ""]
    for name in ("upstream_eager", "upstream_compile"):
        rows = res.get(name) or []
        if rows:
            out += [f"## {name.replace('_', ' ')}", "", "| batch | latency s | utterances/s | RTF | GPU MiB |", "|---|---|---|---|---|"]
            out += [f"| {r['batch']} | {r['latency_s']:.3f} | {r['throughput_utt_s']:.1f} | {r['rtf']:.3f} | "
                    f"{'' if r['gpu_memory_mib'] is None else round(r['gpu_memory_mib'])} |" for r in rows]
            out.append("")
    rows = res.get("served") or []
    if rows:
        out += ["## served (chattts-triton)", "", "| concurrency | p50 ms | p90 ms | p99 ms | utterances/s | RTF p50 | errors | GPU MiB |",
                "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            f = lambda k, s=".0f": "" if r.get(k) is None else format(r[k], s)  # noqa: E731
            out.append(f"| {r['concurrency']} | {f('latency_p50_ms')} | {f('latency_p90_ms')} | {f('latency_p99_ms')} | "
                       f"{f('throughput_utt_s', '.1f')} | {f('rtf_p50', '.3f')} | {r['error_rate']:.1%} | {f('gpu_memory_mib')} |")
    return "\n".join(out) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("upstream_eager", "s--"), ("upstream_compile", "^--")):
        rows = res.get(name) or []
        if rows:
            a1.plot([r["batch"] for r in rows], [r["latency_s"] * 1000 for r in rows], style, label=name.replace("_", " ") + " (batch)")
            a2.plot([r["batch"] for r in rows], [r["throughput_utt_s"] for r in rows], style, label=name.replace("_", " "))
    rows = [r for r in res.get("served") or [] if r.get("latency_p50_ms") is not None]
    if rows:
        c = [r["concurrency"] for r in rows]
        a1.plot(c, [r["latency_p50_ms"] for r in rows], "o-", label="ours p50")
        a1.plot(c, [r["latency_p99_ms"] for r in rows], "o:", label="ours p99")
        a2.plot(c, [r["throughput_utt_s"] for r in rows], "o-", label="ours")
    for ax, title in ((a1, "latency per utterance (ms)"), (a2, "utterances / s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (ours) / batch size (upstream)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"ChatTTS, {res['tokens']} frames/utterance, {res['device_name']} ({res['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--assets", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--upstream-batches", default="1,8,32,128")
    ap.add_argument("--upstream-compile-batches", default="", help="batches for upstream compile=True (empty: skip)")
    ap.add_argument("--skip-upstream", action="store_true")
    ap.add_argument("--max-concurrency", type=int, default=512)
    ap.add_argument("--start-concurrency", type=int, default=1)
    ap.add_argument("--step-seconds", type=float, default=10.0)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repo", type=Path, default=Path("build/bench-repo"))
    ap.add_argument("--name", default=None, help="result file stem (default: <date>-<device>)")
    a = ap.parse_args(argv)

    import torch

    dev = a.device if (a.device == "cpu" or torch.cuda.is_available()) else "cpu"
    res: Dict = {"date": dt.date.today().isoformat(), "device": dev, "device_name": device_name(dev), "tokens": a.tokens,
                 "dtype": a.dtype, "torch": torch.__version__, "command": " ".join(sys.argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.name or f"{res['date']}-{'h200' if 'H200' in res['device_name'] else dev}"
    path = a.out / f"{stem}.json"

    def save():
        path.write_text(json.dumps(res, indent=2))
        (a.out / f"{stem}.md").write_text(to_markdown(res))

    from export.__main__ import export_repository

    from chattts_triton.repo_config import Deployment

    dep = Deployment(gpus=[0] if dev.startswith("cuda") else [], gpt_slots=max(a.max_concurrency, 8),
                     gpt_context=512, max_batch_size=max(64, min(a.max_concurrency, 512)), max_queue_size=4096)
    log(f"exporting {a.assets} → {a.repo} ({a.dtype})")
    export_repository(a.assets, a.repo, ["torchscript"], a.dtype, "cpu", dep, progress=log)
    res["served"] = bench_served(a.repo, a.tokens, a.max_concurrency, a.step_seconds, a.start_concurrency)
    save()
    plot(res, a.out / f"{stem}.png")
    batches = [int(b) for b in a.upstream_batches.split(",") if b]
    if not a.skip_upstream:
        res["upstream_eager"] = bench_upstream(a.assets, dev, batches, a.tokens, a.repeats, compile=False)
        save()
        cb = [int(b) for b in a.upstream_compile_batches.split(",") if b]
        if cb:
            res["upstream_compile"] = bench_upstream(a.assets, dev, cb, a.tokens, a.repeats, compile=True)
            save()
    save()
    plot(res, a.out / f"{stem}.png")
    log(f"wrote {path}, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
