"""Why a stream's codec calls are slow on a GPU while its engine generates:
`python -m bench.probes.stream_codec --repo REPO`.

Loads the repository's `chattts_stream` (engine and codec in one process, as Triton runs it) on a GPU
and times the codec on the windows one stream decodes (its planner's windows for `--tokens` frames),
first with the engine idle, then while a second thread keeps the engine generating (what a served
stream sees), under variants that each remove one suspect (2026-12-01 ruled out the GIL's switch
interval and TorchScript re-specialising; those variants are gone):

  alone / beside_engine    as served: the codec from its CUDA graphs (`CodecGraphs`, new)
  *_codec_eager            the codec's TorchScript run kernel by kernel, as before the graphs
  codec_side_stream        (graphs) the codec's replays on their own CUDA stream
  engine_event_sync_codec_eager  the engine waits for each step on an event after an async copy to
                           pinned memory, not in a blocking device-to-host copy (Engine.event_sync)

Prints one line per variant (median ms of a codec call, ms for the stream's windows together, and
the engine's step time meanwhile) and writes OUT.json with --out.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from chattts_triton.config import AUDIO_EOS, STREAM
from chattts_triton.model.chunks import stream_windows
from chattts_triton.runtime.engine import GenRequest, SamplingParams
from chattts_triton.triton.backend import ModelContext, stream_service

CUDA_ONLY = ("codec_side_stream", "engine_event_sync_codec_eager")


class KeepBusy:
    """Two threads that keep a generation each running in the engine (back to back): while one finishes and the
    next is admitted the other steps, so a short timed window never falls between generations."""

    def __init__(self, engine, tokens: int):
        self.engine, self.tokens = engine, tokens
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(2)]

    def _run(self, k: int) -> None:
        seed = k * 1_000_000
        while not self.stop.is_set():
            seed += 1
            params = SamplingParams(0.3, 0.7, 20, 1.05, self.tokens, self.tokens, seed=seed)
            self.engine.generate(GenRequest(torch.arange(1, 40), params, lambda r: None, eos_id=AUDIO_EOS,
                                            want_hidden=False),
                                 timeout=600)

    def __enter__(self):
        before = self.engine.counters.steps
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 120
        while self.engine.counters.steps < before + 20 and time.monotonic() < deadline:  # past admission and capture
            time.sleep(0.01)
        if self.engine.counters.steps < before + 20:
            self.stop.set()
            raise RuntimeError("the engine did not start generating beside the codec within 120 s")
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=600)


class StackSampler:
    """Samples one thread's Python stack every `period` s while armed: where a slow call waits."""

    def __init__(self, thread_id: int, period: float = 0.002):
        self.tid, self.period = thread_id, period
        self.samples: collections.Counter = collections.Counter()
        self.armed = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.armed.wait(0.1):
                frame = sys._current_frames().get(self.tid)
                stack = []
                while frame is not None and len(stack) < 4:
                    stack.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}")
                    frame = frame.f_back
                self.samples[" < ".join(stack)] += 1
                time.sleep(self.period)


