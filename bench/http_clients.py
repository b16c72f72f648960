"""Our HTTP clients beside Triton's perf_analyzer over HTTP, on one server, at the same concurrencies.

    python -m bench.http_clients --repo build/bench-repo --concurrency 64,256 --tokens 150 --out build/http-clients
    python -m bench.http_clients --url 127.0.0.1:8000 ...      # a running server (its HTTP port)
    python -m bench.http_clients --standin ...                 # loadtest.standin: no model, the clients alone

Paths, each a closed loop of N requests in flight (no think time), every request forcing --tokens frames
(MIN = MAX) of bench.perf's sentence:
- `perf_analyzer`: bench.perf over HTTP (`-i http`), its own windows and stability check: the reference;
- `asyncio`: `AsyncChatTTSClient(protocol="http")`, N tasks in one event loop;
- `sync`: `ChatTTSClient(protocol="http")`, N threads;
- `locust`: `python -m loadtest.run --protocol http` (TritonHttpUser), N users on gevent, in one process or
  --locust-processes workers (Locust's --processes); its p50/p99 are Locust's current percentiles at the window's
  end (its last 10 s) and its utt/s its request counts over the window, from its stats history;
- `tritonclient-aio`: tritonclient.http.aio as it comes (aiohttp's default headers): the control that shows
  what the asyncio client did before it asked for uncompressed answers;
- `grpc`: `AsyncChatTTSClient(protocol="grpc")`, N tasks: the same load over gRPC, for comparison.
Each of ours is measured for --seconds after --warmup seconds. Beside utterances/s and latency, the server's
view over the window: from its metrics the GPT engine's prompts per prefill and rows per step (how many
requests reached it together), from its statistics the mean batch of the model the requests name. Writes
OUT/http-clients.json and .md; the table gives each path's share of perf_analyzer's throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import perf
from client.client import AsyncChatTTSClient, ChatTTSClient
from client.contract import MODEL, build_inputs, requested_outputs, to_infer_inputs
from loadtest.sweep import diff_model_statistics, engine_window, metrics_endpoint, parse_engine_counters
from loadtest.tts_stats import percentile

PATHS = ("perf_analyzer", "asyncio", "sync", "locust", "tritonclient-aio", "grpc")
DEFAULT_PATHS = ("perf_analyzer", "asyncio", "sync", "locust")
TARGET = 0.9  # share of perf_analyzer's throughput each of our paths should reach
ROOT = Path(__file__).resolve().parents[1]
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


class Server:
    """What the paths need of the server: its HTTP url, metrics and statistics."""

    def __init__(self, url: str, metrics_url: str | None, grpc_url: str | None = None, model: str = MODEL):
        self.url, self.metrics_url, self.grpc_url, self.model = url, metrics_url, grpc_url, model

    def metrics(self) -> str:
        if not self.metrics_url:
            return ""
        try:
            with _NO_PROXY.open(metrics_endpoint(self.metrics_url), timeout=5.0) as r:
                return r.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def statistics(self) -> dict:
        with ChatTTSClient(self.url, protocol="http", model=self.model, retries=0) as c:
            return c.inference_statistics()


def options(tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": tokens, "min_new_tokens": tokens, "seed": 1}


def summarize(spans: Sequence[tuple], t0: float, t1: float) -> dict[str, Any]:
    """spans: (start, end, ok) of every request; the window's throughput, latency and errors."""
    inside = [s for s in spans if t0 <= s[1] < t1]
    ok = [(e - s) * 1000.0 for s, e, good in inside if good]
    return {"throughput_utt_s": len(ok) / (t1 - t0), "latency_p50_ms": percentile(ok, 50),
            "latency_p99_ms": percentile(ok, 99), "errors": len(inside) - len(ok), "requests": len(inside)}


def server_view(server: Server, before: tuple, after: tuple, seconds: float) -> dict[str, Any]:
    """(metrics text, statistics) before and after -> what reached the engine and the model together."""
    eng = engine_window(parse_engine_counters(before[0]), parse_engine_counters(after[0]), seconds)
    stats = diff_model_statistics(before[1], after[1]) if before[1] and after[1] else {}
    return {"engine_prefill_prompts": eng["engine_prefill_prompts"], "engine_batch": eng["engine_batch"],
            "model_batch": (stats.get(server.model) or {}).get("avg_batch")}


