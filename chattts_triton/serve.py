"""Run tritonserver in the foreground on a model repository.

    python -m chattts_triton.serve --repo build/repo [--http-port 8000] [--grpc-port 8001]
        [--metrics-port 8002] [--host 127.0.0.1] [--log-file F] [-- EXTRA TRITONSERVER ARGS]

Binds to 127.0.0.1 unless told otherwise, waits until the server and every model are ready,
prints the URLs, and on SIGINT/SIGTERM lets Triton drain in-flight requests (up to
--exit-timeout seconds) before it exits with the server's status. Port 0 picks a free port.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional

from .tritonserver import LOCALHOST, TritonServer, TritonServerError


def _port(text: str) -> Optional[int]:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port")
    return value or None  # 0: let the launcher pick a free one


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m chattts_triton.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", required=True, type=Path, help="model repository")
    p.add_argument("--http-port", type=_port, default=8000)
    p.add_argument("--grpc-port", type=_port, default=8001)
    p.add_argument("--metrics-port", type=_port, default=8002)
    p.add_argument("--host", default=LOCALHOST, help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it)")
    p.add_argument("--log-file", type=Path, default=None, help="server log (default: a temporary file)")
    p.add_argument("--exit-timeout", type=int, default=30, help="seconds Triton may drain on shutdown")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument(
        "--stub-pythonpath", action="append", default=[], type=Path,
        help="package folder only the python-backend stub sees, searched first (repeatable)",
    )
    args = p.parse_args(argv)
    if not args.repo.is_dir():
        p.error(f"--repo {args.repo} is not a directory")
    args.extra = extra
    return args


def _exit_status(returncode: Optional[int]) -> int:
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128+N


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.host not in (LOCALHOST, "localhost"):
        print(f"warning: binding to {args.host}: the server is reachable from other hosts", file=sys.stderr)
    server = TritonServer(
        args.repo,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        log_file=args.log_file,
        exit_timeout_s=args.exit_timeout,
        startup_timeout_s=args.startup_timeout,
        extra_args=args.extra,
        extra_pythonpath=args.stub_pythonpath,
    )
    stopping: List[int] = []
    signalled: List[bool] = []

    def drain() -> None:
        if server.pid is not None and not signalled:
            signalled.append(True)
            server.send_signal(signal.SIGTERM)  # Triton drains in-flight requests, then exits

    def on_signal(signum, _frame):
        stopping.append(signum)
        if len(stopping) > 1 and server.pid is not None:
            print("second signal: killing tritonserver", file=sys.stderr, flush=True)
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except OSError:
                pass
        drain()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"log: {server.log_path}", flush=True)
    try:
        server.start()
    except TritonServerError as e:
        server.stop()
        if stopping:  # interrupted while loading: not an error
            return _exit_status(server.returncode)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"tritonserver pid {server.pid} ready", flush=True)
    print(f"http: {server.http_url}\ngrpc: {server.grpc_url}\nmetrics: {server.metrics_url}", flush=True)
    try:
        while server.returncode is None:
            if stopping:
                drain()  # the signal may have come before the process existed
                deadline = time.monotonic() + args.exit_timeout + 15
                while server.returncode is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                break
            time.sleep(0.2)
    finally:
        code = server.stop()  # kills whatever is left (stubs, a server past its drain time)
    if not stopping:
        print(f"error: tritonserver exited unexpectedly ({code}); last log lines:\n{server.log_tail()}", file=sys.stderr)
    return _exit_status(code)


if __name__ == "__main__":
    sys.exit(main())