def time_calls(voc, hid: torch.Tensor, wins, repeats: int, variant: str, engine=None, sampler=None):
    """Per window index: wall ms of each call; and where the calls waited (stack samples)."""
    side = torch.cuda.Stream(device=voc.device) if variant == "codec_side_stream" else None
    calls: list[list[float]] = [[] for _ in wins]
    streams, slow = [], []
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for _ in range(repeats):
            t_stream = time.perf_counter()
            for i, w in enumerate(wins):
                steps0 = engine.counters.steps if engine is not None else 0
                if sampler is not None:
                    sampler.armed.set()
                t0 = time.perf_counter()
                voc.synthesize([(True, hid[w.start:w.stop])])
                ms = 1000 * (time.perf_counter() - t0)
                if sampler is not None:
                    sampler.armed.clear()
                calls[i].append(ms)
                if ms > 50:
                    slow.append({"window": i, "ms": ms,
                                 "engine_steps_during": (engine.counters.steps if engine is not None else 0) - steps0})
            streams.append(1000 * (time.perf_counter() - t_stream))
    return calls, streams, slow


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.stream_codec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same threads without a GPU (the CUDA-only variants are skipped)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a GPU (the question is how the codec and the engine share one), or --device cpu")
    if not (a.repo / STREAM / "config.pbtxt").is_file():
        ap.error(f"{a.repo} is not an exported repository (no {STREAM}/config.pbtxt)")
    svc = stream_service(ModelContext.from_repo(a.repo, STREAM, kind="GPU" if a.device == "cuda" else "CPU"))
    try:
        eng, voc = svc.gpt.engine, svc.voc
        wins = stream_windows(svc.schedule, a.tokens)
        hid = torch.randn(a.tokens, svc.pre.arch.gpt.hidden, generator=torch.Generator().manual_seed(0)) * 0.1
        print(f"windows (frames): {[w.stop - w.start for w in wins]}", file=sys.stderr)
        rows = []
        variants = ("alone", "beside_engine", "alone_codec_eager", "beside_engine_codec_eager", "codec_side_stream",
                    "engine_event_sync_codec_eager", "alone_again")
        if a.device == "cpu":
            variants = tuple(v for v in variants if v not in CUDA_ONLY)
        graphs = voc.graphs
        print(f"codec graphs: {'on' if graphs is not None else 'off (not a CUDA TorchScript codec)'}", file=sys.stderr)
        for variant in variants:
            voc.graphs = None if variant.endswith("_codec_eager") else graphs
            time_calls(voc, hid, wins, 1, variant)  # warm this variant's shapes
            sampler = StackSampler(threading.get_ident())
            busy = KeepBusy(eng, a.tokens) if not variant.startswith("alone") else contextlib.nullcontext()
            eng.event_sync = variant.startswith("engine_event_sync")
            try:
                with busy:
                    s0 = eng.stats()
                    calls, streams, slow = time_calls(voc, hid, wins, a.repeats, variant, eng, sampler)
                    s1 = eng.stats()
            finally:
                voc.graphs = graphs
                eng.event_sync = False
                sampler.stop.set()
            steps = s1["engine_steps"] - s0["engine_steps"]
            flat = [x for c in calls for x in c]
            row = {"variant": variant, "call_ms_p50": statistics.median(flat), "call_ms_max": max(flat),
                   "call_ms_p50_per_window": [round(statistics.median(c), 2) for c in calls],
                   "slow_calls": slow, "stack_samples": sampler.samples.most_common(6),
                   "stream_windows_ms_p50": statistics.median(streams),
                   "engine_step_ms": 1000 * (s1["engine_step_seconds"] - s0["engine_step_seconds"]) / steps
                   if steps else None,
                   "engine_step_device_ms":
                       1000 * (s1["engine_step_device_seconds"] - s0["engine_step_device_seconds"]) / steps
                       if steps else None}
            rows.append(row)
            print(f"{variant:24s} codec call p50 {row['call_ms_p50']:7.1f} ms (max {row['call_ms_max']:6.1f})  "
                  f"a stream's {len(wins)} windows {row['stream_windows_ms_p50']:7.1f} ms  "
                  f"engine step {row['engine_step_ms'] or 0:.2f} ms (device {row['engine_step_device_ms'] or 0:.2f})\n"
                  f"    per window p50 {row['call_ms_p50_per_window']}  slow calls {slow}", flush=True)
            for stack, count in row["stack_samples"]:
                print(f"    {count:5d}  {stack}", flush=True)
        if a.out:
            res = {"date": dt.date.today().isoformat(),
                   "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                   "torch": torch.__version__, "windows": [w.stop - w.start for w in wins], "rows": rows}
            a.out.write_text(json.dumps(res, indent=1))
    finally:
        svc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
