"""The served pipeline as users run it, and upstream `Chat.infer` beside it: same weights, same GPU/CPU.

    python -m bench.run --assets build/assets-full --out bench/results [--device cuda] \
        [--tokens 150 | --tokens 50-400 --skip-upstream] [--upstream-batches 1,8,32,128] \
        [--upstream-compile-batches ...] \
        [--max-concurrency 512] [--dtype auto] [--step-seconds 10] [--burst] [--perf-concurrency 1,512] \
        [--soak-seconds 600] [--gpu-memory-gb 15]

Ours: the repository `python -m export` writes with its defaults (the flags below change single settings
for a comparison; the headline is the default), served by `python -m chattts_triton.serve` — the container's
command — under a supervisor that counts the launcher's restarts, driven over gRPC by closed-loop clients
(`loadtest.sweep`), Triton's perf_analyzer (`--perf-concurrency`, bench/perf.py) and bursts from idle of twice
the GPT engine's slots (`--burst`). GPU memory at idle and per level (Triton's gauge; per process from
nvidia-smi and the models' allocator gauges). `--soak-seconds`: after the rest, cycles of idle, a burst and
a minute of closed-loop load until that long since the server was ready: restarts, errors and memory over
the whole span. Every utterance is forced to `--tokens` code frames (MIN_NEW_TOKENS = MAX_NEW_TOKENS), so
work per utterance is equal on both sides (150 frames ≈ 3.2 s of audio); `--tokens A-B` gives each request its
own length from a seeded generator (loadtest.lengths), as real traffic mixes lengths (ours only: upstream's
Chat.infer forces one length per batch). Upstream runs in-process, as its
users call it (`skip_refine_text`, no splitting), one warm-up then the mean of `--repeats` calls per batch
size. Writes <out>/<date>-<device>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path

from chattts_triton.config import FIRST_CHUNK_BUCKETS_MS, SAMPLE_RATE, first_chunk_bucket, samples_for_codes
from chattts_triton.triton.deployment import EXPORT, Deployment, add_flags, from_args
from chattts_triton.triton.deployment import default as field_default
from loadtest.lengths import Lengths, lengths_arg

TEXT = "四川美食确实以辣闻名，但也有不辣的选择。"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} ({__import__('os').cpu_count()} cores)"


def bench_upstream(assets: Path, device: str, batches: list[int], tokens: int, repeats: int,
                   compile: bool) -> list[dict]:
    import ChatTTS
    import torch

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

        def once(texts=texts):
            t = time.perf_counter()
            chat.infer(texts, skip_refine_text=True, split_text=False, do_text_normalization=False,
                       params_infer_code=params)
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
    chat = None  # the model's memory back before the caller's next run
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def _pct(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) * 1000 if values else None


# one asyncio client process adds tens of ms to a 64-stream first chunk's p99 that four do not (bench/clients.py)
STREAM_CLIENT_PROCS = 4
SERVED_DEFAULTS = {"gpus": [0]}  # the Deployment flags whose default here is not the field's: GPU 0 (CUDA only)

STREAM_COUNTERS = ("stream_first_chunks", "stream_first_tokens_seconds", "stream_first_chunk_seconds",
                   "stream_chunks", "stream_codec_calls", "stream_codec_seconds",
                   *(first_chunk_bucket(ms) for ms in FIRST_CHUNK_BUCKETS_MS))


def bucket_percentile(counts: dict[int, float], total: float, q: float) -> float | None:
    """The smallest bound (ms) within which at least q % of `total` events fell, from cumulative
    `counts` {bound ms: count}; inf past the last bound, None without events."""
    if total <= 0:
        return None
    for ms in sorted(counts):
        if counts[ms] >= total * q / 100.0:
            return float(ms)
    return float("inf")


def _finite(ms: float | None) -> float | None:
    return ms if ms is None or ms != float("inf") else None  # None also past the last bucket: see the counts


def stream_window(before: dict, after: dict) -> dict:
    """Server-side figures over a run of `chattts_stream`'s counters: where a first chunk's time goes
    (means), and the bounds within which half and 99 % of the first chunks were sent (a bucket's
    upper bound: the true percentile is at most that and above the bucket below)."""
    from loadtest.sweep import counter_deltas

    d = {k: 0.0 for k in STREAM_COUNTERS}
    d.update(counter_deltas(before, after))
    firsts, calls = d["stream_first_chunks"], d["stream_codec_calls"]
    buckets = {ms: d[first_chunk_bucket(ms)] for ms in FIRST_CHUNK_BUCKETS_MS}
    return {
        "server_first_tokens_ms": 1000 * d["stream_first_tokens_seconds"] / firsts if firsts else None,
        "server_first_chunk_ms": 1000 * d["stream_first_chunk_seconds"] / firsts if firsts else None,
        "server_first_chunks": firsts,
        "server_first_chunk_p50_within_ms": _finite(bucket_percentile(buckets, firsts, 50)),
        "server_first_chunk_p99_within_ms": _finite(bucket_percentile(buckets, firsts, 99)),
        "server_first_chunks_within_ms": {str(ms): n for ms, n in buckets.items()},  # of stream_first_chunks
        "codec_call_ms": 1000 * d["stream_codec_seconds"] / calls if calls else None,
        "chunks_per_codec_call": d["stream_chunks"] / calls if calls else None,
    }


async def stream_clients(url: str, tokens, concurrency: int, seconds: float, seed_base: int, sync) -> dict:
    """One process's closed-loop `chattts_stream` clients: a warm-up stream each, `sync()` (in a
    thread), then streams for `seconds`; the raw times (s) of first chunks, gaps and whole streams, and
    the audio samples of each whole stream. `tokens`: N or a Lengths (each client draws its own)."""
    import asyncio

    from client.client import AsyncChatTTSClient

    lengths = Lengths.of(tokens)
    first: list[float] = []
    gaps: list[float] = []
    total: list[float] = []
    samples: list[int] = []
    mismatched = 0  # whole streams whose audio is not the forced length's
    errors = 0
    messages: list[str] = []
    async with AsyncChatTTSClient(url, protocol="grpc", timeout_s=600, max_concurrency=concurrency) as client:
        async def one(seed: int, record: bool, frames: int) -> None:
            nonlocal errors, mismatched
            t0 = last = time.perf_counter()
            n = got = 0
            try:
                async for chunk in client.stream(TEXT, seed=seed, min_new_tokens=frames, max_new_tokens=frames):
                    now = time.perf_counter()
                    if record:
                        (gaps if n else first).append(now - last)
                    last, n, got = now, n + 1, got + int(chunk.size)
            except Exception as e:  # noqa: BLE001  counted, the run goes on
                errors += record
                if len(messages) < 3:
                    messages.append(f"{type(e).__name__}: {e}"[:300])
                    log(f"stream error: {messages[-1]}")
                return
            if record:
                total.append(time.perf_counter() - t0)
                samples.append(got)
                mismatched += got != samples_for_codes(frames)

        warm = lengths.draw(concurrency, "stream warm-up", seed_base)
        # warm-up: graphs of every batch size
        await asyncio.gather(*(one(seed_base + i, False, warm[i]) for i in range(concurrency)))
        await asyncio.to_thread(sync)
        started = time.monotonic()
        stop = started + seconds

        async def worker(i: int) -> None:
            k = 0
            draws = lengths.stream("stream", seed_base + i)
            while time.monotonic() < stop:
                await one(1000 * (seed_base + i) + k, True, next(draws))
                k += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.monotonic() - started  # streams started in the window, finished after it too
    return {"first": first, "gaps": gaps, "total": total, "samples": samples, "frames_mismatched": mismatched,
            "errors": errors, "messages": messages, "elapsed_s": elapsed}


def bench_stream(url: str, tokens, concurrency: int, seconds: float, metrics_url: str = "", procs: int = 1) -> dict:
    """Closed-loop `chattts_stream` clients, spread over `procs` client processes (bench.clients):
    time to first chunk, gaps between chunks, whole stream; with `metrics_url`, the server's own
    split of the first chunk's time (`stream_window`)."""
    from bench import clients
    from chattts_triton.config import STREAM
    from chattts_triton.triton.backend import STATS_PERIOD_S
    from loadtest.sweep import fetch_metrics, parse_counters

    def read_counters():
        time.sleep(2 * STATS_PERIOD_S)  # the gauges refresh this often: the last streams' counts land first
        counters.append(parse_counters(fetch_metrics(metrics_url), STREAM_COUNTERS, STREAM))

    counters: list[dict] = []
    split = clients.shares(concurrency, procs)
    bases = [sum(split[:i]) for i in range(len(split))]  # each process's first seed
    r = clients.run(stream_clients, [(url, tokens, n, seconds, b) for n, b in zip(split, bases, strict=True)],
                    read_counters)
    read_counters()
    first, gaps, total, errors, elapsed = r["first"], r["gaps"], r["total"], r["errors"], r["elapsed_s"]
    messages = r["messages"][:3]
    row = {"concurrency": concurrency, "client_processes": len(bases), "streams": len(total), "errors": errors,
           "streams_per_s": len(total) / elapsed, "audio_s_per_s": sum(r["samples"]) / SAMPLE_RATE / elapsed,
           "frames_mismatched": r["frames_mismatched"],
           "first_chunk_p50_ms": _pct(first, 50), "first_chunk_p99_ms": _pct(first, 99),
           "chunk_gap_p50_ms": _pct(gaps, 50), "chunk_gap_p99_ms": _pct(gaps, 99),
           "stream_p50_ms": _pct(total, 50), "stream_p99_ms": _pct(total, 99), "error_messages": messages}
    row.update(stream_window(counters[0], counters[1]))
    log(f"stream concurrency {concurrency}: first chunk p50 {row['first_chunk_p50_ms']} ms, "
        f"p99 {row['first_chunk_p99_ms']} ms, whole stream p50 {row['stream_p50_ms']} ms, {row['streams_per_s']:.1f} "
        f"streams/s, errors {errors}; server: "
        f"first tokens {row['server_first_tokens_ms']} ms, first chunk {row['server_first_chunk_ms']} ms (means), "
        "first chunk "
        f"p50 ≤ {row['server_first_chunk_p50_within_ms']} ms, p99 ≤ {row['server_first_chunk_p99_within_ms']} ms, "
        f"codec call {row['codec_call_ms']} ms for {row['chunks_per_codec_call']} chunks")
    return row


