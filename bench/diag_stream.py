"""Diagnose streaming on a host: one stream through a fresh server on build/bench-repo, errors printed."""
import asyncio, sys, traceback
from chattts_triton.tritonserver import TritonServer
from client.client import AsyncChatTTSClient


async def main(url):
    async with AsyncChatTTSClient(url, protocol="grpc", timeout_s=120) as c:
        n = 0
        try:
            async for ch in c.stream("四川美食确实以辣闻名。", seed=1, min_new_tokens=150, max_new_tokens=150):
                n += 1
                print("chunk", n, ch.shape, flush=True)
        except Exception:
            traceback.print_exc()


with TritonServer("build/bench-repo", log_file="build/diag.log", startup_timeout_s=600) as s:
    asyncio.run(main(s.grpc_url))
print(open("build/diag.log").read()[-6000:])
