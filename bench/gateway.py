"""What the speech gateway costs: the gateway (`python -m gateway`, HTTP) against the same calls straight to Triton
over gRPC (`client.AsyncChatTTSClient`), on one server.

    python -m bench.gateway --repo build/repo-tiny --out bench/results/DATE-cpu-gateway     # starts both
    python -m bench.gateway --repo REPO --grpc-url HOST:8001 --out OUT                      # a running server

Without --grpc-url the server is started as it ships, by the launcher (`python -m chattts_triton.serve`,
--serve-arg passes it flags); the gateway always runs here, with this interpreter.

1. Concurrency 1, whole wav: paired requests (direct, then through the gateway), p50 of each and of the pairs'
   differences: the overhead (issue target ≤ 5 ms p50).
2. Concurrency 1, streams: the first chunk of `chattts_stream` over gRPC against the first byte of the gateway's
   streamed pcm and mp3 (target ≤ first chunk + 10 ms).
3. Concurrency C (default 256), whole wav: closed loops for --seconds, direct and through the gateway in
   alternating phases (D G G D D G …), requests/s of each by Little's law (target: the gateway ≥ 95 % of
   direct), with the gateway process's CPU time per request.
4. Encoding: CPU time per second of audio of each format, whole files and streams (4096-sample chunks), on audio
   the server made.

--workers 1,2,4 measures 1-3 once per gateway size (`python -m gateway --workers N`, a fresh gateway for each) against
the same server; the encoders are measured once.

Every request forces --tokens code frames (MIN = MAX_NEW_TOKENS), as bench.run does. Where PyAV (FFmpeg) cannot
be imported (tools.bundle leaves it out) the gateway serves whole wav, flac and pcm and streamed pcm only: what
needs FFmpeg (the first mp3 byte, mp3/opus/aac, streamed wav and flac) is left out and the report says so.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from chattts_triton.config import SAMPLE_RATE, samples_for_codes
from gateway.app import DEFAULT_WORKERS

TEXT = "The quick brown fox jumps over the lazy dog."


def log(msg: str) -> None:
    print(f"[bench.gateway] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def pyav_missing() -> str | None:
    """Why PyAV cannot be imported here (and so in the gateway this starts), or None."""
    try:
        import av  # noqa: F401  imported only to see whether it can be
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def decode(data: bytes, fmt: str, pyav: bool) -> np.ndarray:
    """gateway.audio.decode (FFmpeg); without PyAV, libsndfile reads wav, flac and G.711 (float32 = int16 / 32768
    alike)."""
    from gateway.audio import decode as ffmpeg_decode

    if pyav or fmt == "pcm":
        return ffmpeg_decode(data, fmt)
    import soundfile

    from gateway.audio import G711

    raw = dict(format="RAW", subtype=G711[fmt], samplerate=SAMPLE_RATE, channels=1) if fmt in ("ulaw", "alaw") else {}
    return soundfile.read(io.BytesIO(data), dtype="float32", **raw)[0]


def closed_loop_rate(spans: list[tuple], concurrency: int, steady: float, stop: float) -> dict[str, float]:
    """Requests/s of `concurrency` closed loops from their requests' (begun, ended) times: by Little's law,
    concurrency / mean latency of the requests begun in [steady, stop). Equal requests begun together finish
    together, in waves of up to `concurrency`, so a count of the completions in a window (`counted_rps`, kept
    beside it) moves by a whole wave with where the window falls; every request's latency counts in the mean,
    wherever the window falls. Failed requests are not in the rate: the caller counts them beside it."""
    latencies = [end - begun for begun, end in spans if steady <= begun < stop]
    counted = sum(steady <= end <= stop for _, end in spans)
    mean = statistics.mean(latencies) if latencies else float("nan")
    return {"steady_requests": len(latencies), "mean_latency_s": mean,
            "rps": concurrency / mean if latencies else 0.0, "counted_rps": counted / (stop - steady)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live descendants (`python -m gateway --workers N` serves from
    child processes; Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # gone meanwhile
            continue
    return total / os.sysconf("SC_CLK_TCK")


class Gateway:
    """`python -m gateway` on a free port until closed."""

    def __init__(self, grpc_url: str, repo: Path | None, log_file: Path, args: list[str]):
        import subprocess
        import urllib.request

        from chattts_triton.launcher.tritonserver import free_port, set_parent_death_signal

        self.port = free_port()
        cmd = [sys.executable, "-m", "gateway", "--grpc-url", grpc_url, "--port", str(self.port), "--log-level",
               "warning",
               *(["--repo", str(repo)] if repo else []), *args]
        self.out = open(log_file, "wb")
        # SIGTERM when this process dies, as the server gets: no gateway left behind by an interrupted bench
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, preexec_fn=set_parent_death_signal)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway did not start: {log_file.read_text()}") from e
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.out.close()


async def run(a: argparse.Namespace, grpc_url: str, gateway: Gateway, encoding: bool = True) -> dict[str, object]:  # noqa: C901  a benchmark's script, its stages one after another
    """1-3 through `gateway` against direct gRPC, and 4 where `encoding`."""
    import aiohttp

    from client import AsyncChatTTSClient
    from gateway.audio import FORMATS, STREAM_WITHOUT_PYAV, WHOLE_WITHOUT_PYAV, StreamEncoder, encode

    fixed = {"max_new_tokens": a.tokens, "min_new_tokens": a.tokens}
    options = {"voice": "alloy", "prompt": "[speed_5]", "seed": 1, **fixed}
    body = {"model": "chattts", "input": TEXT, "voice": "alloy", "seed": 1, "stream": False, "response_format": "wav",
            **fixed}
    # the same client the gateway holds, with as many connections: all of a channel's calls share one HTTP/2
    # connection, so a comparison with fewer would measure the connection, not the gateway
    direct = AsyncChatTTSClient(grpc_url, retries=0, max_concurrency=1 << 20, channels=a.channels)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))
    speech = gateway.url + "/v1/audio/speech"
    no_pyav = pyav_missing()
    pyav = no_pyav is None
    first_byte_formats = [f for f in ("pcm", "mp3") if pyav or f in STREAM_WITHOUT_PYAV]
    result: dict[str, object] = {"pyav": {"available": pyav, "error": no_pyav}, "skipped": []}
    if not pyav:
        why = f"PyAV cannot be imported ({no_pyav}): FFmpeg makes these"
        result["skipped"] = [
            {"what": "concurrency 1, first mp3 byte", "why": why},
            {"what": "encoding, whole files: " + ", ".join(f for f in FORMATS if f not in WHOLE_WITHOUT_PYAV),
             "why": why},
            {"what": "encoding, streams: " + ", ".join(f for f in FORMATS if f not in STREAM_WITHOUT_PYAV), "why": why},
        ]
        log(f"without PyAV ({no_pyav}): wav and pcm only")

    async def via_gateway(b: dict) -> bytes:
        async with http.post(speech, json=b) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"gateway {r.status}: {data[:300]!r}")
            return data

    async def first_byte(b: dict) -> float:
        t0 = time.perf_counter()
        async with http.post(speech, json=b) as r:
            assert r.status == 200, await r.read()
            await r.content.readany()
            t = time.perf_counter() - t0
            await r.read()
        return t

    async def first_chunk() -> float:
        t0 = time.perf_counter()
        chunks = direct.stream(TEXT, split=False, voice_from_first=False, **options)
        await chunks.__anext__()
        t = time.perf_counter() - t0
        async for _ in chunks:
            pass
        return t

    try:
        audio = await direct.infer_one(TEXT, options)  # warm both paths
        assert audio.size == samples_for_codes(a.tokens), audio.size
        for _ in range(3):
            assert decode(await via_gateway(body), "wav", pyav).size == audio.size
            await first_chunk()
            await first_byte({**body, "stream": True, "response_format": "pcm"})

        # 1. concurrency 1, whole wav
        d, g = [], []
        for _ in range(a.requests):
            t0 = time.perf_counter()
            await direct.infer_one(TEXT, options)
            d.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await via_gateway(body)
            g.append(time.perf_counter() - t0)
        diff = [x - y for x, y in zip(g, d, strict=True)]
        result["c1_wav"] = {"requests": a.requests, "direct_p50_ms": pct(d, 50) * 1e3,
                            "direct_p90_ms": pct(d, 90) * 1e3,
                            "gateway_p50_ms": pct(g, 50) * 1e3, "gateway_p90_ms": pct(g, 90) * 1e3,
                            "overhead_p50_ms": (pct(g, 50) - pct(d, 50)) * 1e3,
                            "paired_overhead_p50_ms": statistics.median(diff) * 1e3}
        log(f"concurrency 1, wav: {result['c1_wav']}")

        # 2. concurrency 1, first chunk against first byte
        rows = {}
        for fmt in first_byte_formats:
            fc, fb = [], []
            for _ in range(a.requests):
                fc.append(await first_chunk())
                fb.append(await first_byte({**body, "stream": True, "response_format": fmt}))
            rows[fmt] = {"first_chunk_p50_ms": pct(fc, 50) * 1e3, "first_byte_p50_ms": pct(fb, 50) * 1e3,
                         "later_p50_ms": (pct(fb, 50) - pct(fc, 50)) * 1e3,
                         "paired_later_p50_ms": statistics.median([b - c for b, c in zip(fb, fc, strict=True)]) * 1e3}
        result["c1_first_byte"] = rows
        log(f"concurrency 1, first byte: {rows}")

        # 3. concurrency C, closed loops, alternating phases
        async def phase(call, seconds: float) -> dict[str, float]:
            """Closed loops for `seconds`, each finishing the request it holds at the end; requests/s as
            `closed_loop_rate` gives them, the steady part beginning after a third of the phase."""
            spans: list[tuple] = []
            errors, kinds = [0], {}
            t0 = time.monotonic()
            stop, steady = t0 + seconds, t0 + seconds / 3

            async def loop():
                while (begun := time.monotonic()) < stop:
                    try:
                        await call()
                        spans.append((begun, time.monotonic()))
                    except Exception as e:  # noqa: BLE001  counted: an overloaded server answers 503 / UNAVAILABLE
                        errors[0] += 1
                        kind = f"{type(e).__name__}: {str(e)[:200]}"
                        kinds[kind] = kinds.get(kind, 0) + 1

            cpu0, load0 = cpu_seconds(gateway.proc.pid), os.getloadavg()[0]
            await asyncio.gather(*(loop() for _ in range(a.concurrency)))
            cpu = cpu_seconds(gateway.proc.pid) - cpu0
            return {**closed_loop_rate(spans, a.concurrency, steady, stop), "requests": len(spans), "errors": errors[0],
                    "error_kinds": kinds, "gateway_cpu_s": cpu,
                    "gateway_cpu_ms_per_request": 1e3 * cpu / max(1, len(spans)),
                    "loadavg": [load0, os.getloadavg()[0]]}

        phases = {"direct": [], "gateway": []}
        calls = {"direct": lambda: direct.infer_one(TEXT, options), "gateway": lambda: via_gateway(body)}
        for i in range(a.phases):  # D G G D D G ...: a drift of the machine's speed falls on both alike
            for name in (("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")):
                phases[name].append(await phase(calls[name], a.seconds))
                log(f"concurrency {a.concurrency}, {name}: {phases[name][-1]}")
        total = {}
        for k, v in phases.items():  # Little's law over every steady request of the kind's phases
            n = sum(p["steady_requests"] for p in v)
            latency = sum(p["mean_latency_s"] * p["steady_requests"] for p in v if p["steady_requests"]) / max(1, n)
            total[k] = {"requests": n, "errors": sum(p["errors"] for p in v),
                        "rps": a.concurrency / latency if n else 0.0,
                        "counted_rps": statistics.mean(p["counted_rps"] for p in v)}
        gw_cpu = sum(p["gateway_cpu_s"] for p in phases["gateway"])
        gw_requests = sum(p["requests"] for p in phases["gateway"])
        result["throughput"] = {"concurrency": a.concurrency, "phases": phases, "direct_rps": total["direct"]["rps"],
                                "gateway_rps": total["gateway"]["rps"],
                                "ratio": total["gateway"]["rps"] / total["direct"]["rps"],
                                "errors": {k: v["errors"] for k, v in total.items()},
                                "phase_ratios": [g["rps"] / d["rps"]
                                                 for d, g in zip(phases["direct"], phases["gateway"], strict=True)],
                                "counted_ratio": total["gateway"]["counted_rps"] / total["direct"]["counted_rps"],
                                "gateway_cpu_ms_per_request": 1e3 * gw_cpu / max(1, gw_requests)}
        log(f"throughput: {result['throughput']['gateway_rps']:.1f} / {result['throughput']['direct_rps']:.1f} req/s")

        if not encoding:
            return result
        # 4. encoding per second of audio, on the server's audio
        long_audio = np.concatenate([await direct.infer_one(TEXT, {**options, "seed": s}) for s in range(8)])
        seconds = long_audio.size / SAMPLE_RATE
        enc = {}
        for fmt in (f for f in FORMATS if pyav or f in WHOLE_WITHOUT_PYAV):
            t0 = time.process_time()
            for _ in range(a.encode_repeats):
                data = encode(fmt, long_audio)
            whole = (time.process_time() - t0) / a.encode_repeats
            enc[fmt] = {"whole_ms_per_audio_s": 1e3 * whole / seconds, "stream_ms_per_audio_s": None,
                        "kbit_per_s": len(data) * 8 / seconds / 1e3,
                        "decoded_samples": int(decode(data, fmt, pyav).size), "stream_bytes": None}
            if pyav or fmt in STREAM_WITHOUT_PYAV:
                t0 = time.process_time()
                for _ in range(a.encode_repeats):
                    e = StreamEncoder(fmt)
                    parts = [e.push(long_audio[i:i + 4096]) for i in range(0, long_audio.size, 4096)] + [e.close()]
                streamed = (time.process_time() - t0) / a.encode_repeats
                enc[fmt].update(stream_ms_per_audio_s=1e3 * streamed / seconds, stream_bytes=sum(len(p) for p in parts))
        result["encoding"] = {"audio_seconds": seconds, "samples": int(long_audio.size), "formats": enc}
        log(f"encoding: {enc}")
    finally:
        await http.close()
        await direct.close()
    return result


def _variant_lines(v: dict, seconds: float, label: str) -> tuple[list[str], str]:
    """The table's rows and the throughput paragraph of one gateway size."""
    c1, fb, tp = v["c1_wav"], v["c1_first_byte"], v["throughput"]
    rows = [f"| {label}concurrency 1, whole wav, p50 | {c1['direct_p50_ms']:.1f} ms | {c1['gateway_p50_ms']:.1f} ms | "
            f"{c1['overhead_p50_ms']:+.1f} ms (pairs' median {c1['paired_overhead_p50_ms']:+.1f}) | ≤ 5 ms |"]
    for fmt, r in fb.items():
        rows.append(f"| {label}concurrency 1, first chunk / first {fmt} byte, p50 | {r['first_chunk_p50_ms']:.1f} ms | "
                    f"{r['first_byte_p50_ms']:.1f} ms | {r['later_p50_ms']:+.1f} ms (pairs' median "
                    f"{r['paired_later_p50_ms']:+.1f}) | ≤ 10 ms |")
    rows.append(f"| {label}concurrency {tp['concurrency']}, whole wav | {tp['direct_rps']:.1f} req/s | "
                f"{tp['gateway_rps']:.1f} req/s | **{100 * tp['ratio']:.1f} %** of direct | ≥ 95 % |")
    text = (f"{label}concurrency {tp['concurrency']}: {len(tp['phase_ratios'])} phase pairs of {seconds:g} s "
            "(direct and gateway in turn, D G G D …), requests/s by Little's law (concurrency / mean latency) over "
            "the requests begun after the first third of each phase (completions counted in that window, which "
            "move by a whole wave of requests finishing together: "
            f"{tp['counted_ratio'] * 100:.1f} %); "
            f"gateway/direct per pair: {', '.join(f'{100 * r:.0f} %' for r in tp['phase_ratios'])} (mean "
            f"{100 * statistics.mean(tp['phase_ratios']):.0f} %, sd "
            f"{100 * statistics.pstdev(tp['phase_ratios']):.0f}). Errors: {tp['errors']}. The gateway's processes used "
            f"**{tp['gateway_cpu_ms_per_request']:.2f} ms of CPU per request** at that load "
            "(HTTP, JSON, gRPC, wav encoding).")
    return rows, text