def allocator_rows(metrics_text: str) -> dict[str, dict]:
    """{model instance: MiB its process's allocator holds, and its peak} from the `chattts_gpu_memory_*` gauges."""
    from chattts_triton.config import STREAM
    from chattts_triton.triton.repo_config import MODELS
    from loadtest.sweep import parse_counters

    rows: dict[str, dict] = {}
    for model in MODELS + (STREAM,):
        for inst, c in parse_counters(metrics_text, ("gpu_memory_reserved_bytes", "gpu_memory_peak_reserved_bytes"),
                                      model).items():
            rows[inst or model] = {"allocator_mib": round(c.get("gpu_memory_reserved_bytes", 0) / 2**20),
                                   "allocator_peak_mib": round(c.get("gpu_memory_peak_reserved_bytes", 0) / 2**20)}
    return rows


def server_allocators_mib(metrics_text: str) -> int | None:
    """What the server's own processes' allocators hold together, MiB (None without the gauges): the server's
    memory whoever else uses the GPU, where Triton's nv_gpu_memory_used_bytes is the whole GPU's."""
    rows = allocator_rows(metrics_text)
    return sum(r["allocator_mib"] for r in rows.values()) if rows else None


def gpu_processes(server) -> dict[str, dict]:
    """GPU memory per model instance of the launched server, from what each process's allocator holds (its
    `chattts_gpu_memory_*` gauges; nvidia-smi's per-process list names host pids inside a container), and
    nvidia-smi's per-process figures (context included) as it lists them."""
    from loadtest.sweep import fetch_metrics

    rows = allocator_rows(fetch_metrics(server.metrics_url))
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        rows["nvidia-smi (pid: MiB)"] = {"processes": {pid.strip(): float(mib) for pid, mib in
                                                       (line.split(",") for line in out.splitlines()
                                                        if line.count(",") == 1)}}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    return rows


def server_smi_mib(server, procs: dict[str, dict]) -> dict[str, float]:
    """{pid: MiB} of nvidia-smi's figures (CUDA contexts included) for the server's own processes
    (tritonserver and its stubs) in `procs` (gpu_processes): what a card must hold for this server alone."""
    from chattts_triton.launcher.tritonserver import python_stubs

    ours = {str(server.server_pid), *(str(pid) for pid in python_stubs(server.server_pid))}
    smi = procs.get("nvidia-smi (pid: MiB)", {}).get("processes", {})
    return {pid: mib for pid, mib in smi.items() if pid in ours}


