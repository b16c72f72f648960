"""GPU checks through the path users run: `python -m chattts_triton.serve` on a repository exported with the
defaults (GPU host: `pytest -m gpu tests/test_gpu_served.py`; CI has no GPU and skips them)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from chattts_triton.config import samples_for_codes
from chattts_triton.launcher.serve import Launched

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL_CARD_GIB = 15  # what a 16-GB card (a T4: 15360 MiB) reports


def _closed_loop(url: str, concurrency: int, seconds: float, frames: int):
    """(served, errors) of `concurrency` closed-loop clients for `seconds`, without retries."""
    from client.client import AsyncChatTTSClient

    async def run():
        ok, bad = [], []
        stop = time.monotonic() + seconds
        async with AsyncChatTTSClient(url, protocol="grpc", timeout_s=600, max_concurrency=concurrency, retries=0) as c:
            async def worker(i):
                k = 0
                while time.monotonic() < stop:
                    try:
                        audio = await c.synthesize("四川美食确实以辣闻名。", seed=1000 * i + k, min_new_tokens=frames,
                                                   max_new_tokens=frames)
                        ok.append(audio.shape[-1])
                    except Exception as e:  # noqa: BLE001  counted
                        bad.append(f"{type(e).__name__}: {e}"[:200])
                    k += 1

            await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return ok, bad

    return asyncio.run(run())


def test_a_16gb_card_plan_serves_64_concurrent_utterances_through_the_launcher(full_assets, tmp_path):
    """The default export sized for a 15-GiB card (`--gpu-memory-gb 15`: each process's allocator capped at its
    share) on this GPU: it starts, the engine holds at least 64 slots, 64 closed-loop clients of 150-frame
    utterances are served without an error, the server's processes stay inside the card, and the launcher
    stays up past the compile workers' exit (a minute after start) with no restart."""
    from bench.run import engine_slots, gpu_processes, server_smi_mib
    from chattts_triton.triton.repo_config import Deployment
    from export.__main__ import export_repository

    repo = export_repository(full_assets, tmp_path / "repo", ["torchscript"], "auto",
                             deployment=Deployment(gpus=[0], gpu_memory_gb=SMALL_CARD_GIB), progress=lambda m: None)
    with Launched(repo, tmp_path / "server.log") as server:
        ready = time.monotonic()
        slots = engine_slots(server.metrics_url)
        ok, bad = _closed_loop(server.grpc_url, 64, 30.0, 150)
        procs = gpu_processes(server)
        ours = server_smi_mib(server, procs)  # nvidia-smi's figures (CUDA contexts included): what a card must hold
        time.sleep(max(0.0, 90 - (time.monotonic() - ready)))
        restarts = server.restarts
    used = sum(ours.values())
    print(f"\n{SMALL_CARD_GIB} GiB plan: {slots} GPT slots; 64 clients: {len(ok)} served, {len(bad)} errors; GPU MiB "
          "per process "
          f"{ours} = {used:.0f} MiB")
    assert slots >= 64 and not bad and len(ok) >= 64 and set(ok) == {samples_for_codes(150)}
    # the preprocess stub holds no CUDA context; the others must be listed (pids of another namespace would sum to 0)
    assert len(ours) >= 3, f"nvidia-smi lists too few of the server's processes: {procs}"
    assert used <= SMALL_CARD_GIB * 1024, procs
    assert restarts == 0
