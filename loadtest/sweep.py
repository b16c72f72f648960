"""Concurrency sweep: latency, throughput and batching at 1, 2, 4, ... requests in flight.

    python -m loadtest.sweep --url localhost:8001 --max-concurrency 64 --step-seconds 20 --out DIR

Each step runs `concurrency` closed-loop workers (asyncio, one request in flight each, no think time).
It is measured only once it is stable: after --warmup-seconds, successive windows are compared until
two in a row complete utterances at rates within --tolerance of each other (at most
--max-settle-seconds, else the step is marked unstable). Then for --step-seconds it records every
request that completes, and diffs Triton's own per-model statistics (queue and compute time,
inference vs execution counts = how much the server batched) and, when the metrics endpoint has it,
GPU memory. Writes DIR/sweep.md, sweep.csv, sweep.json and sweep.png.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import re
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chattts_triton.config import GPT, samples_for_codes
from client.client import DEFAULT_URLS, PROTOCOLS, AsyncChatTTSClient
from client.contract import MODEL, SAMPLE_RATE
from client.errors import ChatTTSError
from loadtest.corpus import load_corpus
from loadtest.lengths import Lengths, lengths_arg
from loadtest.tts_stats import percentile, real_time_factor

ERROR_PAUSE_S = 0.05  # a failing worker pauses briefly instead of spinning on an unreachable server
GPU_MEMORY_METRIC = "nv_gpu_memory_used_bytes"
# cumulative gauges of each GPT engine instance (chattts_triton.triton.backend.STAT_HELP)
ENGINE_COUNTERS = ("engine_steps", "engine_step_rows", "engine_step_seconds", "engine_step_device_seconds",
                   "engine_step_gpu_seconds", "engine_step_gpu_samples", "engine_prefill_seconds",
                   "engine_gil_wait_seconds", "engine_gil_wait_samples", "engine_step_graph_seconds",
                   "engine_step_graph_samples", "engine_prefills", "engine_prefill_rows", "engine_step_gaps",
                   "engine_step_gap_seconds", "engine_step_gap_max_seconds", "gc_pause_max_seconds")
ENGINE_MODEL = GPT
_COUNTER_LINE = re.compile(r"chattts_(\w+)\{([^}]*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
DEFAULT_METRICS_PORT = 8002


# --- pure helpers (unit-tested) ----------------------------------------------------------------
def concurrency_levels(max_concurrency: int, start: int = 1) -> list[int]:
    """start, 2*start, 4*start, ... and max_concurrency itself if it is not a power of two."""
    if start < 1 or max_concurrency < start:
        raise ValueError(f"need 1 <= start <= max_concurrency, got {start}, {max_concurrency}")
    levels, c = [], start
    while c < max_concurrency:
        levels.append(c)
        c *= 2
    return levels + [max_concurrency]


def rates_agree(a: float, b: float, tolerance: float) -> bool:
    """Both windows completed work and their rates differ by at most `tolerance` (relative)."""
    return a > 0 and b > 0 and abs(a - b) <= tolerance * max(a, b)


@dataclass
class Completion:
    start: float
    end: float
    status: str | None  # None = success
    samples: int = 0
    frames: int | None = None  # the code frames the request forced (MIN = MAX), where it forced them

    @property
    def latency_s(self) -> float:
        return self.end - self.start


def completions_between(completions: Sequence[Completion], t0: float, t1: float) -> list[Completion]:
    return [c for c in completions if t0 <= c.end < t1]


def summarize_window(completions: Sequence[Completion], duration_s: float, sample_rate: int = SAMPLE_RATE) -> dict:
    ok = [c for c in completions if c.status is None]
    failed = [c for c in completions if c.status is not None]
    by_status: dict[str, int] = {}
    for c in failed:
        by_status[c.status] = by_status.get(c.status, 0) + 1
    latencies_ms = [c.latency_s * 1000.0 for c in ok]
    rtfs = [r for r in (real_time_factor(c.latency_s, c.samples, sample_rate) for c in ok) if r is not None]
    audio_s = sum(c.samples for c in ok) / sample_rate
    total = len(ok) + len(failed)
    forced = [c for c in ok if c.frames is not None]
    return {
        "requests": total,
        "errors": len(failed),
        "error_rate": len(failed) / total if total else 0.0,
        "errors_by_status": by_status,
        "latency_p50_ms": percentile(latencies_ms, 50),
        "latency_p90_ms": percentile(latencies_ms, 90),
        "latency_p99_ms": percentile(latencies_ms, 99),
        "throughput_utt_s": len(ok) / duration_s,
        "audio_s_per_s": audio_s / duration_s,
        "rtf_p50": percentile(rtfs, 50),
        "rtf_p90": percentile(rtfs, 90),
        # what the requests forced, and how many answers were not that long (the work was not what was asked)
        "frames_mean": sum(c.frames for c in forced) / len(forced) if forced else None,
        "frames_mismatched": sum(c.samples != samples_for_codes(c.frames) for c in forced) if forced else None,
    }


def _duration_stat(stats: dict, key: str) -> tuple:
    entry = stats.get(key) or {}
    return int(entry.get("count", 0)), int(entry.get("ns", 0))


def _model_totals(statistics: dict) -> dict[str, dict]:
    """Triton statistics JSON -> per model name (versions summed) counters we diff."""
    totals: dict[str, dict] = {}
    for m in statistics.get("model_stats", []):
        t = totals.setdefault(m["name"], {"inference_count": 0, "execution_count": 0, "batch_sizes": {}})
        t["inference_count"] += int(m.get("inference_count", 0))
        t["execution_count"] += int(m.get("execution_count", 0))
        inference_stats = m.get("inference_stats") or {}
        for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
            count, ns = _duration_stat(inference_stats, key)
            t[f"{key}_count"] = t.get(f"{key}_count", 0) + count
            t[f"{key}_ns"] = t.get(f"{key}_ns", 0) + ns
        for b in m.get("batch_stats") or []:
            size = int(b["batch_size"])
            t["batch_sizes"][size] = t["batch_sizes"].get(size, 0) + _duration_stat(b, "compute_infer")[0]
    return totals


def diff_model_statistics(before: dict, after: dict) -> dict[str, dict]:
    """Per model, what happened between two `get_inference_statistics` snapshots (idle models left out).

    avg_batch = requests / executions; queue_ms and compute_ms are per request averages (Triton charges
    each request of a batch the batch's whole compute time)."""
    b, a = _model_totals(before), _model_totals(after)
    out: dict[str, dict] = {}
    for name, now in sorted(a.items()):
        then = b.get(name, {})

        def d(key: str, now: dict = now, then: dict = then) -> int:
            return now.get(key, 0) - then.get(key, 0)

        inferences, executions = d("inference_count"), d("execution_count")
        if inferences == 0 and d("fail_count") == 0:
            continue
        sizes = {
            s: n - then.get("batch_sizes", {}).get(s, 0)
            for s, n in sorted(now["batch_sizes"].items())
            if n - then.get("batch_sizes", {}).get(s, 0) > 0
        }

        def avg_ms(key: str) -> float | None:
            count = d(f"{key}_count")
            return d(f"{key}_ns") / count / 1e6 if count else None

        out[name] = {
            "inference_count": inferences,
            "execution_count": executions,
            "avg_batch": inferences / executions if executions else None,
            "success_count": d("success_count"),
            "fail_count": d("fail_count"),
            "queue_ms": avg_ms("queue"),
            "compute_input_ms": avg_ms("compute_input"),
            "compute_infer_ms": avg_ms("compute_infer"),
            "compute_output_ms": avg_ms("compute_output"),
            "batch_sizes": sizes,
        }
    return out


def parse_gpu_memory_bytes(metrics_text: str) -> float | None:
    """Sum of nv_gpu_memory_used_bytes over GPUs in Prometheus text, None if the metric is absent."""
    values = []
    for line in metrics_text.splitlines():
        if line.startswith(GPU_MEMORY_METRIC + "{") or line.startswith(GPU_MEMORY_METRIC + " "):
            try:
                values.append(float(line.rsplit(None, 1)[-1]))
            except ValueError:
                continue
    return sum(values) if values else None


def parse_counters(metrics_text: str, names: Sequence[str], model: str) -> dict[str, dict[str, float]]:
    """{instance: {name: value}} of a model's `chattts_<name>` gauges in Prometheus text."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        m = _COUNTER_LINE.match(line)
        if not m or m.group(1) not in names:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        if labels.get("model") == model:
            out.setdefault(labels.get("instance", ""), {})[m.group(1)] = float(m.group(3))
    return out


def parse_engine_counters(metrics_text: str, model: str = ENGINE_MODEL) -> dict[str, dict[str, float]]:
    """{instance: {counter: value}} of the engines' cumulative counters (backend.STAT_HELP)."""
    return parse_counters(metrics_text, ENGINE_COUNTERS, model)


def counter_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each counter's increase, summed over the instances."""
    names = {k for c in after.values() for k in c}
    return {k: sum(after[i].get(k, 0.0) - before.get(i, {}).get(k, 0.0) for i in after) for k in names}


def engine_window(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], seconds: float) -> dict:
    """Over a window: mean wall ms of a decode step, mean rows per step, and the share of the
    window the engines were busy (stepping or prefilling; 1.0 = the GPT loop never waited)."""
    if not after or seconds <= 0:
        return {"engine_step_ms": None, "engine_step_device_ms": None, "engine_step_gpu_ms": None,
                "engine_prefill_ms_per_step": None,
                "engine_step_graph_ms": None, "engine_gil_wait_ms": None, "engine_prefill_ms": None,
                "engine_prefill_prompts": None, "engine_batch": None, "engine_busy": None, "engine_step_gap_ms": None,
                "engine_step_gap_max_ms": None, "gc_pause_max_ms": None}
    d = {k: 0.0 for k in ENGINE_COUNTERS}
    d.update(counter_deltas(before, after))
    steps = d["engine_steps"]
    return {
        "engine_step_ms": 1000.0 * d["engine_step_seconds"] / steps if steps else None,
        # servers from before this counter do not publish it: n/a, not 0
        "engine_step_device_ms": 1000.0 * d["engine_step_device_seconds"] / steps
        if steps and all("engine_step_device_seconds" in c for c in after.values()) else None,
        # CUDA only, sampled steps: the GPU's own span of a step (device ms minus this: the host came back late)
        "engine_step_gpu_ms": 1000.0 * d["engine_step_gpu_seconds"] / d["engine_step_gpu_samples"]
        if d["engine_step_gpu_samples"] else None,
        # the same sampled steps where a graph ran them, on events inside the graph: its replay alone
        # (GPU clock minus this: the host between the first event and the launch)
        "engine_step_graph_ms": 1000.0 * d["engine_step_graph_seconds"] / d["engine_step_graph_samples"]
        if d["engine_step_graph_samples"] else None,
        "engine_prefill_ms_per_step": 1000.0 * d["engine_prefill_seconds"] / steps if steps else None,
        # per prefill: its wall ms and the prompts it admitted (few large prefills or many small ones)
        "engine_prefill_ms": 1000.0 * d["engine_prefill_seconds"] / d["engine_prefills"] if d["engine_prefills"]
        else None,
        "engine_prefill_prompts": d["engine_prefill_rows"] / d["engine_prefills"] if d["engine_prefills"] else None,
        # the engine thread's time to get the GIL back after a time.sleep(0) (sampled steps; ≈ 0.07 ms with no wait)
        "engine_gil_wait_ms": 1000.0 * d["engine_gil_wait_seconds"] / d["engine_gil_wait_samples"]
        if d["engine_gil_wait_samples"] else None,
        "engine_batch": d["engine_step_rows"] / steps if steps else None,
        # the running rows' cadence: mean time from one step's end to the next's in the window, and the longest
        # so far (a cumulative maximum, since the warm-up: a burst on a fresh server is its worst)
        "engine_step_gap_ms": 1000.0 * d["engine_step_gap_seconds"] / d["engine_step_gaps"]
        if d["engine_step_gaps"] else None,
        "engine_step_gap_max_ms": 1000.0 * max(c["engine_step_gap_max_seconds"] for c in after.values())
        if all("engine_step_gap_max_seconds" in c for c in after.values()) else None,
        # the GPT processes' longest garbage collection since start-up (a stall between two steps; servers from
        # before this gauge: n/a)
        "gc_pause_max_ms": 1000.0 * max(c["gc_pause_max_seconds"] for c in after.values())
        if all("gc_pause_max_seconds" in c for c in after.values()) else None,
        "engine_busy": (d["engine_step_seconds"] + d["engine_prefill_seconds"]) / (seconds * len(after)),
    }


