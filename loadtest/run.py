"""Headless Locust run against a running server, results under --out:

    python -m loadtest.run --host 127.0.0.1:8001 --users 8 --spawn-rate 2 --duration 60s \
        --protocol grpc --out build/loadtest

writes OUT/stats_stats.csv (+ _failures, _exceptions, _stats_history), OUT/report.html and
OUT/tts_stats.json (audio seconds, real-time factor, failures by status). `--stream` runs the
streaming users on the decoupled `chattts_stream` model instead (first-chunk latency, chunk gaps,
stalls). Checks first that the server and model are ready, so an unreachable server is one clear
error, not thousands of failed requests.
Exit status: Locust's (0 = no failed request), 1 if the server is not ready, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from client.client import DEFAULT_URLS, PROTOCOLS, ChatTTSClient
from client.contract import MODEL, STREAM_MODEL

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
USER_CLASSES = {"grpc": "TritonGrpcUser", "http": "TritonHttpUser"}
STREAM_USER_CLASSES = {"grpc": "TritonGrpcStreamUser", "http": "TritonHttpStreamUser"}
DURATION_RE = re.compile(r"^(\d+h)?(\d+m)?(\d+s?)?$")
EXIT_NOT_READY = 1


def _duration(value: str) -> str:
    if not value or not DURATION_RE.match(value) or value in ("0", "0s"):
        raise argparse.ArgumentTypeError(f"duration like 30s, 5m or 1h30m, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", help=f"HOST:PORT (default {DEFAULT_URLS['grpc']} for grpc, {DEFAULT_URLS['http']} for "
                                  "http)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
    p.add_argument("--users", type=int, default=4, help="concurrent users (one request in flight each)")
    p.add_argument("--spawn-rate", type=float, default=1.0, help="users started per second")
    p.add_argument("--duration", type=_duration, default="60s", help="run time, e.g. 30s, 5m")
    p.add_argument("--out", default="build/loadtest", help="output folder")
    p.add_argument("--model", help=f"default {MODEL}, or {STREAM_MODEL} with --stream")
    p.add_argument("--stream", action="store_true", help="streaming users (first chunk, chunk gaps)")
    p.add_argument("--corpus", help="utterances, one per line (default loadtest/corpus.txt)")
    p.add_argument("--max-new-tokens", type=int, help="MAX_NEW_TOKENS of every request")
    p.add_argument("--min-new-tokens", type=int, help="MIN_NEW_TOKENS of every request (equal to max: fixed length)")
    p.add_argument("--seed", type=int, help="SEED of every request and of the utterance order")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (per chunk with --stream)")
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish at the end")
    p.add_argument("--wait-ready", type=float, default=30.0, help="seconds to wait for the server to be ready")
    p.add_argument("--locustfile", default=str(LOCUSTFILE))
    p.add_argument("locust_args", nargs=argparse.REMAINDER, help="after --: passed to locust unchanged")
    return p


def model_of(args: argparse.Namespace) -> str:
    return args.model or (STREAM_MODEL if args.stream else MODEL)


def locust_command(args: argparse.Namespace, host: str, out: Path) -> list[str]:
    cmd = [
        sys.executable, "-m", "locust",
        "-f", args.locustfile,
        "--headless",
        "--users", str(args.users),
        "--spawn-rate", f"{args.spawn_rate:g}",
        "--run-time", args.duration,
        "--stop-timeout", f"{args.stop_timeout:g}",
        "--host", host,
        "--csv", str(out / "stats"),
        "--html", str(out / "report.html"),
        "--tts-stream-model" if args.stream else "--tts-model", model_of(args),
        "--tts-timeout", f"{args.timeout:g}",
        "--tts-stats-out", str(out / "tts_stats.json"),
    ]  # fmt: skip
    for flag, value in (
        ("--tts-corpus", args.corpus),
        ("--tts-max-new-tokens", args.max_new_tokens),
        ("--tts-min-new-tokens", args.min_new_tokens),
        ("--tts-seed", args.seed),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    extra = [a for a in (args.locust_args or []) if a != "--"]
    return cmd + extra + [(STREAM_USER_CLASSES if args.stream else USER_CLASSES)[args.protocol]]


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.users < 1 or args.spawn_rate <= 0 or args.timeout <= 0 or args.stop_timeout < 0:
        p.error("--users, --spawn-rate and --timeout must be positive")
    host = (args.host or DEFAULT_URLS[args.protocol]).split("://", 1)[-1].rstrip("/")
    out = Path(args.out).resolve()  # locust runs from the repository root
    args.locustfile = str(Path(args.locustfile).resolve())
    out.mkdir(parents=True, exist_ok=True)

    with ChatTTSClient(host, protocol=args.protocol, model=model_of(args), retries=0) as probe:
        try:
            probe.wait_until_ready(timeout_s=args.wait_ready)
        except Exception as e:  # noqa: BLE001  not ready, whatever the failure: say so and exit
            print(f"error: {e} (is the server running? check --host and --protocol)", file=sys.stderr)
            return EXIT_NOT_READY

    cmd = locust_command(args, host, out)
    print("+ " + " ".join(cmd), flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    rc = subprocess.call(cmd, env=env, cwd=REPO_ROOT)
    print(f"results: {out}/stats_stats.csv, {out}/report.html, {out}/tts_stats.json (locust exit {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
