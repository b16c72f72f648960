"""Soak: a long run at a fixed fraction of saturation, watching memory, failures and latency drift.

    python -m loadtest.soak --repo build/repo-tiny --duration-s 1800 --load 0.7 --out build/soak   (serves it through
        python -m chattts_triton.serve, as the container does, and counts the launcher's restarts)
    python -m loadtest.soak --url 127.0.0.1:8001 --pgid PID ...   (a server that is already running)

1. Saturation: closed loop at 2 × engine slots concurrent requests for --calibrate-s; its completion
   rate is the saturation throughput.
2. Open loop at --load × that rate (constant arrivals, one thread per request in flight) for
   --duration-s, every request forcing its length (MIN_NEW_TOKENS = MAX_NEW_TOKENS): --frames N, or
   --frames A-B for each its own, drawn in arrival order from a seeded generator (loadtest.lengths).
3. Every --sample-s: RSS summed over the tritonserver process group (server + python stubs).

Reports (and writes OUT/soak.json): RSS growth over the second half (last sample − first sample
of the second half), failed requests, p99 of the first vs the last window (5 min, or a third of
a short run) and its drift. Targets: growth ≤ 100 MB, 0 failures, drift ≤ 10 %.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loadtest.lengths import Lengths, lengths_arg

TEXTS = ["你好。", "今天天气很好，我们去公园散步吧。", "hello world", "四川美食确实以辣闻名。",
         "the weather is good today"]
TARGETS = {"rss_growth_mb": 100.0, "failed": 0, "p99_drift": 0.10}


@dataclass
class SoakResult:
    duration_s: float
    load: float
    saturation_rps: float
    offered_rps: float
    completed: int
    failed: int
    errors: list[str]
    rss_mb: list[tuple[float, float]]  # (seconds since start, MB)
    rss_growth_second_half_mb: float
    window_s: float
    p99_first_s: float
    p99_last_s: float
    p99_drift: float
    p50_s: float
    passed: dict = field(default_factory=dict)
    restarts: int | None = None  # the launcher's, where the soak started the server
    frames: str = ""  # N, or the range A-B each request's length was drawn from


def group_rss_bytes(pgid: int) -> int:
    from chattts_triton.launcher.tritonserver import processes_in_group

    total = 0
    for pid in processes_in_group(pgid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class Load:
    def __init__(self, url: str, frames, timeout_s: float = 120.0):
        self.url, self.frames, self.timeout_s = url, Lengths.of(frames), timeout_s
        self.draws = self.frames.stream("soak")
        self.lock = threading.Lock()
        self.records: list[tuple[float, float, str | None]] = []  # (start, latency, error)
        self.local = threading.local()

    def client(self):
        import tritonclient.grpc as grpcclient

        if not hasattr(self.local, "c"):
            self.local.c = grpcclient.InferenceServerClient(self.url)
        return self.local.c

    def next_frames(self) -> int:
        with self.lock:
            return next(self.draws)

    def one(self, t0: float, frames: int | None = None) -> None:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        frames = self.next_frames() if frames is None else frames
        inputs = []
        for name, arr, wire in (("TEXT", np.array([[random.choice(TEXTS).encode()]], object), "BYTES"),
                                ("SEED", np.array([[random.getrandbits(62)]], np.int64), "INT64"),
                                ("MAX_NEW_TOKENS", np.array([[frames]], np.int32), "INT32"),
                                ("MIN_NEW_TOKENS", np.array([[frames]], np.int32), "INT32")):
            inputs.append(grpcclient.InferInput(name, list(arr.shape), wire))
            inputs[-1].set_data_from_numpy(arr)
        start = time.monotonic()
        err = None
        try:
            audio = self.client().infer("chattts", inputs,
                                        client_timeout=self.timeout_s).as_numpy("AUDIO")
            if not np.isfinite(audio).all() or audio.size == 0:
                err = "non-finite or empty audio"
        except InferenceServerException as e:
            err = f"{e.status()}: {e.message()[:200]}"
        except Exception as e:  # noqa: BLE001  a soak counts every failure, whatever raised it
            err = repr(e)[:200]
        with self.lock:
            self.records.append((start - t0, time.monotonic() - start, err))


def saturation_rps(load: Load, concurrency: int, seconds: float) -> float:
    stop = time.monotonic() + seconds
    t0 = time.monotonic()

    def worker():
        while time.monotonic() < stop:
            load.one(t0)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in load.records if r[2] is None and r[0] >= seconds / 3]  # skip the ramp-up third
    load.records.clear()
    return len(done) / (seconds * 2 / 3) if done else 0.0


def p99(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99)) if latencies else float("nan")


def soak(url: str, pgid: int, duration_s: float, load_fraction: float = 0.7, frames=60,
         calibrate_s: float = 30.0, sample_s: float = 10.0, concurrency: int = 4, rps: float | None = None,
         progress=print) -> SoakResult:
    load = Load(url, frames)
    sat = rps / load_fraction if rps else saturation_rps(load, concurrency, calibrate_s)
    if sat <= 0:
        raise RuntimeError("no request completed during calibration: is the server serving?")
    rate = sat * load_fraction
    progress(f"saturation ≈ {sat:.2f} req/s; offering {rate:.2f} req/s for {duration_s:.0f} s")
    t0 = time.monotonic()
    rss: list[tuple[float, float]] = [(0.0, group_rss_bytes(pgid) / 2**20)]
    threads: list[threading.Thread] = []
    next_arrival, next_sample = t0, t0 + sample_s
    while True:
        now = time.monotonic()
        if now - t0 >= duration_s:
            break
        if now >= next_arrival:
            th = threading.Thread(target=load.one, args=(t0, load.next_frames()), daemon=True)  # drawn in arrival order
            th.start()
            threads.append(th)
            next_arrival += 1.0 / rate
        if now >= next_sample:
            rss.append((now - t0, group_rss_bytes(pgid) / 2**20))
            next_sample += sample_s
            with load.lock:
                bad = sum(1 for r in load.records if r[2])
            progress(f"t={now - t0:6.0f}s rss={rss[-1][1]:8.1f} MB done={len(load.records)} failed={bad}")
        time.sleep(max(0.0, min(next_arrival, next_sample) - time.monotonic()))
    for th in threads:
        th.join(load.timeout_s + 5)
    rss.append((time.monotonic() - t0, group_rss_bytes(pgid) / 2**20))

    records = sorted(load.records)
    ok = [r for r in records if r[2] is None]
    window = min(300.0, duration_s / 3)
    first = [r[1] for r in ok if r[0] < window]
    last = [r[1] for r in ok if r[0] >= duration_s - window]
    half = [m for t, m in rss if t >= duration_s / 2]
    growth = (rss[-1][1] - half[0]) if half else float("nan")
    p_first, p_last = p99(first), p99(last)
    drift = (p_last - p_first) / p_first if p_first > 0 else float("nan")
    errors = sorted({r[2] for r in records if r[2]})
    res = SoakResult(
        duration_s=duration_s, load=load_fraction, saturation_rps=sat, offered_rps=rate, completed=len(ok),
        failed=len(records) - len(ok), errors=errors[:20], rss_mb=rss, rss_growth_second_half_mb=growth,
        window_s=window, p99_first_s=p_first, p99_last_s=p_last, p99_drift=drift,
        p50_s=float(np.percentile([r[1] for r in ok], 50)) if ok else float("nan"), frames=str(load.frames),
    )
    res.passed = {"rss_growth_mb": growth <= TARGETS["rss_growth_mb"], "failed": res.failed <= TARGETS["failed"],
                  "p99_drift": drift <= TARGETS["p99_drift"]}
    return res


def summary(r: SoakResult) -> str:
    return (f"soak {r.duration_s:.0f} s at {r.load:.0%} of {r.saturation_rps:.2f} req/s ({r.frames} frames each): "
            f"{r.completed} ok, "
            f"{r.failed} failed; RSS {r.rss_mb[0][1]:.0f} → {r.rss_mb[-1][1]:.0f} MB, growth over the second half "
            f"{r.rss_growth_second_half_mb:+.1f} MB; p99 first {r.window_s:.0f} s {r.p99_first_s:.3f} s, last "
            f"{r.p99_last_s:.3f} s (drift {r.p99_drift:+.1%}); p50 {r.p50_s:.3f} s; targets met: {r.passed}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, help="start a server on this repository (else --url and --pgid)")
    ap.add_argument("--url", help="gRPC host:port of a running server")
    ap.add_argument("--pgid", type=int, help="process group of the running tritonserver (its pid)")
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of saturation to offer")
    ap.add_argument("--frames", type=lengths_arg, default=Lengths(60, 60),
                    help="code frames per request: N (fixed cost), or A-B for each its own")
    ap.add_argument("--calibrate-s", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=4, help="closed-loop concurrency for calibration")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=Path("build/soak"))
    a = ap.parse_args(argv)
    server = None
    if a.repo:  # as the container runs it: the launcher (a restart would be counted and fail the soak)
        from chattts_triton.launcher.serve import Launched

        a.out.mkdir(parents=True, exist_ok=True)
        server = Launched(a.repo, a.out / "tritonserver.log", ready_timeout_s=600).start()
        a.url, a.pgid = server.grpc_url, server.server_pid
    elif not (a.url and a.pgid):
        ap.error("give --repo, or --url and --pgid")
    try:
        r = soak(a.url, a.pgid, a.duration_s, a.load, a.frames, a.calibrate_s, a.sample_s, a.concurrency)
    finally:
        if server is not None:
            server.stop()
            r.restarts = server.restarts
            r.passed["restarts"] = server.restarts == 0
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "soak.json").write_text(json.dumps(asdict(r), indent=2))
    print(summary(r))
    print(f"wrote {a.out / 'soak.json'}")
    return 0 if all(r.passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