def _snapshot(server: Server) -> tuple:
    try:
        stats = server.statistics()
    except Exception:  # noqa: BLE001  statistics are an extra: the throughput stands without them
        stats = {}
    return server.metrics(), stats


def _window(server: Server, warmup: float, seconds: float, still_running: Callable[[], bool] = lambda: True):
    """Sleep the warm-up, snapshot, sleep the window, snapshot: (t0, t1, before, after)."""
    time.sleep(warmup)
    before, t0 = _snapshot(server), time.monotonic()
    time.sleep(seconds)
    t1, after = time.monotonic(), _snapshot(server)
    return t0, t1, before, after


# --- the paths ---------------------------------------------------------------------------------
def run_asyncio(server: Server, n: int, tokens: int, text: str, warmup: float, seconds: float,
                as_shipped: bool = False, protocol: str = "http") -> dict[str, Any]:
    """N tasks on one loop: our AsyncChatTTSClient (over `protocol`), or (as_shipped) tritonclient.http.aio with
    its defaults."""
    spans: list[tuple] = []

    async def main():
        stop = asyncio.Event()
        if as_shipped:
            import tritonclient.http as http
            import tritonclient.http.aio as aio

            raw = aio.InferenceServerClient(server.url, conn_limit=max(100, n), conn_timeout=600.0)
            arrays = build_inputs(text, options(tokens))

            async def call():
                await raw.infer(server.model, to_infer_inputs(http, arrays), outputs=requested_outputs(http))

            close = raw.close
        else:
            url = server.url if protocol == "http" else server.grpc_url
            ours = AsyncChatTTSClient(url, protocol=protocol, model=server.model, retries=0, max_concurrency=n,
                                      timeout_s=600.0)

            async def call():
                await ours.infer_one(text, options(tokens))

            close = ours.close

        async def worker():
            while not stop.is_set():
                start, good = time.monotonic(), True
                try:
                    await call()
                except Exception:  # noqa: BLE001  counted as an error, the loop goes on
                    good = False
                    await asyncio.sleep(0.05)
                spans.append((start, time.monotonic(), good))

        tasks = [asyncio.ensure_future(worker()) for _ in range(n)]
        got = await asyncio.get_running_loop().run_in_executor(None, _window, server, warmup, seconds)
        stop.set()
        await asyncio.wait(tasks, timeout=120)
        for t in tasks:
            t.cancel()
        await close()
        return got

    t0, t1, before, after = asyncio.run(main())
    return {**summarize(spans, t0, t1), **server_view(server, before, after, t1 - t0)}


def run_sync(server: Server, n: int, tokens: int, text: str, warmup: float, seconds: float) -> dict[str, Any]:
    spans: list[tuple] = []
    stop = threading.Event()
    with ChatTTSClient(server.url, protocol="http", model=server.model, retries=0, max_concurrency=n,
                       timeout_s=600.0) as c:
        def worker():
            while not stop.is_set():
                start, good = time.monotonic(), True
                try:
                    c.infer_one(text, options(tokens))
                except Exception:  # noqa: BLE001  counted as an error, the loop goes on
                    good = False
                    time.sleep(0.05)
                spans.append((start, time.monotonic(), good))

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        t0, t1, before, after = _window(server, warmup, seconds)
        stop.set()
        for t in threads:
            t.join(120)
    return {**summarize(spans, t0, t1), **server_view(server, before, after, t1 - t0)}


def _ms(cell: str | None) -> float | None:
    try:
        return float(cell)
    except (TypeError, ValueError):  # "N/A": no request in Locust's percentile window
        return None


