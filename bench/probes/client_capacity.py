"""How many utterances/s the load generator itself can take: is a sweep measuring the server?

    python -m bench.probes.client_capacity [--concurrency 1,64,512] [--seconds 8] [--frames 150]
    python -m bench.probes.client_capacity --stream [--concurrency 1,64] [--first-ms 90 --gap-ms 60]

Starts a stand-in gRPC server in another process that answers every ModelInfer at once with the
audio of `--frames` code frames, then drives it with the same asyncio client and closed loop as
`loadtest.sweep` / `bench.run`. If the rate here is not well above a served sweep's, the sweep
measured its client. Measured on the 2-core CI box (2026-11-30): ≈ 1400 utt/s at 64 and 512.

`--stream`: the same for `bench.run`'s streams (`client.stream`, one gRPC stream per utterance). The
stand-in answers each stream on a fixed schedule, as `chattts_stream` would: a first chunk of
`STREAM_FIRST_FRAMES` frames `--first-ms` after the request arrived, then chunks of
`STREAM_CHUNK_FRAMES` frames every `--gap-ms` up to `--frames`. Each chunk carries the stand-in's
receive and send times (CLOCK_MONOTONIC, one clock for every process of the host) in its first
samples, so a first chunk's latency splits into the request's way in (client start → stand-in got
it), the schedule, and the chunk's way out (stand-in sent → client got it). What the way in and out
add at a concurrency, beyond concurrency 1, is the client's (and the stand-in's) share of a served
run's first-chunk latency — not Triton's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import socket
import time

import numpy as np

from chattts_triton.config import samples_for_codes
from chattts_triton.triton.deployment import Deployment

STREAM_FIRST_FRAMES = Deployment.stream_first_chunk_frames  # the served default chunks, in code frames
STREAM_CHUNK_FRAMES = Deployment.stream_chunk_frames
TEXT = "你好，欢迎使用。"
STREAM_PARTS = ("first_chunk", "request_in", "stand_in_wait", "first_chunk_out", "later_chunk_out")


def stamp(audio: np.ndarray, received: float, sent: float) -> np.ndarray:
    """Write two monotonic times into a chunk's first four samples (their float64 bits: exact at any uptime)."""
    audio[:4] = np.array([received, sent], np.float64).view(np.float32)
    return audio


def read_stamp(chunk: np.ndarray) -> tuple[float, float]:
    """(received, sent) of `stamp`."""
    received, sent = np.ascontiguousarray(chunk[:4], np.float32).view(np.float64)
    return float(received), float(sent)


def stream_schedule(frames: int, first_ms: float, gap_ms: float) -> list[tuple[float, int]]:
    """(seconds after the request, samples) of each chunk the stand-in sends for a stream."""
    sizes, left = [], frames
    while left > 0:
        sizes.append(min(left, STREAM_FIRST_FRAMES if not sizes else STREAM_CHUNK_FRAMES))
        left -= sizes[-1]
    return [((first_ms + i * gap_ms) / 1000.0, samples_for_codes(n)) for i, n in enumerate(sizes)]


def _serve(port: int, samples: int, ready, schedule=None) -> None:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from client.contract import FINAL_PARAMETER

    rng = np.random.default_rng(0)
    audio = rng.uniform(-1, 1, samples).astype("<f4").tobytes()
    pieces = [rng.uniform(-1, 1, n).astype("<f4") for _, n in schedule or []]

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ServerReady(self, request, context):
            return service_pb2.ServerReadyResponse(ready=True)

        async def ModelReady(self, request, context):
            return service_pb2.ModelReadyResponse(ready=True)

        async def ModelInfer(self, request, context):
            out = service_pb2.ModelInferResponse.InferOutputTensor(name="AUDIO", datatype="FP32", shape=[1, samples])
            return service_pb2.ModelInferResponse(model_name=request.model_name, outputs=[out],
                                                  raw_output_contents=[audio])

        async def ModelStreamInfer(self, request_iterator, context):
            async for request in request_iterator:
                received = time.monotonic()
                for i, ((at, n), piece) in enumerate(zip(schedule, pieces, strict=True)):
                    await asyncio.sleep(max(0.0, received + at - time.monotonic()))
                    out = service_pb2.ModelInferResponse.InferOutputTensor(name="AUDIO", datatype="FP32", shape=[1, n])
                    final = i == len(schedule) - 1
                    yield service_pb2.ModelStreamInferResponse(infer_response=service_pb2.ModelInferResponse(
                        model_name=request.model_name, id=request.id, outputs=[out],
                        parameters={FINAL_PARAMETER: service_pb2.InferParameter(bool_param=final)},
                        raw_output_contents=[stamp(piece.copy(), received, time.monotonic()).tobytes()]))

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", -1)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


async def _drive(url: str, concurrency: int, seconds: float, frames: int) -> float:
    from client.client import AsyncChatTTSClient

    async with AsyncChatTTSClient(url, protocol="grpc", timeout_s=60, retries=0, max_concurrency=concurrency) as client:
        await client.wait_until_ready(timeout_s=30)
        done, stop = 0, time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop:
                await client.synthesize(TEXT, max_new_tokens=frames, min_new_tokens=frames)
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return done / (time.monotonic() - t0)