def memory_snapshot(server, label: str) -> dict:
    from loadtest.sweep import fetch_gpu_memory

    total = fetch_gpu_memory(server.metrics_url)
    procs = gpu_processes(server)
    ours = server_smi_mib(server, procs)
    snap = {"when": label, "gpu_memory_mib": None if total is None else round(total / 2**20), "processes": procs,
            "server_smi_mib": round(sum(ours.values())) if ours else None}
    log(f"GPU memory {label}: {snap['gpu_memory_mib']} MiB (the GPU), {snap['server_smi_mib']} MiB (the server's "
        f"processes, nvidia-smi); allocators (MiB, peak): "
        + ", ".join(f"{k} {v['allocator_mib']} ({v['allocator_peak_mib']})" for k, v in sorted(procs.items())
                    if "allocator_mib" in v)
        + f"; nvidia-smi per process: {procs.get('nvidia-smi (pid: MiB)', {}).get('processes')}")
    return snap


def engine_slots(metrics_url: str) -> int:
    """The GPT engines' slots together, as they sized themselves (their `chattts_engine_slots` gauges)."""
    from chattts_triton.config import GPT
    from loadtest.sweep import fetch_metrics, parse_counters

    time.sleep(2 * 0.25)  # a gauge refresh
    return int(sum(c["engine_slots"] for c in parse_counters(fetch_metrics(metrics_url), ("engine_slots",),
                                                             GPT).values()))


def engine_counters(metrics_url: str) -> dict:
    from loadtest.sweep import fetch_metrics, parse_engine_counters

    return parse_engine_counters(fetch_metrics(metrics_url))


def burst_gaps(before: dict, after: dict, seconds: float) -> dict:
    """The running rows' cadence through a burst (`engine_window`): the mean step gap and the worst one so far,
    which on a fresh server is the burst's own."""
    from loadtest.sweep import engine_window

    w = engine_window(before, after, seconds)
    row = {k: w[k] for k in ("engine_step_gap_ms", "engine_step_gap_max_ms", "gc_pause_max_ms")}
    if _burst_gaps_text(row):
        log(f"burst: {_burst_gaps_text(row)}")
    return row


def _burst_gaps_text(row: dict) -> str:
    if row.get("engine_step_gap_ms") is None or row.get("engine_step_gap_max_ms") is None:
        return ""
    gc_text = "" if row.get("gc_pause_max_ms") is None else \
        f" (the GPT process's longest garbage collection since start-up {row['gc_pause_max_ms']:.1f} ms)"
    return (f"the running rows' step gap {row['engine_step_gap_ms']:.2f} ms on average, the worst "
            f"{row['engine_step_gap_max_ms']:.1f} ms{gc_text}")


def burst(url: str, n: int, tokens, seed0: int = 0) -> dict:
    """n requests sent at once from idle, as a load tool's clients start together, without retries: how many
    were served, every refusal's message, latency percentiles; `tokens`: N or a Lengths (drawn per request),
    and how many answers were not of the forced length."""
    import asyncio

    import numpy as np
    import tritonclient.grpc.aio as aioclient
    from tritonclient.utils import InferenceServerException

    frames = Lengths.of(tokens).draw(n, "burst", seed0)

    def inputs(seed: int, frames: int):
        out = []
        for name, arr, wire in (("TEXT", np.array([[TEXT.encode()]], object), "BYTES"),
                                ("SEED", np.array([[seed]], np.int64), "INT64"),
                                ("MAX_NEW_TOKENS", np.array([[frames]], np.int32), "INT32"),
                                ("MIN_NEW_TOKENS", np.array([[frames]], np.int32), "INT32")):
            out.append(aioclient.InferInput(name, list(arr.shape), wire))
            out[-1].set_data_from_numpy(arr)
        return out

    async def run():
        client = aioclient.InferenceServerClient(url)

        async def one(i):
            t0 = time.monotonic()
            try:
                r = await client.infer("chattts", inputs(seed0 + i, frames[i]), client_timeout=600)
                return None, time.monotonic() - t0, r.as_numpy("AUDIO").size
            except InferenceServerException as e:
                return f"{e.status()}: {e.message()}"[:200], time.monotonic() - t0, 0

        try:
            t0 = time.monotonic()
            got = await asyncio.gather(*(one(i) for i in range(n)))
            return got, time.monotonic() - t0
        finally:
            await client.close()

    got, wall = asyncio.run(run())
    ok = [t for e, t, _ in got if e is None]
    errors: dict[str, int] = {}
    for e, _, _ in got:
        if e is not None:
            errors[e] = errors.get(e, 0) + 1
    served = [(f, size) for f, (e, _, size) in zip(frames, got, strict=True) if e is None]
    row = {"requests": n, "served": len(ok), "refused": n - len(ok), "errors": errors, "wall_s": round(wall, 2),
           "latency_p50_ms": _pct(ok, 50), "latency_p99_ms": _pct(ok, 99),
           "audio_s": round(sum(size for _, size in served) / SAMPLE_RATE, 2),
           "frames_mismatched": sum(size != samples_for_codes(f) for f, size in served)}
    log(f"burst of {n} from idle: {len(ok)} served in {wall:.1f} s (p50 {row['latency_p50_ms']} ms, p99 "
        f"{row['latency_p99_ms']} ms), {n - len(ok)} refused {errors or ''}")
    return row


