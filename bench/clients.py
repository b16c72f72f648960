"""Closed-loop load from several client processes: one asyncio client queues its own requests.

`python -m bench.probes.client_capacity --stream` (`results/raw/2026-12-02-*-client-capacity-stream-*`):
64 streams against a stand-in server that sends each first chunk 90 ms after the request arrived.

| host | client processes | first chunk p50 / p99 ms | request's way in p99 ms | first chunk's way out p99 ms |
|---|---|---|---|---|
| H200 host, 16 cores | 1 | 100.9 / **133.9** | 42.8 | 14.4 |
| H200 host, 16 cores | 4 | 94.8 / **103.1** | 11.9 | 1.5 |
| CI box, 2 cores | 1 | 96.1 / 119.6 (137.2 in another run) | 26.2 | 13.7 |
| CI box, 2 cores | 4 | 99.6 / 123.8 | 32.3 | 6.2 |

One stream: 92.8 / 93.3 ms. So at 64 one client process adds ≈ 31 ms to the p99 that four do not
(the two cores of the CI box hold the stand-in and every client: no gain there). `bench.run` spreads
its streams over `STREAM_CLIENT_PROCS` processes (`--stream-procs`).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

Sync = Callable[[], None]
Entry = Callable[..., Awaitable[dict[str, Any]]]  # entry(*share, sync) -> raw results of one process


def shares(concurrency: int, procs: int) -> list[int]:
    """`concurrency` clients split as evenly as possible over at most `procs` processes (none empty)."""
    if concurrency < 1 or procs < 1:
        raise ValueError(f"concurrency and processes must be at least 1 (got {concurrency}, {procs})")
    procs = min(procs, concurrency)
    return [concurrency // procs + (i < concurrency % procs) for i in range(procs)]


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each key over the processes: lists concatenated, numbers summed (times: the largest)."""
    out: dict[str, Any] = {}
    for r in results:
        for k, v in r.items():
            if isinstance(v, list):
                out.setdefault(k, []).extend(v)
            elif k.endswith("_s"):
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0) + v
    return out


def _child(index: int, entry: Entry, share: tuple, go, abort, results, timeout_s: float) -> None:
    def sync() -> None:
        results.put((index, "ready", None))
        if not go.wait(timeout_s):
            raise TimeoutError("the parent never started the window")
        if abort.is_set():
            raise RuntimeError("aborted: another client process failed")

    try:
        results.put((index, "ok", asyncio.run(entry(*share, sync))))
    except BaseException as e:  # noqa: BLE001  reported to the parent, which raises it
        results.put((index, "error", f"{type(e).__name__}: {e}"))


def run(entry: Entry, process_shares: Sequence[tuple], before_window: Sync, timeout_s: float = 900.0) -> dict[str, Any]:
    """`entry(*share, sync)` for each share, merged (`merge`). Each call warms up, calls `sync()`
    (in a thread), then runs its timed window; `before_window()` runs once, after every call's
    warm-up and before any window (the server's counters are read there). One share runs in this
    process; more run one per spawned process. A process that fails or dies fails the run, with
    its error, and the others stop before their windows (or are ended in them)."""
    if len(process_shares) == 1:
        return asyncio.run(entry(*process_shares[0], before_window))
    ctx = mp.get_context("spawn")
    go, abort, results = ctx.Event(), ctx.Event(), ctx.Queue()
    children = [ctx.Process(target=_child, args=(i, entry, s, go, abort, results, timeout_s), daemon=True)
                for i, s in enumerate(process_shares)]
    for c in children:
        c.start()
    ok = False
    try:
        _collect(results, children, "ready", timeout_s)
        before_window()
        go.set()
        merged = merge(_collect(results, children, "ok", timeout_s))
        ok = True
        return merged
    finally:
        if not ok:
            abort.set()
        go.set()
        for c in children:
            c.join(5 if ok else 1)
            if c.is_alive():
                c.terminate()
                c.join(5)


def _collect(results, children, status: str, timeout_s: float) -> list[Any]:
    """One `status` message per child, in the children's order; a child's error, its death before
    it reported, or silence past `timeout_s` raises."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(children):
        try:
            index, kind, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [c.exitcode for i, c in enumerate(children) if i not in got and c.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a client process died (exit code {dead[0]})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the client processes did not report '{status}' within {timeout_s:.0f} s") from None
            continue
        if kind == "error":
            raise RuntimeError(f"a client process failed: {value}")
        if kind != status:
            raise RuntimeError(f"client process {index} sent '{kind}' while '{status}' was awaited")
        got[index] = value
    return [got[i] for i in range(len(children))]