async def _drive_stream(url: str, concurrency: int, seconds: float, frames: int, sync) -> dict[str, list]:
    """One process's closed-loop streams through `client.stream` against the stand-in: the first
    chunk's latency and its parts, and how long the later chunks took from sent to received (s)."""
    from client.client import AsyncChatTTSClient

    parts: dict[str, list] = {k: [] for k in STREAM_PARTS}
    streams = 0
    async with AsyncChatTTSClient(url, protocol="grpc", timeout_s=60, retries=0, max_concurrency=concurrency) as client:
        await client.wait_until_ready(timeout_s=30)
        await asyncio.to_thread(sync)
        stop = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal streams
            while time.monotonic() < stop:
                t0, n = time.monotonic(), 0
                async for chunk in client.stream(TEXT, max_new_tokens=frames, min_new_tokens=frames, split=False):
                    now = time.monotonic()
                    received, sent = read_stamp(chunk)
                    if n == 0:
                        parts["first_chunk"].append(now - t0)
                        parts["request_in"].append(received - t0)
                        # the schedule, and how late the stand-in kept it
                        parts["stand_in_wait"].append(sent - received)
                        parts["first_chunk_out"].append(now - sent)
                    else:
                        parts["later_chunk_out"].append(now - sent)
                    n += 1
                streams += 1

        t0 = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return {**parts, "streams": streams, "elapsed_s": time.monotonic() - t0}


def stream_capacity(url: str, concurrency: int, seconds: float, frames: int, procs: int = 1) -> dict[str, float]:
    """`_drive_stream` from `procs` client processes (bench.clients): streams/s and ms percentiles."""
    from bench import clients

    r = clients.run(_drive_stream, [(url, n, seconds, frames) for n in clients.shares(concurrency, procs)],
                    lambda: None)
    row: dict[str, float] = {"concurrency": concurrency, "client_processes": min(procs, concurrency),
                             "streams_per_s": r["streams"] / r["elapsed_s"]}
    for k in STREAM_PARTS:
        row[f"{k}_p50_ms"] = float(np.percentile(r[k], 50)) * 1000 if r[k] else None
        row[f"{k}_p99_ms"] = float(np.percentile(r[k], 99)) * 1000 if r[k] else None
    return row


@contextlib.contextmanager
def stand_in_server(frames: int, schedule=None):
    """A stand-in gRPC server (another process) answering every ModelInfer at once with `frames`
    code frames of audio, and every stream on `schedule` (`stream_schedule`); yields its "host:port"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(port, samples_for_codes(frames), ready, schedule), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the stand-in server did not start")
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.join(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,64,512; with --stream 1,64)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--frames", type=int, default=150)
    ap.add_argument("--stream", action="store_true", help="streams (client.stream) instead of whole utterances")
    ap.add_argument("--first-ms", type=float, default=90.0,
                    help="--stream: the stand-in's first chunk, after the request")
    ap.add_argument("--gap-ms", type=float, default=60.0, help="--stream: the stand-in's later chunks, one per this")
    ap.add_argument("--procs", type=int, default=1, help="--stream: client processes the streams are spread over")
    ap.add_argument("--out", help="--stream: write the rows here as JSON")
    a = ap.parse_args(argv)
    if a.procs < 1:
        ap.error("--procs must be at least 1")
    text = a.concurrency or ("1,64" if a.stream else "1,64,512")
    if any(not x.strip().isdigit() or int(x) < 1 for x in text.split(",") if x):
        ap.error("--concurrency must be whole numbers of at least 1, comma-separated")
    levels = [int(x) for x in text.split(",") if x]
    schedule = stream_schedule(a.frames, a.first_ms, a.gap_ms) if a.stream else None
    rows = []
    with stand_in_server(a.frames, schedule) as url:
        for c in levels:
            if not a.stream:
                rate = asyncio.run(_drive(url, c, a.seconds, a.frames))
                print(f"concurrency {c}: {rate:.1f} utterances/s through the client alone", flush=True)
                continue
            row = stream_capacity(url, c, a.seconds, a.frames, a.procs)
            rows.append(row)
            print(f"stream concurrency {c} ({row['client_processes']} client processes): {row['streams_per_s']:.1f} "
                  f"streams/s; first chunk p50 {row['first_chunk_p50_ms']:.1f} / "
                  f"p99 {row['first_chunk_p99_ms']:.1f} ms (scheduled {a.first_ms:.0f}, kept p99 "
                  f"{row['stand_in_wait_p99_ms']:.1f}); request in p50 {row['request_in_p50_ms']:.2f} / "
                  f"p99 {row['request_in_p99_ms']:.2f} ms; first chunk out p50 {row['first_chunk_out_p50_ms']:.2f} / "
                  f"p99 {row['first_chunk_out_p99_ms']:.2f} ms; later chunks out p50 "
                  f"{row['later_chunk_out_p50_ms']:.2f} / "
                  f"p99 {row['later_chunk_out_p99_ms']:.2f} ms", flush=True)
    if a.out:
        import json
        import os

        with open(a.out, "w") as f:
            json.dump({"first_ms": a.first_ms, "gap_ms": a.gap_ms, "procs": a.procs, "frames": a.frames,
                       "seconds": a.seconds,
                       "cpus": os.cpu_count(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