def soak_cycles(server, tokens: int, concurrency: int, burst_n: int, until: float, hold_s: float = 60.0,
                idle_s: float = 10.0) -> dict:
    """Until monotonic time `until`: idle, a burst of burst_n from idle, `hold_s` of closed-loop load; memory
    sampled through each hold. Memory growth is measured over the second half of the cycles' samples."""
    import asyncio

    cycles: list[dict] = []
    while time.monotonic() + idle_s + hold_s / 2 < until:
        time.sleep(idle_s)
        b = burst(server.grpc_url, burst_n, tokens, seed0=10_000 * (len(cycles) + 1))
        h = asyncio.run(hold(server.grpc_url, server.metrics_url, tokens, concurrency,
                             max(1.0, min(hold_s, until - time.monotonic()))))
        cycles.append({"burst": b, "hold": h, "restarts_so_far": server.restarts})
    samples = list(enumerate(s for c in cycles for s in c["hold"]["samples"]))  # in order: index as time
    return {"cycles": cycles, "bursts": len(cycles), "burst_requests": len(cycles) * burst_n,
            "burst_refused": sum(c["burst"]["refused"] for c in cycles),
            "hold_utterances": sum(c["hold"]["utterances"] for c in cycles),
            "hold_errors": sum(c["hold"]["errors"] for c in cycles),
            **memory_span(samples, len(samples) // 2)}


async def hold(url: str, metrics_url: str, tokens, concurrency: int, seconds: float, every_s: float = 10.0) -> dict:
    """Constant load for `seconds`: GPU memory sampled every `every_s` (Triton's gauge for the GPU, and what the
    server's own allocators hold), utterances/s and audio seconds/s; `tokens`: N or a Lengths (each worker draws
    its own)."""
    import asyncio

    from client.client import AsyncChatTTSClient
    from loadtest.sweep import fetch_metrics, parse_gpu_memory_bytes

    lengths = Lengths.of(tokens)
    done = errors = audio = 0
    samples: list[dict] = []
    late: list[float] = []  # latencies (s) of the utterances finished in the second half: steady state
    t_start = time.monotonic()
    stop = t_start + seconds
    messages: dict[str, int] = {}
    async with AsyncChatTTSClient(url, protocol="grpc", timeout_s=600, max_concurrency=concurrency,
                                  retries=0) as client:
        async def worker(i: int) -> None:
            nonlocal done, errors, audio
            k = 0
            draws = lengths.stream("hold", i)
            while time.monotonic() < stop:
                t0 = time.monotonic()
                frames = next(draws)
                try:
                    got = await client.synthesize(TEXT, seed=7919 * i + k, min_new_tokens=frames, max_new_tokens=frames)
                    done += 1
                    audio += int(got.size)
                    if time.monotonic() - t_start >= seconds / 2:
                        late.append(time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001  counted (no retries: every refusal shows)
                    errors += 1
                    key = f"{type(e).__name__}: {e}"[:200]
                    messages[key] = messages.get(key, 0) + 1
                k += 1

        async def sampler() -> None:
            while time.monotonic() < stop:
                text = await asyncio.to_thread(fetch_metrics, metrics_url)
                mem = parse_gpu_memory_bytes(text)
                samples.append({"t_s": round(time.monotonic() - t_start, 1),
                                "gpu_memory_mib": None if mem is None else mem / 2**20,
                                "server_allocators_mib": server_allocators_mib(text), "utterances": done})
                log(f"hold: t={samples[-1]['t_s']} s, GPU {samples[-1]['gpu_memory_mib']} MiB, the server's allocators "
                    f"{samples[-1]['server_allocators_mib']} MiB, {done} utterances, {errors} errors")
                await asyncio.sleep(max(0.0, min(every_s, stop - time.monotonic())))

        await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
    return {"concurrency": concurrency, "seconds": seconds, "utterances": done, "errors": errors,
            "error_messages": messages,
            "throughput_utt_s": done / seconds, "audio_s_per_s": audio / SAMPLE_RATE / seconds, "samples": samples,
            "latency_p50_ms_second_half": _pct(late, 50), "latency_p99_ms_second_half": _pct(late, 99),
            **memory_span([(s["t_s"], s) for s in samples], seconds / 2)}


MEMORY_SERIES = {"gpu_memory": "gpu_memory_mib", "server_allocators": "server_allocators_mib"}


def memory_span(samples: list[tuple], half_from: float) -> dict[str, float | None]:
    """Of (t_s, sample) pairs: each memory series' min, max and growth over the samples from `half_from` on
    (`gpu_memory`: Triton's gauge, the whole GPU; `server_allocators`: the server's own processes)."""
    out: dict[str, float | None] = {}
    for name, key in MEMORY_SERIES.items():
        values = [(t, s[key]) for t, s in samples if s.get(key) is not None]
        half = [v for t, v in values if t >= half_from]
        out[f"{name}_min_mib"] = min((v for _, v in values), default=None)
        out[f"{name}_max_mib"] = max((v for _, v in values), default=None)
        out[f"{name}_growth_second_half_mib"] = (max(half) - min(half)) if half else None
    return out


def bench_served(repo: Path, tokens, max_concurrency: int, step_s: float, start: int = 1,
                 stream_concurrency: list[int] = (), stream_s: float = 15.0, hold_concurrency: int = 0,
                 hold_s: float = 0.0, mps: bool = False, stream_procs: int = STREAM_CLIENT_PROCS,
                 burst_from_idle: bool = False, perf_levels: list[int] = (), soak_s: float = 0.0,
                 out_dir: Path | None = None, save=lambda out: None, perf_stability: int = 25) -> dict[str, object]:
    """Everything against one server started by the launcher, in order; `save(out)` after each phase.
    `tokens`: N frames for every request, or a Lengths (each request its own, drawn per stream of requests)."""
    import asyncio

    from chattts_triton.launcher.serve import Launched
    from loadtest.sweep import SweepConfig, run_sweep

    tokens = Lengths.of(tokens)
    out: dict[str, object] = {}
    args = ["--mps"] if mps else []
    # beside the run's results: a stall or a failed load is traced from the server's own lines
    server_log = (out_dir or repo.parent) / f"{repo.name}-tritonserver.log"
    server = Launched(repo, server_log, args=args, ready_timeout_s=900)
    t_start = time.monotonic()
    server.start()
    ready = time.monotonic()
    out["launcher"] = {"command": f"python -m chattts_triton.serve --repo {repo} " + " ".join(args),
                       "ready_s": round(ready - t_start, 1), "server_log": server_log.name}
    log(f"launcher ready in {ready - t_start:.0f} s: tritonserver pid {server.server_pid}, {server.grpc_url}")

    def launcher_state() -> dict:
        return {**out["launcher"], "restarts": server.restarts, "exits": [code for _, code in server.exits],
                "alive": server.alive, "seconds_served": round(time.monotonic() - ready, 1)}

    try:
        time.sleep(5.0)
        out["memory"] = [memory_snapshot(server, "idle")]
        slots = engine_slots(server.metrics_url)
        out["gpt_slots"] = slots
        log(f"GPT engines: {slots} slots together")
        if burst_from_idle:
            before = engine_counters(server.metrics_url)
            out["burst"] = burst(server.grpc_url, 2 * slots, tokens)
            time.sleep(5.0)  # the counters as of the burst's end are published by then
            out["burst"].update(burst_gaps(before, engine_counters(server.metrics_url), out["burst"]["wall_s"]))
            save(out)
        if max_concurrency:
            forced = ({"max_new_tokens": tokens.low, "min_new_tokens": tokens.low} if tokens.fixed
                      else {"lengths": tokens})
            cfg = SweepConfig(
                url=server.grpc_url, max_concurrency=max_concurrency, start_concurrency=start, step_seconds=step_s,
                warmup_seconds=min(3.0, step_s), window_seconds=min(3.0, step_s), max_settle_seconds=3 * step_s,
                metrics_url=server.metrics_url, seed=1, timeout_s=600, **forced,
            )
            out["served"] = asyncio.run(run_sweep(cfg, log=log))
            out["memory"].append(memory_snapshot(server, f"after the sweep to {max_concurrency}"))
            save(out)
        if perf_levels:
            from bench import perf

            out["perf_analyzer"] = perf.run(server.grpc_url, list(perf_levels), tokens,
                                            (out_dir or repo.parent) / "perf",
                                            log=log, stability=perf_stability, keep_going=True)
            save(out)
        out["stream"] = [bench_stream(server.grpc_url, tokens, c, stream_s, server.metrics_url, stream_procs)
                         for c in stream_concurrency]
        if hold_s > 0:
            out["hold"] = asyncio.run(hold(server.grpc_url, server.metrics_url, tokens, hold_concurrency, hold_s))
            out["memory"].append(memory_snapshot(server, f"after {hold_s:.0f} s at {hold_concurrency}"))
        save(out)
        if soak_s > 0:
            log(f"soak: cycles of idle, a burst of {2 * slots} and a minute at {hold_concurrency or max_concurrency} "
                f"until {soak_s:.0f} s after ready")
            out["soak"] = soak_cycles(server, tokens, hold_concurrency or max_concurrency, 2 * slots, ready + soak_s)
            out["memory"].append(memory_snapshot(server, "after the soak"))
    finally:
        out["launcher"] = launcher_state()
        code = server.stop()
        out["launcher"]["exit_status_on_sigterm"] = code
        log(f"launcher: {server.restarts} restarts, exit status {code} on SIGTERM after "
            f"{out['launcher']['seconds_served']} s served")
        if code != 0:  # why: the launcher's own last lines and the server log's, kept with the run's results
            try:
                server_tail = server.log_file.read_text(errors="replace").splitlines()[-40:]
            except OSError as e:
                server_tail = [f"(no server log: {e})"]
            out["launcher"]["log_tail"] = {"launcher": server.output[-20:], "tritonserver": server_tail}
            log("launcher's last lines:\n  " + "\n  ".join(server.output[-20:])
                + "\ntritonserver's last lines:\n  " + "\n  ".join(server_tail))
    return out


def _gaps(row: dict) -> str:
    if row.get("engine_step_gap_ms") is None:
        return ""
    worst = row.get("engine_step_gap_max_ms")
    return f"{row['engine_step_gap_ms']:.2f}" + ("" if worst is None else f" ({worst:.1f})")


def _prefills(row: dict) -> str:
    if row.get("engine_prefill_ms") is None:
        return ""
    return f"{row['engine_prefill_ms']:.2f} ({row['engine_prefill_prompts']:.1f})"


def _switch_interval(us: int | None) -> str:
    if us is None:  # results from before the setting
        return ""
    return f", GIL switch interval {us} µs" if us else ", Python's GIL switch interval (5 ms)"


def _queue_delay(us) -> str:
    """The vocoder's batching delay, when a run set one other than the default."""
    return "" if us is None or us == Deployment.max_queue_delay_us else f", vocoder batching delay {us} µs"


def _vocoder_graphs(on) -> str:
    """Both ways, since the graphs became the default (2026-12-02); nothing for results from before the setting."""
    return "" if on is None else (", vocoder from CUDA graphs" if on else ", eager vocoder")


def _served_path(res: dict) -> list[str]:
    """How the server ran (the launcher), its memory, the bursts, perf_analyzer and the soak."""
    out: list[str] = []
    la = res.get("launcher")
    if la:
        out += [f"Served by `{la['command'].strip()}` (the container's command; ready {la['ready_s']} s after start), "
                f"{res.get('gpt_slots', '?')} GPT slots as the engine sized itself"
                f"{f', GPU memory planned for {g:g} GiB' if (g := res.get('gpu_memory_gb')) else ''}"
                + (f"; **{la['restarts']} launcher restarts** in {la['seconds_served']} s served, exit status "
                   f"{la.get('exit_status_on_sigterm')} on SIGTERM." if "restarts" in la else " (running)."), ""]
    mem = res.get("memory") or []
    if mem:
        names = sorted({n for m in mem for n, v in m["processes"].items() if "allocator_mib" in v})
        out += ["## GPU memory", "", "| when | GPU MiB (Triton) | " + " | ".join(names) + " |",
                "|---|---|" + "---|" * len(names)]
        for m in mem:
            cells = [f"{p['allocator_mib']} ({p['allocator_peak_mib']})" if (p := m["processes"].get(n)) else ""
                     for n in names]
            out.append(f"| {m['when']} | {m['gpu_memory_mib']} | " + " | ".join(cells) + " |")
        out += ["", "Per model instance: MiB its process's allocator holds (peak so far); the GPU total is Triton's "
                    "gauge "
                "(every process, CUDA contexts included).", ""]
    b = res.get("burst")
    if b:
        out += [f"Burst of {b['requests']} requests from idle (twice the GPT slots): **{b['served']} served, "
                f"{b['refused']} refused** in {b['wall_s']} s, latency p50 {_ms(b['latency_p50_ms'])} ms, p99 "
                f"{_ms(b['latency_p99_ms'])} ms"
                + (f", {b['audio_s']} s of audio" if b.get("audio_s") is not None else "")
                + (f"; {_burst_gaps_text(b)}" if _burst_gaps_text(b) else "")
                + (f"; **{b['frames_mismatched']} answers not of the forced length**"
                   if b.get("frames_mismatched") else "")
                + (f"; refusals: {b['errors']}" if b["errors"] else "") + ".", ""]
    rows = res.get("perf_analyzer") or []
    if rows:
        out += ["## perf_analyzer (Triton's load tool, gRPC)", "",
                "| concurrency | utterances/s | audio s/s | p50 ms | p90 ms | p99 ms |", "|---|---|---|---|---|---|"]
        from bench.perf import failed_row

        out += [failed_row(r) if "error" in r else
                f"| {r['concurrency']} | {r['throughput_utt_s']:.1f} | {_f1(r.get('audio_s_per_s'))} | "
                f"{_ms(r['latency_p50_ms'])} | "
                f"{_ms(r['latency_p90_ms'])} | {_ms(r['latency_p99_ms'])} |" for r in rows]
        out += ["",
                "perf_analyzer sends its input file's entries in turn (bench/perf.py: one per length); audio s/s is "
                "utterances/s × the entries' mean audio.", ""]
    sk = res.get("soak")
    if sk:
        out += [f"## Soak through the launcher: {sk['bursts']} cycles of idle, a burst from idle and a minute of "
                "closed-loop load", "",
                f"Bursts: {sk['burst_requests']} requests, {sk['burst_refused']} refused; closed loop: "
                f"{sk['hold_utterances']} "
                f"utterances, {sk['hold_errors']} errors; GPU memory {_mib_span(sk, 'gpu_memory')} (Triton's gauge, "
                "the whole GPU); "
                f"the server's own allocators {_mib_span(sk, 'server_allocators')}.", ""]
    return out


def _mib_span(r: dict, name: str) -> str:
    """`min–max MiB, growth over the second half G MiB` of a memory series (memory_span)."""
    lo, hi, growth = (r.get(f"{name}_{k}_mib") for k in ("min", "max", "growth_second_half"))
    if lo is None:
        return "not reported"
    return f"{lo:.0f}–{hi:.0f} MiB, growth over the second half {growth:.0f} MiB"


def _ms(v) -> str:
    return "" if v is None else f"{v:.0f}"


def _f1(v) -> str:
    return "" if v is None else f"{v:.1f}"


def result_lengths(res: dict) -> Lengths:
    """The lengths a result file's requests forced: `tokens` N or "A-B", and its seed."""
    return Lengths.parse(res["tokens"], seed=res.get("tokens_seed", 0))


def _vocoder(r: dict) -> str:
    """A served row's vocoder cells from Triton's statistics: "batch | queue ms | ms per call | busy", busy the calls'
    time over the window, summed over instances (empty where not recorded)."""
    v = (r.get("triton") or {}).get("chattts_vocoder")
    if not v:
        return " |  |  | "
    call_ms = v["compute_input_ms"] + v["compute_infer_ms"] + v["compute_output_ms"]
    busy = f"{v['execution_count'] * call_ms / (1000 * r['duration_s']):.0%}" if r.get("duration_s") else ""
    return f"{v['avg_batch']:.1f} | {v['queue_ms']:.0f} | {call_ms:.1f} | {busy}"


def to_markdown(res: dict) -> str:
    lengths = result_lengths(res).describe()
    out = [f"# Benchmark {res['date']} on {res['device_name']}", "",
           f"{lengths[:1].upper()}{lengths[1:]}. "
           f"Ours: tritonserver over gRPC, dtype {res['dtype']}, "
           f"{'compiled GPT step (requested)' if res.get('gpt_compile') else 'TorchScript GPT step'}"
           f"{' and prefills' if res.get('gpt_compile') and res.get('gpt_compile_prefill') else ''}"
           f"{_vocoder_graphs(res.get('vocoder_graphs'))}"
           f"{', the codec networks through torch.compile' if res.get('codec_compile') else ''}"
           f"{_queue_delay(res.get('max_queue_delay_us'))}"
           f"{', under an MPS daemon' if res.get('mps') else ''}"
           f"{_switch_interval(res.get('gil_switch_interval_us'))}"
           f", closed-loop clients. Upstream: `Chat.infer` in-process.", ""]
    if res.get("note"):
        out += [f"Note: {res['note']}", ""]
    wrong = sum(r.get("frames_mismatched") or 0 for r in [*(res.get("served") or []), *(res.get("stream") or []),
                                                           res.get("burst") or {}])
    if wrong:
        out += [f"**{wrong} answers were not of the length their request forced**: the work was not what was asked.",
                ""]
    out += _served_path(res)
    for name in ("upstream_eager", "upstream_compile"):
        rows = res.get(name) or []
        if rows:
            out += [f"## {name.replace('_', ' ')}", "", "| batch | latency s | utterances/s | RTF | GPU MiB |",
                    "|---|---|---|---|---|"]
            out += [f"| {r['batch']} | {r['latency_s']:.3f} | {r['throughput_utt_s']:.1f} | {r['rtf']:.3f} | "
                    f"{'' if r['gpu_memory_mib'] is None else round(r['gpu_memory_mib'])} |" for r in rows]
            out.append("")
    rows = res.get("stream") or []
    if rows:
        sched = (f"lookahead {res.get('stream_lookahead_frames', 'exact')}, first chunk's lookahead "
                 f"{res.get('stream_first_lookahead_frames', 'as later chunks')}, fade "
                 f"{res.get('stream_fade_frames', 0)} frames"
                 f"{'; codec on its own CUDA stream' if res.get('stream_codec_stream') else ''}"
                 f"{'; first chunks in a codec call of their own' if res.get('stream_first_chunks_first') else ''}"
                 f"{'; engine on a CUDA stream of the highest priority' if res.get('stream_engine_priority') else ''}"
                 f"{f'; clients spread over up to {p} processes' if (p := res.get('stream_procs', 1)) > 1 else ''}")
        out += ["## streaming (`chattts_stream`, gRPC)", "", f"Schedule: {sched}.", "",
                "| concurrency | first chunk p50 ms | first chunk p99 ms | "
                "chunk gap p50 ms | chunk gap p99 ms | whole stream p50 ms | streams | streams/s | audio s/s | errors "
                "| server: first tokens ms "
                "| server: first chunk ms | server: first chunk p50 / p99 within ms | codec call ms | chunks per codec "
                "call |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:

            def f(k, s=".0f", r=r):
                return "" if r.get(k) is None else format(r[k], s)

            out.append(f"| {r['concurrency']} | {f('first_chunk_p50_ms')} | {f('first_chunk_p99_ms')} | "
                       f"{f('chunk_gap_p50_ms')} | {f('chunk_gap_p99_ms')} | {f('stream_p50_ms')} | {r['streams']} | "
                       f"{f('streams_per_s', '.1f')} | "
                       f"{f('audio_s_per_s', '.1f')} | {r['errors']} | "
                       f"{f('server_first_tokens_ms')} | {f('server_first_chunk_ms')} | "
                       f"{f('server_first_chunk_p50_within_ms')} / {f('server_first_chunk_p99_within_ms')} | "
                       f"{f('codec_call_ms', '.1f')} | "
                       f"{f('chunks_per_codec_call', '.1f')} |")
        out.append("")
    h = res.get("hold")
    if h:
        out += [f"## {h['seconds']:.0f} s at concurrency {h['concurrency']}", "",
                f"{h['throughput_utt_s']:.1f} utterances/s"
                + (f" ({h['audio_s_per_s']:.1f} s of audio/s)" if h.get("audio_s_per_s") is not None else "")
                + f", {h['errors']} errors"
                + (f"; over the second half latency p50 {h['latency_p50_ms_second_half']:.0f} ms, p99 "
                   f"{h['latency_p99_ms_second_half']:.0f} ms"
                   if h.get("latency_p99_ms_second_half") is not None else "")
                + f"; GPU memory {_mib_span(h, 'gpu_memory')} (Triton's gauge, the whole GPU); the server's own "
                  "allocators "
                f"{_mib_span(h, 'server_allocators')}.", ""]
    rows = res.get("served") or []
    if rows:
        out += ["## served (chattts-triton)", "", "| concurrency | p50 ms | p90 ms | p99 ms | utterances/s | audio s/s "
                                                  "| RTF p50 "
                "| errors | GPU MiB "
                "| GPT step ms | of it device ms | GPU clock ms | graph ms | prefill ms/step | ms per prefill "
                "(prompts) | GIL wait ms | step gap ms (worst so far) | GPT batch | GPT busy | vocoder batch "
                "| vocoder queue ms | vocoder ms per call | vocoder busy |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:

            def f(k, s=".0f", r=r):
                return "" if r.get(k) is None else format(r[k], s)

            out.append(f"| {r['concurrency']} | {f('latency_p50_ms')} | {f('latency_p90_ms')} | "
                       f"{f('latency_p99_ms')} | "
                       f"{f('throughput_utt_s', '.1f')} | {f('audio_s_per_s', '.1f')} | {f('rtf_p50', '.3f')} | "
                       f"{r['error_rate']:.1%} | {f('gpu_memory_mib')} | "
                       f"{f('engine_step_ms', '.2f')} | {f('engine_step_device_ms', '.2f')} | "
                       f"{f('engine_step_gpu_ms', '.2f')} | "
                       f"{f('engine_step_graph_ms', '.2f')} | {f('engine_prefill_ms_per_step', '.2f')} | "
                       f"{_prefills(r)} | {f('engine_gil_wait_ms', '.3f')} | {_gaps(r)} | "
                       f"{f('engine_batch', '.1f')} | {f('engine_busy', '.0%')} | {_vocoder(r)} |")
        out += ["", "audio s/s: seconds of audio served per second (compares runs of different mean lengths); "
                "GPT step ms: mean wall time of one decode step of the GPT engines (host work included); of it device "
                "ms: "
                "from the step's launch to its host sync (the GPU's part as the host waits for it, the rest is host "
                "bookkeeping); GPU clock ms: the step's span on the GPU's own clock (CUDA events, one step in 8): "
                "far below device ms means the host came back late (launch, GIL), near it a slow GPU (kernels, other "
                "processes' time slices) or a host late around the launch (its events are recorded from Python); graph "
                "ms: "
                "the same steps on events the step's CUDA graph records itself (the replay alone; with the engine's "
                "overlap only the steps whose next step replayed another graph); prefill ms/step: "
                "prefill wall time per decode step; ms per prefill (prompts): one batched prefill's wall time and the "
                "prompts it "
                "admitted; GIL wait ms: how long the engine thread took to get the GIL back after letting it go in a "
                "time.sleep(0) (one step in 64; ≈ 0.07 ms with "
                "no wait, Linux's timer slack); step gap ms (worst so far): the running rows' mean time from one "
                "decode step's end to the next's (the GPU's clock), and the longest since the server's warm-up "
                "(prefills, resumes and other processes between two steps lengthen it); GPT batch: "
                "mean rows per step, GPT busy: share of the window the engine loops were stepping or prefilling; "
                "vocoder batch, queue ms: chattts_vocoder's mean batch and its requests' mean wait in Triton's queue "
                "(Triton's statistics over the window): a queue near a whole utterance's time, with batches at "
                "max_batch_size, means the codec, not the GPT, bounds the rate; vocoder ms per call, busy: one call's "
                "input, compute and output time, and the calls' share of the window (over 100 % with several "
                "instances at once): near 100 % with one instance, the vocoder has no time left."]
    return "\n".join(out) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("upstream_eager", "s--"), ("upstream_compile", "^--")):
        rows = res.get(name) or []
        if rows:
            a1.plot([r["batch"] for r in rows], [r["latency_s"] * 1000 for r in rows], style,
                    label=name.replace("_", " ") + " (batch)")
            a2.plot([r["batch"] for r in rows], [r["throughput_utt_s"] for r in rows], style,
                    label=name.replace("_", " "))
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
    fig.suptitle(f"ChatTTS, {result_lengths(res)} frames/utterance, {res['device_name']} ({res['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--assets", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=lengths_arg, default=Lengths(150, 150),
                    help="code frames each utterance forces (MIN = MAX): N, or A-B for each its own drawn uniformly")
    ap.add_argument("--tokens-seed", type=int, default=0, help="seed of the lengths drawn from --tokens A-B")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--upstream-batches", default="1,8,32,128")
    ap.add_argument("--upstream-compile-batches", default="", help="batches for upstream compile=True (empty: skip)")
    ap.add_argument("--skip-upstream", action="store_true")
    ap.add_argument("--max-concurrency", type=int, default=512)
    ap.add_argument("--start-concurrency", type=int, default=1)
    ap.add_argument("--step-seconds", type=float, default=10.0)
    ap.add_argument("--repo", type=Path, default=Path("build/bench-repo"))
    ap.add_argument("--name", default=None, help="result file stem (default: <date>-<device>)")
    ap.add_argument("--append", action="store_true", help="add to the result file of the same name (runs split over "
                                                          "calls)")
    ap.add_argument("--stream-concurrency", default="1,64", help="closed-loop stream clients per run (empty: skip)")
    ap.add_argument("--stream-seconds", type=float, default=15.0)
    ap.add_argument("--stream-procs", type=int, default=STREAM_CLIENT_PROCS,
                    help="client processes the streams are spread over (1: one asyncio process, as before 2026-12-02)")
    ap.add_argument("--hold-seconds", type=float, default=0.0,
                    help="then this long at --hold-concurrency (GPU memory over time)")
    ap.add_argument("--hold-concurrency", type=int, default=512)
    ap.add_argument("--burst", action="store_true", help="a burst from idle of twice the GPT engines' slots, before "
                                                         "the sweep")
    ap.add_argument("--perf-concurrency", default="", help="Triton's perf_analyzer at these levels after the sweep "
                                                           "(bench/perf.py)")
    ap.add_argument("--soak-seconds", type=float, default=0.0,
                    help="then cycles of idle, a burst from idle and a minute at --hold-concurrency until this long "
                         "after ready")
    ap.add_argument("--mps", action="store_true",
                    help="serve under a CUDA MPS daemon (chattts_triton.launcher.mps): the model processes share the "
                         "GPU")
    # the served repository's settings: each flag a Deployment field's, its default the field's (what
    # `python -m export` writes), but the GPUs: GPU 0 where the device is CUDA
    add_flags(ap, EXPORT, defaults=SERVED_DEFAULTS,
              title="the served repository's settings (chattts_triton/triton/deployment.py; --dtype is the export's)")
    a = ap.parse_args(argv)
    a.tokens = Lengths(a.tokens.low, a.tokens.high, a.tokens_seed)
    if not a.tokens.fixed and not a.skip_upstream and (a.upstream_batches.strip(",")
                                                       or a.upstream_compile_batches.strip(",")):
        ap.error("--tokens A-B needs --skip-upstream: upstream's Chat.infer forces one length per batch, not per "
                 "utterance")
    if a.stream_procs < 1:
        ap.error("--stream-procs must be at least 1")
    if any(not c.strip().isdigit() or int(c) < 1 for c in a.stream_concurrency.split(",") if c):
        ap.error("--stream-concurrency must be whole numbers of at least 1, comma-separated (empty: no streams)")

    import torch

    dev = a.device if (a.device == "cpu" or torch.cuda.is_available()) else "cpu"
    res: dict = {"date": dt.date.today().isoformat(), "device": dev, "device_name": device_name(dev),
                 "tokens": a.tokens.low if a.tokens.fixed else str(a.tokens), "tokens_seed": a.tokens.seed,
                 "lengths": a.tokens.to_json(), "dtype": a.dtype, "torch": torch.__version__,
                 "command": " ".join(sys.argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.name or f"{res['date']}-{'h200' if 'H200' in res['device_name'] else dev}"
    path = a.out / f"{stem}.json"
    if a.append and path.is_file():
        res = {**json.loads(path.read_text()), **{k: v for k, v in res.items() if k != "command"}}
        res["command"] = res.get("command", "") + " ; " + " ".join(sys.argv)

    def save():
        path.write_text(json.dumps(res, indent=2))
        (a.out / f"{stem}.md").write_text(to_markdown(res))

    from export.__main__ import FORMATS, export_repository

    gpus = a.gpus if dev.startswith("cuda") else []
    streams = [int(c) for c in a.stream_concurrency.split(",") if c]
    # the repository `python -m export` writes, its defaults as they are; the flags change single settings
    dep = from_args(a, gpus=gpus)
    # the served pipeline's settings; an --append call that serves nothing keeps those of the rows it appends to
    settings = {"gpus": gpus, "stream_lookahead_frames": dep.stream_lookahead_frames or "exact",
                "stream_first_lookahead_frames": dep.stream_first_lookahead_frames or "as later chunks",
                "stream_fade_frames": dep.stream_fade_frames, "gpt_compile": dep.gpt_compile,
                "gpt_compile_prefill": dep.gpt_compile_prefill, "vocoder_graphs": dep.vocoder_graphs,
                "stream_codec_stream": dep.stream_codec_stream,
                "stream_first_chunks_first": dep.stream_first_chunks_first,
                "stream_procs": a.stream_procs, "mps": a.mps,
                "gpt_admit": {"batch": dep.gpt_admit_batch, "wait_steps": dep.gpt_admit_wait_steps},
                "max_queue_delay_us": dep.max_queue_delay_us, "gil_switch_interval_us": dep.gil_switch_interval_us,
                "gpu_memory_gb": dep.gpu_memory_gb}
    # the settings no field above records, where they are not the defaults
    settings.update({f.name: getattr(dep, f.name) for f in dataclasses.fields(Deployment)
                     if f.name not in settings and f.name not in ("dtype", "gpus")
                     and getattr(dep, f.name) != field_default(f)})
    serves = bool(a.max_concurrency or streams or a.hold_seconds or a.burst or a.soak_seconds)
    if serves or not any(res.get(k) for k in ("served", "stream", "hold")):
        res.update(settings)
    if serves:
        log(f"exporting {a.assets} → {a.repo} (dtype {a.dtype})")
        formats = sorted({"torchscript", dep.artifact_format}, key=FORMATS.index)
        export_repository(a.assets, a.repo, formats, a.dtype, "cpu", dep, progress=log)
        res["dtype"] = json.loads((a.repo / "manifest.json").read_text())["dtype"]  # what auto resolved to

        def save_served(out):
            res.update({k: v for k, v in out.items() if v})
            save()

        perf_levels = [int(c) for c in a.perf_concurrency.split(",") if c.strip()]
        served = bench_served(a.repo, a.tokens, a.max_concurrency, a.step_seconds, a.start_concurrency, streams,
                              a.stream_seconds, a.hold_concurrency, a.hold_seconds, mps=a.mps,
                              stream_procs=a.stream_procs,
                              burst_from_idle=a.burst, perf_levels=perf_levels, soak_s=a.soak_seconds,
                              out_dir=a.out, save=save_served)
        save_served(served)
    plot(res, a.out / f"{stem}.png")
    batches = [int(b) for b in a.upstream_batches.split(",") if b]
    if not a.skip_upstream:
        if batches:  # an --append run without eager batches keeps the eager rows it appends to
            res["upstream_eager"] = bench_upstream(a.assets, dev, batches, a.tokens.low, a.repeats, compile=False)
            save()
        cb = [int(b) for b in a.upstream_compile_batches.split(",") if b]
        if cb:
            res["upstream_compile"] = bench_upstream(a.assets, dev, cb, a.tokens.low, a.repeats, compile=True)
            save()
    save()
    plot(res, a.out / f"{stem}.png")
    log(f"wrote {path}, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