def default_metrics_url(url: str) -> str:
    host = url.rsplit(":", 1)[0] if ":" in url else url
    return f"{host}:{DEFAULT_METRICS_PORT}"


# --- running -----------------------------------------------------------------------------------
@dataclass
class SweepConfig:
    url: str
    protocol: str = "grpc"
    model: str = MODEL
    max_concurrency: int = 64
    start_concurrency: int = 1
    step_seconds: float = 20.0
    warmup_seconds: float = 5.0
    window_seconds: float = 5.0
    tolerance: float = 0.2
    max_settle_seconds: float = 60.0
    max_error_rate: float = 0.5
    timeout_s: float = 300.0
    metrics_url: str | None = None  # HOST:PORT of Triton's metrics endpoint; "" disables
    corpus: str | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    seed: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    # each request forces its own length, drawn per worker (loadtest.lengths); replaces max/min_new_tokens
    lengths: Lengths | None = None

    def request_options(self) -> dict[str, Any]:
        opts = {"max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens, "seed": self.seed}
        return {**{k: v for k, v in opts.items() if v is not None}, **self.options}

    def forced_frames(self) -> int | None:
        """The one length every request forces (MIN = MAX) without `lengths`, else None."""
        if self.lengths is None and self.max_new_tokens is not None and self.max_new_tokens == self.min_new_tokens:
            return self.max_new_tokens
        return None


def metrics_endpoint(metrics_url: str) -> str:
    """HOST:PORT or a full URL -> the URL of the Prometheus text."""
    if "://" not in metrics_url:
        metrics_url = f"http://{metrics_url}"
    return metrics_url if metrics_url.rstrip("/").endswith("/metrics") else metrics_url.rstrip("/") + "/metrics"


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is not behind http_proxy


def fetch_metrics(metrics_url: str | None) -> str:
    """Triton's Prometheus text, or "" where it is disabled or unreachable."""
    if not metrics_url:
        return ""
    try:
        with _NO_PROXY.open(metrics_endpoint(metrics_url), timeout=2.0) as r:
            return r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""


def fetch_gpu_memory(metrics_url: str | None) -> float | None:
    return parse_gpu_memory_bytes(fetch_metrics(metrics_url))


async def _statistics(client: AsyncChatTTSClient, log) -> dict | None:
    """Triton's statistics, or None (with a warning) where that API is unavailable or restricted."""
    try:
        return await client.inference_statistics()
    except ChatTTSError as e:
        log(f"  warning: no Triton statistics ({e})")
        return None


class _Step:
    def __init__(self, client: AsyncChatTTSClient, texts: list[str], options: dict, concurrency: int, seed: int,
                 lengths: Lengths | None = None, frames: int | None = None):
        self.client, self.texts, self.options = client, texts, options
        self.lengths, self.frames = lengths, frames
        self.completions: list[Completion] = []
        self.stopping = False
        rng = random.Random(seed)
        self.orders = [rng.sample(range(len(texts)), len(texts)) for _ in range(concurrency)]
        self.tasks = [asyncio.ensure_future(self._worker(i, concurrency)) for i in range(concurrency)]

    async def _worker(self, index: int, concurrency: int) -> None:
        order, n = self.orders[index], 0
        draws = self.lengths.stream("sweep", concurrency, index) if self.lengths else None
        while not self.stopping:
            text = self.texts[order[n % len(order)]]
            n += 1
            options, frames = self.options, self.frames
            if draws is not None:
                frames = next(draws)
                options = {**options, "max_new_tokens": frames, "min_new_tokens": frames}
            start = time.monotonic()
            try:
                audio = await self.client.infer_one(text, options)
                self.completions.append(Completion(start, time.monotonic(), None, int(audio.size), frames))
            except ChatTTSError as e:
                self.completions.append(Completion(start, time.monotonic(), e.status, frames=frames))
                await asyncio.sleep(ERROR_PAUSE_S)

    def median_latency(self) -> float:
        done = [c.latency_s for c in self.completions]
        return percentile(done, 50) or 0.0

    async def stop(self, drain_s: float) -> None:
        """Let in-flight requests finish (so the next step starts clean), then cancel stragglers."""
        self.stopping = True
        _, pending = await asyncio.wait(self.tasks, timeout=drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _settle(step: _Step, cfg: SweepConfig, log) -> tuple:
    """Warm up, then wait for two successive windows with agreeing rates. (stable, settle seconds)."""
    t0 = time.monotonic()
    await asyncio.sleep(cfg.warmup_seconds)
    previous = None
    while True:
        # a window must be long enough to see several completions of slow requests
        window = max(cfg.window_seconds, 2.0 * step.median_latency())
        w0 = time.monotonic()
        await asyncio.sleep(window)
        rate = len(completions_between(step.completions, w0, time.monotonic())) / window
        if previous is not None and rates_agree(previous, rate, cfg.tolerance):
            return True, time.monotonic() - t0
        if time.monotonic() - t0 >= cfg.max_settle_seconds:
            log(f"  not stable after {time.monotonic() - t0:.0f} s (last windows {previous} vs {rate:.3f} utt/s)")
            return False, time.monotonic() - t0
        previous = rate


async def run_step(client: AsyncChatTTSClient, cfg: SweepConfig, concurrency: int, texts: list[str], log) -> dict:
    step = _Step(client, texts, cfg.request_options(), concurrency, seed=(cfg.seed or 0) + concurrency,
                 lengths=cfg.lengths, frames=cfg.forced_frames())
    try:
        stable, settle_s = await _settle(step, cfg, log)
        before = await _statistics(client, log)
        metrics = [fetch_metrics(cfg.metrics_url)]
        t0 = time.monotonic()
        await asyncio.sleep(cfg.step_seconds)
        t1 = time.monotonic()
        metrics.append(fetch_metrics(cfg.metrics_url))
        after = await _statistics(client, log)
    finally:
        await step.stop(drain_s=cfg.timeout_s)
    row = {"concurrency": concurrency, "stable": stable, "settle_s": settle_s, "duration_s": t1 - t0}
    row.update(summarize_window(completions_between(step.completions, t0, t1), t1 - t0))
    known = [g for g in map(parse_gpu_memory_bytes, metrics) if g is not None]
    row["gpu_memory_mib"] = max(known) / 2**20 if known else None
    row.update(engine_window(*map(parse_engine_counters, metrics), t1 - t0))
    row["triton"] = diff_model_statistics(before, after) if before and after else {}
    return row


async def run_sweep(cfg: SweepConfig, log=print) -> list[dict]:
    texts = load_corpus(cfg.corpus)
    levels = concurrency_levels(cfg.max_concurrency, cfg.start_concurrency)
    rows: list[dict] = []
    async with AsyncChatTTSClient(
        cfg.url, protocol=cfg.protocol, model=cfg.model, timeout_s=cfg.timeout_s, retries=0,
        max_concurrency=cfg.max_concurrency,
    ) as client:  # fmt: skip
        await client.wait_until_ready(timeout_s=30.0)
        for c in levels:
            log(f"concurrency {c}: settling ...")
            row = await run_step(client, cfg, c, texts, log)
            rows.append(row)
            log(
                f"concurrency {c}: p50 {_f(row['latency_p50_ms'], '.0f')} ms  p90 {_f(row['latency_p90_ms'], '.0f')} "
                f"ms  {row['throughput_utt_s']:.2f} utt/s  RTF p50 {_f(row['rtf_p50'])}  errors {row['error_rate']:.1%}"
                + (f"  GPT step {_f(row['engine_step_ms'], '.2f')} ms (device "
                   f"{_f(row.get('engine_step_device_ms'), '.2f')}"
                   + (f", GPU clock {row['engine_step_gpu_ms']:.2f}"
                      if row.get("engine_step_gpu_ms") is not None else "")
                   + (f", graph {row['engine_step_graph_ms']:.2f}"
                      if row.get("engine_step_graph_ms") is not None else "")
                   + ", "
                   f"prefill/step {_f(row.get('engine_prefill_ms_per_step'), '.2f')}"
                   + (f", {row['engine_prefill_ms']:.2f} ms per prefill of {row['engine_prefill_prompts']:.1f}"
                      if row.get("engine_prefill_ms") is not None else "")
                   + (f", GIL wait {row['engine_gil_wait_ms']:.3f}"
                      if row.get("engine_gil_wait_ms") is not None else "")
                   + (f", step gap {row['engine_step_gap_ms']:.2f}, worst so far {row['engine_step_gap_max_ms']:.1f}"
                      if row.get("engine_step_gap_ms") is not None and row.get("engine_step_gap_max_ms") is not None
                      else "")
                   + (f", GC pause worst so far {row['gc_pause_max_ms']:.1f}"
                      if row.get("gc_pause_max_ms") is not None else "")
                   + f") batch {_f(row['engine_batch'], '.1f')} "
                   f"busy {_f(row['engine_busy'], '.0%')}" if row.get("engine_step_ms") is not None else "")
                + ("" if row["stable"] else "  (unstable)")
                + (f"  {row['frames_mismatched']} answers not of the forced length"
                   if row.get("frames_mismatched") else "")
            )
            if row["error_rate"] > cfg.max_error_rate:
                log(f"stopping: error rate {row['error_rate']:.1%} > {cfg.max_error_rate:.0%}")
                break
    return rows


# --- reporting ---------------------------------------------------------------------------------
def _f(value, spec: str = ".3f") -> str:
    return "" if value is None else format(value, spec)


MAIN_COLUMNS = [
    ("concurrency", "concurrency", "d"),
    ("latency_p50_ms", "p50 ms", ".0f"),
    ("latency_p90_ms", "p90 ms", ".0f"),
    ("latency_p99_ms", "p99 ms", ".0f"),
    ("throughput_utt_s", "utt/s", ".2f"),
    ("audio_s_per_s", "audio s/s", ".2f"),
    ("frames_mean", "frames (mean)", ".0f"),
    ("rtf_p50", "RTF p50", ".3f"),
    ("rtf_p90", "RTF p90", ".3f"),
    ("requests", "requests", "d"),
    ("error_rate", "errors", ".1%"),
    ("gpu_memory_mib", "GPU MiB", ".0f"),
    ("engine_step_ms", "GPT step ms", ".2f"),
    ("engine_step_device_ms", "of it device ms", ".2f"),
    ("engine_step_gpu_ms", "GPU clock ms", ".2f"),
    ("engine_step_graph_ms", "graph ms", ".2f"),
    ("engine_prefill_ms_per_step", "prefill ms/step", ".2f"),
    ("engine_prefill_ms", "ms per prefill", ".2f"),
    ("engine_prefill_prompts", "prompts per prefill", ".1f"),
    ("engine_gil_wait_ms", "GIL wait ms", ".3f"),
    ("engine_step_gap_ms", "step gap ms", ".2f"),
    ("engine_step_gap_max_ms", "worst gap so far ms", ".1f"),
    ("engine_batch", "GPT batch", ".1f"),
    ("engine_busy", "GPT busy", ".0%"),
    ("stable", "stable", ""),
]
TRITON_COLUMNS = [
    ("inference_count", "requests", "d"),
    ("execution_count", "executions", "d"),
    ("avg_batch", "avg batch", ".2f"),
    ("queue_ms", "queue ms", ".1f"),
    ("compute_infer_ms", "compute ms", ".1f"),
]


def to_markdown(rows: Sequence[dict], cfg: SweepConfig) -> str:
    lines = [
        f"# Concurrency sweep: model `{cfg.model}` over {cfg.protocol} at {cfg.url}",
        "",
        f"Closed-loop workers; each step measured for {cfg.step_seconds:g} s once stable "
        f"(warm-up {cfg.warmup_seconds:g} s, windows within {cfg.tolerance:.0%}). "
        "RTF = request wall time / audio seconds." + (f" Lengths: {cfg.lengths.describe()}." if cfg.lengths else ""),
        "",
        "| " + " | ".join(h for _, h, _ in MAIN_COLUMNS) + " |",
        "|" + "---:|" * len(MAIN_COLUMNS),
    ]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k), spec) for k, _, spec in MAIN_COLUMNS) + " |")
    lines += ["", "## Triton statistics per model (diffed over each measured step)", ""]
    header = ["concurrency", "model"] + [h for _, h, _ in TRITON_COLUMNS] + ["batch sizes (size×executions)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for r in rows:
        for name, s in r["triton"].items():
            sizes = " ".join(f"{size}×{n}" for size, n in s["batch_sizes"].items())
            cells = [str(r["concurrency"]), name] + [_cell(s.get(k), spec) for k, _, spec in TRITON_COLUMNS]
            lines.append("| " + " | ".join(cells + [sizes]) + " |")
    return "\n".join(lines) + "\n"


def _cell(value, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, spec) if spec else str(value)


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    models = sorted({name for r in rows for name in r["triton"]})
    fields = [k for k, _, _ in MAIN_COLUMNS] + ["errors", "frames_mismatched", "duration_s", "settle_s"]
    fields += [f"{m}.{k}" for m in models for k, _, _ in TRITON_COLUMNS]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            flat = {k: r.get(k) for k in fields if k in r}
            for m in models:
                for k, _, _ in TRITON_COLUMNS:
                    flat[f"{m}.{k}"] = r["triton"].get(m, {}).get(k)
            w.writerow(flat)


def plot(path: Path, rows: Sequence[dict], cfg: SweepConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
        ys = [r[f"latency_p{q}_ms"] for r in rows]
        ax1.plot(xs, [float("nan") if y is None else y for y in ys], style, label=f"p{q}")
    ax1.set_ylabel("latency (ms)")
    ax1.set_title(f"{cfg.model} over {cfg.protocol}: latency and throughput vs concurrency")
    ax1.legend()
    ax1.grid(True, alpha=0.3)
    ax2.plot(xs, [r["throughput_utt_s"] for r in rows], "o-", color="tab:green", label="utterances/s")
    ax2.set_ylabel("utterances / s")
    ax2.set_xlabel("concurrency (requests in flight)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(xs, [str(x) for x in xs])
    ax2.grid(True, alpha=0.3)
    ax3 = ax2.twinx()
    ax3.plot(xs, [r["audio_s_per_s"] for r in rows], "d--", color="tab:purple", label="audio s / s")
    ax3.set_ylabel("audio seconds / s")
    handles = ax2.get_legend_handles_labels()[0] + ax3.get_legend_handles_labels()[0]
    ax2.legend(handles, [h.get_label() for h in handles], loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, rows: Sequence[dict], cfg: SweepConfig) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"sweep.{k}" for k in ("md", "csv", "json", "png")}
    paths["md"].write_text(to_markdown(rows, cfg), encoding="utf-8")
    write_csv(paths["csv"], rows)
    paths["json"].write_text(json.dumps({"config": asdict(cfg), "steps": list(rows)}, indent=2, default=str) + "\n")
    plot(paths["png"], rows, cfg)
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--url",
                   help=f"HOST:PORT (default {DEFAULT_URLS['grpc']} for grpc, {DEFAULT_URLS['http']} for http)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--start-concurrency", type=int, default=1)
    p.add_argument("--step-seconds", type=float, default=20.0, help="measured time per step")
    p.add_argument("--warmup-seconds", type=float, default=5.0)
    p.add_argument("--window-seconds", type=float, default=5.0, help="stability window (at least 2 median latencies)")
    p.add_argument("--tolerance", type=float, default=0.2, help="relative rate difference counted as stable")
    p.add_argument("--max-settle-seconds", type=float, default=60.0)
    p.add_argument("--max-error-rate", type=float, default=0.5, help="stop the sweep above this error rate")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--metrics-url", help="Triton metrics, HOST:PORT or URL (default: url host, port "
                                         f"{DEFAULT_METRICS_PORT}); '' disables")
    p.add_argument("--corpus", help="utterances, one per line (default loadtest/corpus.txt)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--min-new-tokens", type=int)
    p.add_argument("--tokens", type=lengths_arg, help="force N frames (MIN = MAX), or each request its own drawn from "
                                                      "A-B "
                   "(instead of --max/--min-new-tokens)")
    p.add_argument("--tokens-seed", type=int, default=0, help="seed of the lengths drawn from --tokens A-B")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", default="build/sweep")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.step_seconds <= 0 or a.window_seconds <= 0 or a.warmup_seconds < 0 or not 0 < a.tolerance < 1:
        p.error("--step-seconds and --window-seconds must be > 0, --warmup-seconds >= 0, 0 < --tolerance < 1")
    if a.tokens is not None and (a.max_new_tokens is not None or a.min_new_tokens is not None):
        p.error("--tokens forces MIN = MAX itself: leave out --max-new-tokens and --min-new-tokens")
    url = a.url or DEFAULT_URLS[a.protocol]
    try:
        levels = concurrency_levels(a.max_concurrency, a.start_concurrency)
    except ValueError as e:
        p.error(str(e))
    cfg = SweepConfig(
        url=url, protocol=a.protocol, model=a.model, max_concurrency=a.max_concurrency,
        start_concurrency=a.start_concurrency, step_seconds=a.step_seconds, warmup_seconds=a.warmup_seconds,
        window_seconds=a.window_seconds, tolerance=a.tolerance, max_settle_seconds=a.max_settle_seconds,
        max_error_rate=a.max_error_rate, timeout_s=a.timeout,
        metrics_url=default_metrics_url(url) if a.metrics_url is None else a.metrics_url,
        corpus=a.corpus, max_new_tokens=a.max_new_tokens, min_new_tokens=a.min_new_tokens, seed=a.seed,
        lengths=None if a.tokens is None else Lengths(a.tokens.low, a.tokens.high, a.tokens_seed),
    )  # fmt: skip
    print(f"sweep {cfg.model} over {cfg.protocol} at {url}: concurrency {levels}", flush=True)
    try:
        rows = asyncio.run(run_sweep(cfg, log=lambda m: print(m, flush=True)))
    except ChatTTSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    paths = write_outputs(Path(a.out), rows, cfg)
    print(paths["md"].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
