"""How many utterances/s the load generator itself can take: is a sweep measuring the server?

    python -m bench.client_capacity [--concurrency 1,64,512] [--seconds 8] [--frames 150]

Starts a stand-in gRPC server in another process that answers every ModelInfer at once with the
audio of `--frames` code frames, then drives it with the same asyncio client and closed loop as
`loadtest.sweep` / `bench.run`. If the rate here is not well above a served sweep's, the sweep
measured its client. Measured on the 2-core CI box (2026-11-30): ≈ 1400 utt/s at 64 and 512.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import socket
import time

from chattts_triton.config import samples_for_codes


def _serve(port: int, samples: int, ready) -> None:
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    audio = np.random.default_rng(0).uniform(-1, 1, samples).astype("<f4").tobytes()

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ServerReady(self, request, context):
            return service_pb2.ServerReadyResponse(ready=True)

        async def ModelReady(self, request, context):
            return service_pb2.ModelReadyResponse(ready=True)

        async def ModelInfer(self, request, context):
            out = service_pb2.ModelInferResponse.InferOutputTensor(name="AUDIO", datatype="FP32", shape=[1, samples])
            return service_pb2.ModelInferResponse(model_name=request.model_name, outputs=[out], raw_output_contents=[audio])

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
                await client.synthesize("你好，欢迎使用。", max_new_tokens=frames, min_new_tokens=frames)
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return done / (time.monotonic() - t0)


@contextlib.contextmanager
def stand_in_server(frames: int):
    """A stand-in gRPC server (another process) answering every ModelInfer at once with `frames`
    code frames of audio; yields its "host:port"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(port, samples_for_codes(frames), ready), daemon=True)
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
    ap.add_argument("--concurrency", default="1,64,512")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--frames", type=int, default=150)
    a = ap.parse_args(argv)
    with stand_in_server(a.frames) as url:
        for c in (int(x) for x in a.concurrency.split(",") if x):
            rate = asyncio.run(_drive(url, c, a.seconds, a.frames))
            print(f"concurrency {c}: {rate:.1f} utterances/s through the client alone", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