def locust_window(history_csv: Path, t0: float, t1: float) -> dict[str, Any]:
    """Requests/s between the wall times t0 and t1 from Locust's stats history (its Aggregated rows), and p50/p99
    from the last row inside: with --csv-full-history, Locust's current percentiles, over its last
    CURRENT_RESPONSE_TIME_PERCENTILE_WINDOW (10) seconds, so inside a window of 10 s or more.

    With --processes the master's totals move only when a worker reports (every LOCUST_REPORT_S), each worker at
    its own phase, so the rate is taken between the window's first row and its last row a whole number of report
    intervals later: in that span every worker reported as many times as the span has intervals, whatever its phase.
    (Between the first and the last row at which the totals moved, a span that begins at one worker's report and ends
    at another's, the reports overcount it.) Without such a pair (a window under one interval), the window's ends."""
    rows = []
    with open(history_csv, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("Name") == "Aggregated" and t0 <= float(r["Timestamp"]) <= t1:
                rows.append((float(r["Timestamp"]), int(r["Total Request Count"]), int(r["Total Failure Count"]), r))
    if len(rows) < 2 or rows[-1][0] <= rows[0][0]:
        raise RuntimeError(f"{history_csv}: fewer than two stats rows between {t0:.0f} and {t1:.0f}")
    first = rows[0]
    whole = [row for row in rows[1:] if _whole_intervals(row[0] - first[0])]
    last = whole[-1] if whole else rows[-1]
    (a, na, fa, _), (b, nb, fb, _) = first, last
    pct = rows[-1][3]
    return {"throughput_utt_s": ((nb - na) - (fb - fa)) / (b - a), "latency_p50_ms": _ms(pct.get("50%")),
            "latency_p99_ms": _ms(pct.get("99%")), "errors": fb - fa, "requests": nb - na}


def _whole_intervals(span: float) -> bool:
    """Whether span (s) is a whole number (>= 1) of Locust's report intervals, within its one-second rows' jitter."""
    k = round(span / LOCUST_REPORT_S)
    return k >= 1 and abs(span - k * LOCUST_REPORT_S) <= 0.25


def _locust_started(history_csv: Path) -> bool:
    """Whether Locust's stats history shows a request yet (its users start after the workers import and connect:
    seconds on a small host, more with --processes)."""
    try:
        with open(history_csv, newline="") as f:
            return any(r.get("Name") == "Aggregated" and int(r["Total Request Count"] or 0) > 0
                       for r in csv.DictReader(f))
    except (OSError, ValueError, KeyError):
        return False


LOCUST_START_S = 180.0  # Locust's start-up (imports, workers connecting, users spawned) before it counts as failed
LOCUST_REPORT_S = 3.0  # locust.runners.WORKER_REPORT_INTERVAL: how often --processes workers send their totals
LOCUST_MIN_SECONDS = 3 * LOCUST_REPORT_S  # a window that holds at least two whole report intervals


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: it is there
        return True
    return True


def stop_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGINT to proc's process group (Locust writes its last rows on it), then SIGKILL to whatever of the group is
    left after timeout: the leader's exit does not end its workers."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, whose zombie keeps the group alive
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait()


def run_locust(server: Server, n: int, tokens: int, text: str, warmup: float, seconds: float, out: Path,
               processes: int = 1) -> dict[str, Any]:
    """Locust runs until stopped: the warm-up counts from its first request (not from its start, which takes
    seconds of imports and worker hand-shakes), the window follows, then Locust is interrupted (it writes its
    history every second, so the window's rows are on disk)."""
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_text(text + "\n", encoding="utf-8")
    history = out / "stats_stats_history.csv"
    history.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "loadtest.run", "--host", server.url, "--protocol", "http", "--users", str(n),
           "--spawn-rate", str(n), "--duration", f"{int(LOCUST_START_S + warmup + seconds + 60)}s",
           "--model", server.model, "--corpus", str(corpus), "--max-new-tokens", str(tokens),
           "--min-new-tokens", str(tokens), "--seed", "1", "--out", str(out), "--", "--csv-full-history",
           "--loglevel", "WARNING"]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(out / "locust.log", "w") as logf:
        # A session of its own: --processes forks workers that, left behind, would go on loading the server and
        # report to the next row's master on the same port; the row ends with the whole group.
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            w0 = time.time() - time.monotonic()  # monotonic -> wall, for Locust's timestamps
            deadline = time.monotonic() + LOCUST_START_S
            while not _locust_started(history):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Locust made no request within {LOCUST_START_S:.0f} s "
                                       f"(exit {proc.poll()}); see {out / 'locust.log'}")
                time.sleep(0.2)
            t0, t1, before, after = _window(server, warmup, seconds)
            time.sleep(1.5)  # Locust's history row after the window's end (it writes one a second)
        finally:
            stop_group(proc)
    row = locust_window(history, w0 + t0, w0 + t1)
    return {**row, **server_view(server, before, after, t1 - t0)}