def to_markdown(res: dict) -> str:
    enc = res["encoding"]
    launcher = res.get("launcher")
    served = (f"served by `{launcher['command']}` (ready in {launcher['ready_s']:.0f} s, {launcher['restarts']} "
              "restarts)" if launcher else f"served at {res.get('grpc_url', 'a running server')}")
    variants = res["variants"]
    sizes = ", ".join(str(v["workers"]) for v in variants)
    lines = [
        f"# Speech gateway against direct gRPC — {res['machine']}",
        "",
        f"`{res['command']}`; repository `{res['repo']}` ({res['weights']}), {served}, {res['tokens']} forced code "
        f"frames per request ({samples_for_codes(res['tokens']) / SAMPLE_RATE:.2f} s of audio), Triton, gateway and "
        f"load generator on the same {os.cpu_count()} cores (load average {res['loadavg']['start'][0]:.1f} before the "
        f"run, {res['loadavg']['end'][0]:.1f} at its end), {res['channels']} gRPC connections for the direct client "
        f"and for each gateway process; gateway processes (`--workers`): {sizes}, each measured in turn.",
        "",
        "| | direct gRPC | through the gateway | gateway − direct | target |",
        "|---|---|---|---|---|",
    ]
    parts = [_variant_lines(v, res["seconds"], f"{v['workers']} process{'es' if v['workers'] > 1 else ''}: "
                            if len(variants) > 1 else "") for v in variants]
    for rows, _ in parts:
        lines += rows
    for _, text in parts:
        lines += ["", text[0].upper() + text[1:]]
    lines += ["", f"Encoding cost on {enc['audio_seconds']:.1f} s of the server's audio (CPU time per second of audio, "
              "one thread):", "",
              "| format | whole file | streamed (4096-sample chunks) | bit rate |", "|---|---|---|---|"]
    for fmt, r in enc["formats"].items():
        streamed = "not measured" if r["stream_ms_per_audio_s"] is None else f"{r['stream_ms_per_audio_s']:.2f} ms"
        lines.append(f"| {fmt} | {r['whole_ms_per_audio_s']:.2f} ms | {streamed} | {r['kbit_per_s']:.0f} kbit/s |")
    if res.get("skipped"):
        lines += ["", "**Not measured** (" + res["skipped"][0]["why"] + "): "
                  + "; ".join(s["what"] for s in res["skipped"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="the exported repository (started here unless --grpc-url)")
    ap.add_argument("--grpc-url", help="a running server's gRPC HOST:PORT (default: start one on --repo)")
    ap.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md are written")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--requests", type=int, default=40, help="paired requests at concurrency 1")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=20.0, help="each throughput phase")
    ap.add_argument("--phases", type=int, default=4, help="direct/gateway phase pairs")
    ap.add_argument("--encode-repeats", type=int, default=5)
    ap.add_argument("--channels", type=int, default=2, help="gRPC connections of the direct client and of the gateway")
    ap.add_argument("--workers", default=str(DEFAULT_WORKERS), help="gateway processes (python -m gateway --workers), "
                    "a comma-separated list: each size measured in turn against the same server (default %(default)s, "
                    "the gateway's)")
    ap.add_argument("--gateway-arg", action="append", default=[], help="a flag for python -m gateway (repeatable)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="a flag for python -m chattts_triton.serve, without --grpc-url (repeatable, e.g. "
                         "--serve-arg=--mps)")
    ap.add_argument("--machine", default=f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores")
    a = ap.parse_args(argv)
    if a.grpc_url and a.serve_arg:
        ap.error("--serve-arg is for the server started here: not with --grpc-url")
    try:
        workers = [int(w) for w in a.workers.split(",")]
    except ValueError:
        workers = []
    if not workers or min(workers) < 1:
        ap.error(f"--workers {a.workers!r}: a comma-separated list of process counts ≥ 1, e.g. 1,2,4")
    if any(g.split("=")[0] == "--workers" for g in a.gateway_arg):
        ap.error("--workers is bench.gateway's own flag (a list of sizes): not through --gateway-arg")
    from chattts_triton.launcher.serve import Launched
    from chattts_triton.triton.repo_config import read_manifest

    man = read_manifest(a.repo)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    server = launcher = None
    if a.grpc_url is None:  # the shipped path, as a container starts it
        server = Launched(a.repo, a.out.with_suffix(".tritonserver.log"), args=a.serve_arg, ready_timeout_s=900)
        server.start()
        launcher = {"command": " ".join(["python -m chattts_triton.serve --repo", str(a.repo), *a.serve_arg]),
                    "ready_s": round(server.ready_s[0], 1)}
        log(f"launcher ready in {launcher['ready_s']:.0f} s: tritonserver pid {server.server_pid}, {server.grpc_url}")
    try:
        grpc_url = a.grpc_url or server.grpc_url
        load0, variants, res = os.getloadavg(), [], {}
        for i, n in enumerate(workers):
            log_file = a.out.with_suffix(".gateway.log" if len(workers) == 1 else f".gateway-{n}.log")
            gateway = Gateway(grpc_url, a.repo, log_file,
                              ["--channels", str(a.channels), "--workers", str(n), *a.gateway_arg])
            try:
                got = asyncio.run(run(a, grpc_url, gateway, encoding=i == 0))
            finally:
                gateway.close()
            variants.append({"workers": n, **{k: got.pop(k) for k in ("c1_wav", "c1_first_byte", "throughput")}})
            res.update(got)
            log(f"--workers {n}: {100 * variants[-1]['throughput']['ratio']:.1f} % of direct at {a.concurrency}")
        res.update(variants=variants, loadavg={"start": load0, "end": os.getloadavg()})
        if server is not None:
            launcher.update(restarts=server.restarts, exits=[code for _, code in server.exits])
    finally:
        if server is not None:
            launcher_exit = server.stop()
    if launcher is not None:
        launcher["exit_status"] = launcher_exit
    res.update(machine=a.machine, command=" ".join(["python -m bench.gateway", *(argv or sys.argv[1:])]),
               repo=str(a.repo), tokens=a.tokens, channels=a.channels, seconds=a.seconds,
               weights=f"hidden {man['arch']['gpt']['hidden']}, {man.get('dtype')}",
               deployment=man.get("deployment"), launcher=launcher, grpc_url=grpc_url)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    a.out.with_suffix(".md").write_text(to_markdown(res))
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
