"""Stream against unary on the CPU, served: `python -m bench.probes.cpu_stream --variant NAME=REPO [K=V ...] ...`.

Each variant is a repository plus environment settings for the launcher (`python -m chattts_triton.serve`,
started by `Launched` on free ports). The variants are served in turn, `--cycles` times (a fresh server each
time, so that a machine whose load drifts meets every variant alike); on each, `--rounds` rounds of one
unary request (`ChatTTSClient.synthesize`, `chattts` ensemble) and one stream (`.stream`, `chattts_stream`)
of the same sentence, seed and `--frames` forced code frames, alternating which goes first. Per request:
its latency (stream: first chunk and whole), the engine's decode steps and their mean wall time from the
server's metrics (`chattts_engine_step_seconds` / `_steps` of the model that generated), the stream's own
first-tokens and first-chunk times, the load average, and the CPU time of every thread of the engine's
stub process (`/proc/PID/task/*/stat`), so that an OpenMP worker that spins or sleeps shows.

Prints a line per request and a summary per variant (medians: first chunk ÷ unary, whole stream ÷ unary,
step ms of either engine) and writes --out as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from chattts_triton.config import GPT, STREAM
from chattts_triton.launcher.serve import Launched

TEXT = "四川美食确实以辣闻名。"
METRICS = ("chattts_engine_steps", "chattts_engine_step_seconds", "chattts_engine_prefill_seconds",
           "chattts_stream_first_tokens_seconds", "chattts_stream_first_chunk_seconds", "chattts_stream_codec_seconds",
           "chattts_stream_codec_calls")


def log(msg: str) -> None:
    print(f"[cpu_stream {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def scrape(url: str) -> dict[tuple[str, str], float]:
    """{(model, metric): value} of the engine and stream counters, summed over instances."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0]
        if name not in METRICS:
            continue
        model = line.split('model="', 1)[1].split('"', 1)[0] if 'model="' in line else ""
        out[(model, name)] = out.get((model, name), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def stub_pid(server_pid: int, model: str) -> int | None:
    """The python-backend stub of `model`'s first instance (its command line names the instance)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == server_pid and f"{model}_0_0".encode() in cmd:
            return int(pid)
    return None


def thread_ticks(pid: int | None) -> dict[str, int]:
    """{'name/tid': utime + stime} of every thread of `pid`."""
    out: dict[str, int] = {}
    if pid is None:
        return out
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat.split("(", 1)[1].rsplit(")", 1)[0]
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{name}/{tid}"] = int(fields[11]) + int(fields[12])
    return out


def busiest(before: dict[str, int], after: dict[str, int], n: int = 4) -> list[tuple[str, int]]:
    d = [(k, v - before.get(k, 0)) for k, v in after.items()]
    return sorted((x for x in d if x[1] > 0), key=lambda x: -x[1])[:n]


def one(kind: str, client, options: dict, metrics_url: str, pids: dict[str, int | None]) -> dict:
    model = GPT if kind == "unary" else STREAM
    m0, t0 = scrape(metrics_url), thread_ticks(pids[model])
    start = time.perf_counter()
    row: dict = {"kind": kind, "load": os.getloadavg()[0]}
    if kind == "unary":
        client.synthesize(TEXT, **options)
    else:
        for _ in client.stream(TEXT, **options):
            row.setdefault("first_s", time.perf_counter() - start)
    row["total_s"] = time.perf_counter() - start
    t1 = thread_ticks(pids[model])
    time.sleep(0.6)  # the gauges are refreshed every 0.25 s
    m1 = scrape(metrics_url)
    d = {k: m1.get((model, k), 0.0) - m0.get((model, k), 0.0) for k in METRICS}
    row["steps"] = d["chattts_engine_steps"]
    row["step_ms"] = 1000 * d["chattts_engine_step_seconds"] / max(1.0, d["chattts_engine_steps"])
    row["prefill_s"] = d["chattts_engine_prefill_seconds"]
    if kind == "stream":
        row["server_first_tokens_s"] = d["chattts_stream_first_tokens_seconds"]
        row["server_first_chunk_s"] = d["chattts_stream_first_chunk_seconds"]
        row["codec_s"], row["codec_calls"] = d["chattts_stream_codec_seconds"], d["chattts_stream_codec_calls"]
    row["threads"] = busiest(t0, t1)
    return row


def run_variant(name: str, repo: Path, env: dict[str, str], rounds: int, frames: int, seed: int, first: str,
                log_dir: Path) -> list[dict]:
    from client.client import ChatTTSClient

    options = dict(seed=seed, max_new_tokens=frames, min_new_tokens=frames)
    with Launched(repo, log_dir / f"cpu-stream-{name}.tritonserver.log", env={**os.environ, **env},
                  ready_timeout_s=900, supervise=False) as server:
        pids = {m: stub_pid(server.server_pid, m) for m in (GPT, STREAM)}
        rows = []
        with ChatTTSClient(server.grpc_url, protocol="grpc", timeout_s=600) as client:
            for kind in ("unary", "stream"):  # warm-up: the first request of each path pays one-time costs
                one(kind, client, options, server.metrics_url, pids)
            for r in range(rounds):
                order = ("unary", "stream") if (r % 2 == 0) == (first == "unary") else ("stream", "unary")
                pair = {}
                for kind in order:
                    pair[kind] = one(kind, client, options, server.metrics_url, pids)
                u, s = pair["unary"], pair["stream"]
                row = {"variant": name, "round": r, "unary": u, "stream": s,
                       "first_ratio": s["first_s"] / u["total_s"], "whole_ratio": s["total_s"] / u["total_s"]}
                log(f"{name} r{r}: unary {u['total_s']:.2f} s ({u['step_ms']:.1f} ms/step) | stream first "
                    f"{s['first_s']:.2f} s ({row['first_ratio']:.3f}), whole {s['total_s']:.2f} s "
                    f"({row['whole_ratio']:.2f}), "
                    f"{s['step_ms']:.1f} ms/step | load {u['load']:.1f}/{s['load']:.1f} | gpt {u['threads']} | stream "
                    f"{s['threads']}")
                rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        def med(xs):
            return round(statistics.median(xs), 4)
        out[name] = {
            "pairs": len(mine),
            "unary_s": med([r["unary"]["total_s"] for r in mine]),
            "first_s": med([r["stream"]["first_s"] for r in mine]),
            "whole_s": med([r["stream"]["total_s"] for r in mine]),
            "first_ratio": med([r["first_ratio"] for r in mine]),
            "whole_ratio": med([r["whole_ratio"] for r in mine]),
            "gpt_step_ms": med([r["unary"]["step_ms"] for r in mine]),
            "stream_step_ms": med([r["stream"]["step_ms"] for r in mine]),
            "load": med([r["unary"]["load"] for r in mine]),
        }
    return out


def parse_variant(text: str) -> tuple[str, Path, dict[str, str]]:
    """NAME=REPO [K=V ...] → (name, repo, env)."""
    head, *rest = text.split()
    name, repo = head.split("=", 1)
    env = dict(kv.split("=", 1) for kv in rest)
    return name, Path(repo), env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", required=True, type=parse_variant,
                    help="'NAME=REPO [ENV=VALUE ...]' (repeatable): served in turn")
    ap.add_argument("--cycles", type=int, default=1, help="how often every variant is served in turn")
    ap.add_argument("--rounds", type=int, default=3, help="unary + stream pairs per server")
    ap.add_argument("--frames", type=int, default=96, help="forced code frames per request")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--first", choices=("unary", "stream"), default="unary", help="which the first round starts with")
    ap.add_argument("--out", type=Path, default=None, help="JSON of every request and the summary")
    a = ap.parse_args(argv)
    log_dir = (a.out.parent if a.out else Path("build"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for c in range(a.cycles):
        for name, repo, env in a.variant:
            log(f"cycle {c}: {name} ({repo}, {env or 'no env'}), load {os.getloadavg()[0]:.1f}")
            rows += run_variant(name, repo, env, a.rounds, a.frames, a.seed, a.first, log_dir)
    summ = summary(rows)
    for name, s in summ.items():
        print(f"{name}: {s}")
    if a.out:
        a.out.write_text(json.dumps({"date": dt.date.today().isoformat(), "text": TEXT, "frames": a.frames,
                                     "cpus": os.cpu_count(), "summary": summ, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