def run_perf_analyzer(server: Server, n: int, tokens: int, out: Path, window_ms: int,
                      binary: Path | None, stability: int) -> dict[str, Any]:
    before, t0 = _snapshot(server), time.monotonic()
    row = perf.run(server.url, [n], tokens, out, window_ms=window_ms, binary=binary, log=log, stability=stability,
                   protocol="http")[0]
    t1, after = time.monotonic(), _snapshot(server)
    keep = ("throughput_utt_s", "latency_p50_ms", "latency_p99_ms")
    return {**{k: row[k] for k in keep}, "errors": 0, **server_view(server, before, after, t1 - t0)}


# --- the report --------------------------------------------------------------------------------
def add_ratios(rows: list[dict]) -> None:
    """Each row's share of perf_analyzer's throughput at its concurrency (None without a reference)."""
    ref = {r["concurrency"]: r["throughput_utt_s"] for r in rows if r["path"] == "perf_analyzer"}
    for r in rows:
        base = ref.get(r["concurrency"])
        r["of_perf_analyzer"] = r["throughput_utt_s"] / base if base else None


def _cell(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def to_markdown(res: dict) -> str:
    lines = [f"# HTTP clients beside perf_analyzer over HTTP: {res['server']}", "",
             f"{res['machine']}; every request forces {res['tokens']} frames of one sentence; closed loops, "
             f"ours measured {res['seconds']:g} s after {res['warmup']:g} s; perf_analyzer its own time windows "
             f"({res['window_ms']} ms, within {res['stability']} %). Prompts/prefill and GPT batch: the engine's, from "
             "the metrics over the window; model batch: Triton's statistics of the model the requests name.", "",
             "| concurrency | path | utt/s | of perf_analyzer | p50 ms | p99 ms | errors | prompts/prefill | GPT batch "
             "| model batch |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        share = r.get("of_perf_analyzer")
        mark = "" if share is None or r["path"] == "perf_analyzer" else (" ✓" if share >= TARGET else " ✗")
        lines.append(
            f"| {r['concurrency']} | {r['path']} | {r['throughput_utt_s']:.1f} | "
            f"{'' if share is None else f'{100 * share:.0f} %{mark}'} | {_cell(r.get('latency_p50_ms'), '.0f')} | "
            f"{_cell(r.get('latency_p99_ms'), '.0f')} | {r.get('errors', 0)} | "
            f"{_cell(r.get('engine_prefill_prompts'), '.1f')} | "
            f"{_cell(r.get('engine_batch'), '.1f')} | {_cell(r.get('model_batch'), '.1f')} |")
    lines += ["", f"command: `{res['command']}`"]
    return "\n".join(lines) + "\n"


def measure(server: Server, paths: Sequence[str], levels: Sequence[int], a: argparse.Namespace) -> list[dict]:
    rows = []
    binary = perf.prepare() if "perf_analyzer" in paths else None
    for n in levels:
        for path in paths:
            log(f"{path} at {n} in flight ...")
            if path == "perf_analyzer":
                try:
                    row = run_perf_analyzer(server, n, a.tokens, a.out / f"perf-c{n}", a.window_ms, binary, a.stability)
                except perf.PerfError as e:  # e.g. never stable on a busy host: the others still run, without ratios
                    log(f"perf_analyzer at {n}: {e}")
                    continue
            elif path in ("asyncio", "tritonclient-aio", "grpc"):
                row = run_asyncio(server, n, a.tokens, perf.TEXT, a.warmup, a.seconds,
                                  as_shipped=path == "tritonclient-aio",
                                  protocol="grpc" if path == "grpc" else "http")
            elif path == "sync":
                row = run_sync(server, n, a.tokens, perf.TEXT, a.warmup, a.seconds)
            elif importlib.util.find_spec("locust") is None:  # e.g. a GPU host whose bundle has no Locust
                log("locust is not installed here: its path is left out")
                continue
            else:
                row = run_locust(server, n, a.tokens, perf.TEXT, a.warmup, a.seconds, a.out / f"locust-c{n}",
                                 a.locust_processes)
            row = {"concurrency": n, "path": path, **row}
            log(f"{path} at {n}: {row['throughput_utt_s']:.1f} utt/s, errors {row.get('errors', 0)}, "
                f"prompts/prefill {_cell(row.get('engine_prefill_prompts'), '.1f')}, "
                f"GPT batch {_cell(row.get('engine_batch'), '.1f')}, "
                f"model batch {_cell(row.get('model_batch'), '.1f')}")
            rows.append(row)
            time.sleep(a.pause)  # the last requests drain before the next path starts
    add_ratios(rows)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.http_clients", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's HTTP HOST:PORT")
    where.add_argument("--repo", type=Path, help="an exported repository, started here through the launcher")
    where.add_argument("--standin", action="store_true", help="serve loadtest.standin's model (no GPU work) here")
    ap.add_argument("--metrics-url", help="the running server's metrics HOST:PORT (with --url)")
    ap.add_argument("--grpc-url", help="the running server's gRPC HOST:PORT (with --url, for the grpc path)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="a flag for python -m chattts_triton.serve (--repo)")
    ap.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--concurrency", default="64,256", help="comma-separated levels")
    ap.add_argument("--tokens", type=int, default=150, help="frames every request forces (MIN = MAX)")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured window of each of our paths")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--pause", type=float, default=3.0, help="seconds between paths")
    ap.add_argument("--window-ms", type=int, default=5000, help="perf_analyzer's measurement window")
    ap.add_argument("--stability", type=int, default=25, help="perf_analyzer's --stability-percentage")
    ap.add_argument("--locust-processes", type=int, default=1, help="Locust worker processes (its --processes)")
    ap.add_argument("--machine", default=f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "http-clients")
    a = ap.parse_args(argv)
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths {a.paths!r}: a comma-separated list of {', '.join(PATHS)}")
    if "grpc" in paths and a.url and not a.grpc_url:
        ap.error("the grpc path of a running server needs its --grpc-url")
    try:
        levels = [int(c) for c in a.concurrency.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        ap.error("--concurrency: comma-separated whole numbers >= 1")
    if a.tokens < 1 or a.seconds <= 0 or a.warmup < 0:
        ap.error("--tokens and --seconds must be > 0, --warmup >= 0")
    if a.locust_processes < 1:
        ap.error("--locust-processes must be >= 1")
    if "locust" in paths and a.locust_processes > 1 and a.seconds < LOCUST_MIN_SECONDS:
        ap.error(f"--seconds {a.seconds:g}: with --locust-processes > 1 the window must be >= {LOCUST_MIN_SECONDS:g} s "
                 f"(Locust's workers report their totals every {LOCUST_REPORT_S:g} s)")
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    def stop():
        return None
    if a.repo:  # the shipped path, as a container starts it
        from chattts_triton.launcher.serve import Launched

        launched = Launched(a.repo, a.out / "tritonserver.log", args=a.serve_arg, ready_timeout_s=900).start()
        server = Server(launched.http_url, launched.metrics_url, launched.grpc_url)
        stop, what = launched.stop, f"launcher on {a.repo}"
    elif a.standin:
        from chattts_triton.launcher.tritonserver import TritonServer
        from loadtest.standin import write_repo

        ts = TritonServer(write_repo(a.out / "standin-repo", a.tokens), log_file=a.out / "tritonserver.log")
        ts.start()
        server = Server(ts.http_url, f"{ts.host}:{ts.metrics_port}", ts.grpc_url)
        stop, what = ts.stop, "loadtest.standin (no model)"
    else:
        server, what = Server(a.url, a.metrics_url, a.grpc_url), f"server at {a.url}"
    try:
        rows = measure(server, paths, levels, a)
    finally:
        stop()
    res = {"server": what, "machine": a.machine, "tokens": a.tokens, "seconds": a.seconds, "warmup": a.warmup,
           "window_ms": a.window_ms, "stability": a.stability,
           "command": " ".join(["python -m bench.http_clients", *(argv or sys.argv[1:])]),
           "rows": rows}
    (a.out / "http-clients.json").write_text(json.dumps(res, indent=1))
    md = to_markdown(res)
    (a.out / "http-clients.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
