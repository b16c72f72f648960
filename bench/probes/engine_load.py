"""The served GPT engine alone under the sweep's closed-loop load: no Triton, no other process on the device.

    python -m bench.probes.engine_load --repo REPO [--concurrency 256,512] [--slots N] [--think-ms 0] [--seconds 10]
                                [--tokens 150] [--overlap on,off] [--out FILE]

Builds `chattts_gpt`'s service from an exported repository exactly as Triton's instance would
(`ModelContext.from_repo` + `backend.gpt_service`: its dtype, slots, compiled step, warm-up and graphs),
then keeps N requests in flight with prompts of the sweep's corpus (`loadtest/corpus.txt`, the
preprocess model's prompt layout and a speaker embedding) and `--tokens` forced frames each. Per level:
utterances/s, latency, and the engine's step, GPU-clock step and prefill per step over the window
(`loadtest.sweep.engine_window`, the figures a served sweep reports). Beside a served sweep at the same
concurrency this splits a served step into the engine's own GPU time and what the other model
processes (vocoder, stream codec) take from it on a shared GPU. `--think-ms T`: each client waits
uniformly 0..2T ms between a result and its next request, as a served request's vocoder, Triton and
gRPC time spread the arrivals (the engine's admissions, so its prefills, follow the arrivals).
Each row's `engine_step_gap_max_ms` is the running rows' worst gap between two decode steps in its window, and
`first_wave_step_gap_max_ms` the worst while the level's first wave was admitted (the settle): beside a served run's,
what the engine's own admissions cost the running rows and what the other processes on the GPU add.
`--sync-debug` (CUDA): each level once more, its window counting the synchronizing CUDA calls by the engine line
that made them (a row with `syncs`; the counting's own cost is in that row's figures, not the plain one's).
`--timeline`: each level once more under torch.profiler, the engine's parts (step launch, prefill with its inputs and
first tokens, resume, landing, finishing, compaction) each in a range of its own: per decode step, the device ms of the
kernels each launched and its host ms, beside all kernels' ms (what runs on the GPU between the steps' own kernels,
named) and the host ms of the CUDA runtime calls that can wait (synchronizes, copies, allocations). `--trace FILE`:
the window's Chrome trace too.
`--prefill packed,padded`: each level with the prompts prefilled packed end to end (`Engine.packed_prefill`, the
repository's `gpt_packed_prefill` by default) and padded to the longest, switched between windows of one engine.
`--overlap on,off`: each level with the engine's host bookkeeping overlapping the next step (`Engine.overlap`,
the served default on a GPU) and without, switched between windows of one engine: the row's `overlap` says
which; wall per step (`engine_step_ms`) against the GPU clock's (`engine_step_gpu_ms`) is what it buys.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import heapq
import os
import random
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

from bench.common import add_device_args, cuda_missing, int_list, write_rows


def load_prompts(repo: Path) -> list[torch.Tensor]:
    """The corpus's code prompts as the preprocess model lays them out (with a speaker embedding)."""
    from chattts_triton.config import PREPROCESS
    from chattts_triton.model import text as txt
    from loadtest.corpus import load_corpus

    tok = txt.TextTokenizer(Path(repo) / PREPROCESS / "1" / "tokenizer")
    return [torch.from_numpy(txt.build_code_prompt(tok, t, spk_emb=True).text_ids) for t in load_corpus()]


