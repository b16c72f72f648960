"""Who holds the GIL in a model's python-backend process, per request served.

    python -m bench.probes.gil --repo REPO [--model chattts_gpt] [--concurrency 16] [--seconds 20] [--tokens 20]

Starts `tritonserver` on REPO, drives `chattts` with closed-loop gRPC clients (`bench.run.hold`), and samples the
model's stub process with `py-spy record --gil` (only the thread holding the GIL is sampled). Prints,
per thread, the milliseconds of GIL held per request the model answered in the window, and how much
of it was in the frames of `--focus` functions. The GPT engine's thread needs the GIL after every
step's host sync: what the model's other threads hold is time a step can wait.
Needs ptrace rights over the stub (root, or CAP_SYS_PTRACE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

THREAD = re.compile(r"^thread \(\d+\): ")


def gil_ms_per_request(raw_lines: Iterable[str], rate_hz: float, requests: float,
                       focus: list[str] = ()) -> dict[str, dict[str, float]]:
    """From `py-spy record --gil --threads --format raw` lines ("frame;frame;... count"): per
    thread, GIL-held ms per request, and of it the ms inside each `focus` function."""
    held: Counter = Counter()
    inside: dict[str, Counter] = {}
    for line in raw_lines:
        line = line.rstrip()
        if not line:
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread = THREAD.sub("", frames[0])
        held[thread] += int(count)
        for f in focus:
            if any(fr.split(" (")[0].endswith(f) for fr in frames[1:]):
                inside.setdefault(thread, Counter())[f] += int(count)
    scale = 1000.0 / rate_hz / max(requests, 1.0)
    return {t: {"held_ms": round(n * scale, 3), **{f"in {f}": round(k * scale, 3)
                                                   for f, k in inside.get(t, {}).items()}}
            for t, n in held.most_common()}


def _find_py_spy():
    import shutil

    # beside this Python (a venv), in a `pip install --target` folder's bin/ (the GPU host's bundle), on PATH
    for candidate in [Path(sys.executable).parent / "py-spy"] + [Path(p) / "bin" / "py-spy" for p in sys.path if p]:
        if candidate.is_file():
            return str(candidate)
    return shutil.which("py-spy")


def _successes(metrics_url: str, model: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("nv_inference_request_success{") and f'model="{model}"' in line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, required=True)
    ap.add_argument("--model", default="chattts_gpt")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--warmup", type=float, default=6.0)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--focus", default="_count,get_input_tensor_by_name,GPTService.execute,_reply",
                    help="functions whose share of the GIL is reported")
    ap.add_argument("--out", type=Path, default=None, help="JSON result")
    ap.add_argument("--py-spy", default=None, help="the py-spy binary (default: beside this Python, else on PATH)")
    a = ap.parse_args(argv)
    spy_bin = a.py_spy or _find_py_spy()
    if spy_bin is None:
        print("py-spy not found: pip install py-spy (requirements.txt pins it), or pass --py-spy", file=sys.stderr)
        return 2
    from bench.run import hold
    from chattts_triton.launcher.tritonserver import TritonServer

    raw = (a.out.with_suffix(".pyspy.txt") if a.out else Path("/tmp/bench-gil.pyspy.txt"))
    raw.parent.mkdir(parents=True, exist_ok=True)
    with TritonServer(a.repo, log_file=a.repo.parent / "bench-gil-tritonserver.log", startup_timeout_s=900) as server:
        pids = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub.*/{a.model}/"], capture_output=True,
                              text=True).stdout.split()
        if not pids:
            print(f"no stub process of {a.model}", file=sys.stderr)
            return 2
        load_s = a.warmup + a.seconds + 10  # outlasts py-spy's window, start-up included
        loader = threading.Thread(target=lambda: asyncio.run(hold(server.grpc_url, server.metrics_url, a.tokens,
                                                                  a.concurrency,
                                                                  load_s, every_s=load_s)), daemon=True)
        loader.start()
        time.sleep(a.warmup)
        n0 = _successes(server.metrics_url, a.model)
        spy = subprocess.run([spy_bin, "record", "--pid", pids[0], "--duration", str(a.seconds),
                              "--threads", "--gil", "--format", "raw", "--rate", str(a.rate), "--output", str(raw)],
                             capture_output=True, text=True)
        n = _successes(server.metrics_url, a.model) - n0
        loader.join(120)
    if spy.returncode != 0 or not raw.is_file():
        print(f"py-spy failed ({spy.returncode}): {spy.stderr.strip()[-500:]}", file=sys.stderr)
        return 2
    rows = gil_ms_per_request(raw.read_text().splitlines(), a.rate, n, a.focus.split(","))
    res = {"model": a.model, "concurrency": a.concurrency, "seconds": a.seconds, "requests": n,
           "requests_per_s": round(n / a.seconds, 2), "tokens": a.tokens, "gil_ms_per_request": rows}
    print(f"{a.model}: {n:.0f} requests in {a.seconds} s ({n / a.seconds:.1f}/s); GIL held, ms per request:")
    for thread, r in rows.items():
        print(f"  {thread:28s} {r['held_ms']:8.3f}" + "".join(f"   {k} {v:.3f}" for k, v in r.items()
                                                              if k != "held_ms"))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