class ClosedLoop:
    """`concurrency` requests kept in flight: each one's completion (on the engine's results thread)
    submits the next. Latencies of completions are kept with their finish time."""

    def __init__(self, service, prompts: list[torch.Tensor], tokens: int, concurrency: int, seed: int = 0,
                 think_s: float = 0.0):
        from chattts_triton.config import InferCodeParams
        from chattts_triton.runtime.inputs import sampling_params

        self.service, self.prompts, self.concurrency = service, prompts, concurrency
        forced = {"MAX_NEW_TOKENS": np.array([tokens]), "MIN_NEW_TOKENS": np.array([tokens])}
        self.params = lambda i: sampling_params({**forced, "SEED": np.array([seed + i])}, InferCodeParams())
        g = torch.Generator().manual_seed(seed)
        self.spk_emb = torch.randn(service.arch.gpt.hidden, generator=g)
        self.done: list[tuple] = []  # (finish time, latency s, finish reason)
        self.lock = threading.Lock()
        self.stopping = False
        self.in_flight = 0
        self.idle = threading.Condition(self.lock)
        self.n = 0
        self.error: BaseException | None = None  # a request the engine refused
        # think time: next submissions due later, kept by one thread (not a thread per request: this
        # process is the engine's, whose GIL the figures would then share with hundreds of timers)
        self.think_s = think_s
        self.rng = random.Random(seed)
        self.due: list[float] = []  # heap of times a client sends its next request
        self.thinker: threading.Thread | None = None

    def _submit(self) -> None:
        from chattts_triton.runtime.engine import GenRequest

        with self.lock:
            if self.stopping:
                return
            i = self.n
            self.n += 1
            self.in_flight += 1
        t0 = time.perf_counter()
        req = GenRequest(text_ids=self.prompts[i % len(self.prompts)], params=self.params(i),
                         on_done=lambda r, t0=t0: self._done(r, t0), spk_emb=self.spk_emb,
                         spk_emb_id=self.service.spk_emb_id)
        try:
            self.service.engine.submit(req)
        except Exception as e:  # noqa: BLE001  e.g. prompt + --tokens beyond the model's context: stop the level, say why
            with self.lock:
                self.in_flight -= 1
                self.stopping = True
                self.error = self.error or e
                self.idle.notify_all()

    def _done(self, result, t0: float) -> None:
        now = time.perf_counter()
        with self.lock:
            self.done.append((now, now - t0, result.finish_reason))
            self.in_flight -= 1
            self.idle.notify_all()
            if self.think_s > 0:
                heapq.heappush(self.due, now + self.rng.uniform(0, 2 * self.think_s))
                return
        self._submit()

    def _think(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and (not self.due or self.due[0] > time.perf_counter()):
                    self.idle.wait(None if not self.due else max(0.0, self.due[0] - time.perf_counter()))
                if self.stopping:
                    return
                heapq.heappop(self.due)
            self._submit()

    def start(self) -> None:
        if self.think_s > 0:
            self.thinker = threading.Thread(target=self._think, name="engine-load-think", daemon=True)
            self.thinker.start()
        for _ in range(self.concurrency):
            self._submit()

    def stop(self, timeout: float = 600.0) -> None:
        with self.lock:
            self.stopping = True
            self.idle.notify_all()  # the think thread ends
            if not self.idle.wait_for(lambda: self.in_flight == 0, timeout=timeout):
                raise RuntimeError(f"{self.in_flight} requests still running {timeout:.0f} s after the load stopped")
        if self.error is not None:
            raise RuntimeError(f"the engine refused a request: {self.error}") from self.error


class SyncCounter:
    """The synchronizing CUDA calls of a window (torch.cuda.set_sync_debug_mode("warn"), process-wide), each
    counted by the innermost line of chattts_triton/ on the stack of the thread that made it: a host sync that
    the engine's step does not need (its one read of the step's flags is `_host_sync` / the overlap's event)."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self._show = None

    def _record(self, message, category, filename, lineno, file=None, line=None):
        here = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}chattts_triton{os.sep}" in f.filename]
        where = f"{Path(here[-1].filename).name}:{here[-1].lineno} {here[-1].name}" if here else f"{filename}:{lineno}"
        self.counts[where] += 1

    def __enter__(self):
        self._show, warnings.showwarning = warnings.showwarning, self._record
        warnings.filterwarnings("always", message=".*synchroniz")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        return False


# the engine's parts whose kernels the timeline attributes to them: Engine methods, by the name they are reported under
TIMELINE_PARTS = {"_launch": "step", "_prefill": "prefill", "_resume": "resume", "_land": "land",
                  "_finish_rows": "finish", "_compact": "compact",
                  # inside a prefill: its inputs built on the host and copied, its first tokens drawn
                  "_prompt_rows": "prefill_inputs", "_first_step": "prefill_first"}
# CUDA runtime calls whose host time the timeline reports: a wait hidden in one (a pageable copy that syncs its
# stream, a pinned allocation, an event or stream synchronize) shows here, not in sync-debug's count
CUDA_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
              "cudaMemcpy", "cudaHostAlloc", "cudaMalloc", "cudaFree", "cudaGraphLaunch", "cudaLaunchKernel",
              "cudaEventQuery", "cudaEventRecord")


class Timeline:
    """torch.profiler over a window, with each of the engine's parts (TIMELINE_PARTS) in a range of its own: the
    device time of the kernels each launched (a step's graph replay included), its host time and calls, and all the
    kernels' time in the window. What runs on the GPU between the steps' own kernels is then named: the prefills'
    kernels, the results' copies, compaction. Ranges nest (`land` holds `finish`, which holds `compact`)."""

    def __init__(self, engine, trace_path: str | None = None):
        self.engine = engine
        self.trace_path = trace_path
        self.prof = None
        self.parts: dict = {}
        self.calls: dict = {}
        self.kernel_ms = 0.0

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile, record_function

        for attr, name in TIMELINE_PARTS.items():
            fn = getattr(self.engine, attr)

            def wrapped(*a, _fn=fn, _name=name, **kw):
                with record_function(f"engine.{_name}"):
                    return _fn(*a, **kw)

            setattr(self.engine, attr, wrapped)  # the instance's attribute shadows the method
        from torch._C._profiler import _ExperimentalConfig

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.engine.device.type == "cuda" else [])
        # the engine runs on its own thread: the profiler records the thread that starts it only, unless told
        self.prof = profile(activities=acts, experimental_config=_ExperimentalConfig(profile_all_threads=True))
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.prof.__exit__(*exc)
        finally:
            for attr in TIMELINE_PARTS:
                self.engine.__dict__.pop(attr, None)
        if self.trace_path:
            self.prof.export_chrome_trace(self.trace_path)
        from torch.autograd import DeviceType

        events = self.prof.key_averages()
        for e in events:
            if e.key.startswith("engine."):
                self.parts[e.key.removeprefix("engine.")] = {
                    "calls": 0, "device_ms": e.device_time_total / 1000, "host_ms": 0.0}
            elif e.key in CUDA_CALLS:
                self.calls[e.key] = {"calls": e.count, "host_ms": e.cpu_time_total / 1000}
        self.kernel_ms = sum(e.self_device_time_total for e in events if not e.key.startswith("engine.")) / 1000
        # the ranges' host time and calls from their own events (on a GPU the averages give the engine thread's
        # ranges no CPU time)
        for e in self.prof.events():
            part = self.parts.get(e.name.removeprefix("engine.")) if e.name.startswith("engine.") else None
            if part is not None and e.device_type == DeviceType.CPU:
                part["calls"] += 1
                part["host_ms"] += e.time_range.elapsed_us() / 1000
        return False

    def summary(self, steps: int) -> dict:
        """Per decode step of the window: each part's device and host ms and calls, and all kernels' ms."""
        per = max(steps, 1)
        return {"kernels_ms_per_step": round(self.kernel_ms / per, 4),
                **{name: {k: round(v / per, 4) for k, v in part.items()} for name, part in self.parts.items()},
                "cuda_calls": {name: {k: round(v / per, 4) for k, v in c.items()} for name, c in self.calls.items()}}


def run_level(service, prompts, tokens: int, concurrency: int, seconds: float, settle_s: float,
              think_s: float = 0.0, sync_debug: bool = False, timeline: bool = False,
              trace_path: str | None = None) -> dict:
    from loadtest.sweep import engine_window
    from loadtest.tts_stats import percentile

    load = ClosedLoop(service, prompts, tokens, concurrency, seed=concurrency, think_s=think_s)
    service.engine.restart_step_gaps()  # the worst gap of the first wave's admissions, then of the window alone
    load.start()
    time.sleep(settle_s)  # admissions of the first wave, then a steady mix
    first_wave_gap = service.engine.stats()["engine_step_gap_max_seconds"]
    service.engine.restart_step_gaps()
    syncs = SyncCounter() if sync_debug else contextlib.nullcontext()
    trace = Timeline(service.engine, trace_path) if timeline else contextlib.nullcontext()
    with syncs, trace:
        before, t0 = {"0": service.engine.stats()}, time.perf_counter()
        time.sleep(seconds)
        after, t1 = {"0": service.engine.stats()}, time.perf_counter()
    load.stop()
    window = [(lat, why) for at, lat, why in load.done if t0 <= at <= t1]
    lat_ms = [1000 * lat for lat, _ in window]
    row = {"concurrency": concurrency, "think_ms": 1000 * think_s, "seconds": round(t1 - t0, 3),
           "utterances": len(window),
           "throughput_utt_s": len(window) / (t1 - t0),
           "latency_p50_ms": percentile(lat_ms, 50) if lat_ms else None,
           "latency_p99_ms": percentile(lat_ms, 99) if lat_ms else None,
           "not_max_tokens": sum(1 for _, why in window if why != "max_tokens")}
    row.update(engine_window(before, after, t1 - t0))
    row["first_wave_step_gap_max_ms"] = 1000 * first_wave_gap
    if sync_debug:
        row["syncs"] = dict(syncs.counts.most_common(20))
    if timeline:
        row["timeline"] = trace.summary(after["0"]["engine_steps"] - before["0"]["engine_steps"])
    return row


def word_list(ap: argparse.ArgumentParser, text: str, flag: str, words: tuple[str, ...],
              empty: bool = False) -> list[str]:
    """A comma list of `words` (an argument error naming `flag` otherwise; empty only where `empty`)."""
    got = [v.strip() for v in text.split(",") if v.strip()]
    if (not got and not empty) or set(got) - set(words):
        ap.error(f"{flag} must be a comma list of {' and '.join(words)}")
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.engine_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="256,512")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of load before each window")
    ap.add_argument("--tokens", type=int, default=150, help="frames forced per utterance")
    ap.add_argument("--slots", type=int, help="engine slots instead of the repository's gpt_slots (a served sweep's "
                                              "512)")
    ap.add_argument("--think-ms", default="0",
                    help="mean wait of a client between a result and its next request (uniform 0..2x; 0: at once); "
                         "a comma list runs every level with each")
    ap.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=None,
                    help="override the repository's gpt_compile_prefill (prefills through torch.compile with the step)")
    ap.add_argument("--overlap", default="on",
                    help="comma list of on/off: the engine overlaps its host bookkeeping with the next step "
                         "(Engine.overlap)")
    ap.add_argument("--prefill", default="",
                    help="comma list of packed/padded: prompts prefilled packed end to end or padded to the longest "
                         "(Engine.packed_prefill; packed needs the decode kernel), switched between windows (default: "
                         "the repository's gpt_packed_prefill)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="CUDA: each level once more, counting its window's synchronizing CUDA calls by the line of "
                         "chattts_triton that made them (torch.cuda.set_sync_debug_mode)")
    ap.add_argument("--timeline", action="store_true",
                    help="each level once more under torch.profiler: per decode step, the device and host ms of the "
                         "engine's parts (step, prefill and its inputs and first tokens, land, finish, compact, "
                         "resume), all kernels' ms and the host ms of CUDA runtime calls")
    ap.add_argument("--trace", help="with --timeline: the profiler's Chrome trace of each timed window to this file "
                                    "(a level's concurrency and layout added to its name)")
    add_device_args(ap)
    a = ap.parse_args(argv)
    if cuda_missing(a):
        return 2
    from chattts_triton.config import GPT
    from chattts_triton.triton.backend import ModelContext, freeze_start_up_objects, gpt_service
    from chattts_triton.triton.params import GPTParams

    levels = int_list(ap, a.concurrency, "--concurrency")
    if not levels or min(levels) < 1:
        ap.error("--concurrency must be ≥ 1")
    if a.slots is not None and a.slots < 1:
        ap.error("--slots must be ≥ 1")
    try:
        thinks = [float(t) for t in a.think_ms.split(",") if t]
    except ValueError:
        ap.error("--think-ms must be numbers of milliseconds, comma-separated")
    if not thinks or min(thinks) < 0:
        ap.error("--think-ms must be ≥ 0")
    overlaps = word_list(ap, a.overlap, "--overlap", ("on", "off"))
    layouts = word_list(ap, a.prefill, "--prefill", ("packed", "padded"), empty=True)
    overrides = {} if a.slots is None else {"gpt_slots": a.slots}
    if a.compile_prefill is not None:
        overrides["gpt_compile_prefill"] = int(a.compile_prefill)
    ctx = ModelContext.from_repo(a.repo, GPT, kind="GPU" if a.device == "cuda" else "CPU", device_id=a.gpu, **overrides)
    slots = ctx.params(GPTParams).gpt_slots
    if slots is not None and max(levels) > slots:
        print(f"note: concurrency above the model's gpt_slots ({slots}) waits in the engine's queue", file=sys.stderr)
    t0 = time.perf_counter()
    service = gpt_service(ctx)
    freeze_start_up_objects()  # as Triton's instance does after its service is built
    print(f"[engine_load] engine ready in {time.perf_counter() - t0:.1f} s "
          f"({'compiled step' if service.engine.graph_step is not None else 'TorchScript step'}"
          f"{' and prefill' if service.engine.graph_prefill is not None else ''}, "
          f"decode kernel {service.engine.decode_kernel})", flush=True)
    prompts = load_prompts(a.repo)
    rows = []
    try:
        # each level plainly, then once more per instrument asked for (its own cost stays out of the plain row)
        runs = [{}] + ([{"sync_debug": True}] if a.sync_debug and a.device == "cuda" else []) \
            + ([{"timeline": True}] if a.timeline else [])
        if "packed" in layouts and not service.engine.decode_kernel:
            print("[engine_load] packed prefills need the decode kernel: this engine runs padded ones", flush=True)
            layouts = ["padded"]
        layouts = layouts or [None]  # None: as the repository says
        for think, c, ov, lay, extra in ((t, c, o, p, r) for t in thinks for c in levels for o in overlaps
                                         for p in layouts for r in runs):
            service.engine.overlap = ov == "on"  # taken up at its next step (a step in flight is landed first)
            if lay is not None:
                service.engine.packed_prefill = lay == "packed"  # taken up at its next admission
            lay = "packed" if service.engine.packed_prefill else "padded"
            if extra.get("timeline") and a.trace:
                stem, ext = os.path.splitext(a.trace)
                extra = {**extra, "trace_path": f"{stem}-{c}-{ov}-{lay}{ext}"}
            row = run_level(service, prompts, a.tokens, c, a.seconds, a.settle, think / 1000, **extra)
            row["overlap"] = service.engine.overlap
            row["prefill"] = lay
            rows.append(row)

            def fmt(k, spec=".2f", row=row):
                return "n/a" if row.get(k) is None else format(row[k], spec)

            print(f"[engine_load] concurrency {c}{f' (think {think:g} ms)' if think else ''}, overlap {ov}, "
                  f"{lay} prefill: "
                  f"{row['throughput_utt_s']:.1f} utt/s, p50 {fmt('latency_p50_ms', '.0f')} ms, "
                  f"step {fmt('engine_step_ms')} ms (device {fmt('engine_step_device_ms')}, GPU clock "
                  f"{fmt('engine_step_gpu_ms')}, graph {fmt('engine_step_graph_ms')}, prefill/step "
                  f"{fmt('engine_prefill_ms_per_step')} "
                  f"({fmt('engine_prefill_ms')} ms per prefill of {fmt('engine_prefill_prompts', '.1f')}), GIL wait "
                  f"{fmt('engine_gil_wait_ms', '.3f')}, step gap {fmt('engine_step_gap_ms')}, the worst "
                  f"{fmt('engine_step_gap_max_ms', '.1f')}, in the first wave "
                  f"{fmt('first_wave_step_gap_max_ms', '.1f')}), "
                  f"rows {fmt('engine_batch', '.1f')}", flush=True)
            if "syncs" in row:
                print(f"[engine_load] host syncs in the window: {row['syncs']}", flush=True)
            if "timeline" in row:
                print(f"[engine_load] timeline per decode step: {row['timeline']}", flush=True)
    finally:
        service.engine.stop()
    write_rows(a, rows, tokens=a.tokens, slots=service.engine.max_slots,
               compiled_prefill=service.engine.graph_prefill is not None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
