"""Where a model instance runs: its device and threads, the dtype it can use, and its share of the GPU's
memory (`memory.plan`, the same arithmetic in every process on the GPU)."""

from __future__ import annotations

import logging
import os

import torch

from .. import memory
from ..config import KV_CACHE_FP8_CAPABILITY, Arch

log = logging.getLogger(__name__)

GPU_INSTANCE_THREADS_ENV = "CHATTTS_GPU_INSTANCE_THREADS"
GPU_INSTANCE_THREADS = "4"  # torch intra-op threads of a GPU model instance


def check_dtype_supported(device: torch.device, dtype: str) -> None:
    """bf16 needs a GPU of compute capability 8.0 or later (Ampere); say so at load, not as a kernel error."""
    if device.type == "cuda" and dtype == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"this repository is exported in bf16, which {name} (compute capability "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) does not support: export it "
                         "with "
                         f"--dtype fp16 (or --dtype auto on this machine)")


def check_kv_cache_supported(device: torch.device, kv_cache_dtype: str, compiled: bool) -> None:
    """An fp8 cache (config.KV_CACHE_DTYPES) needs a GPU that converts e4m3 and the compiled step (its decode kernel
    reads the cache; the TorchScript step does not); say so at load, naming the setting."""
    if kv_cache_dtype == "auto":
        return
    fix = "configure --kv-cache-dtype auto"
    if device.type != "cuda":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} runs on GPUs only; this instance is on the {device.type}: "
                         f"{fix}")
    cap = torch.cuda.get_device_capability(device)
    if cap < KV_CACHE_FP8_CAPABILITY:
        need, name = ".".join(map(str, KV_CACHE_FP8_CAPABILITY)), torch.cuda.get_device_name(device)
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} needs a GPU of compute capability {need} or later; "
                         f"{name} has {'.'.join(map(str, cap))}: {fix}")
    if not compiled:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} needs the compiled step (--gpt-compile), whose decode "
                         f"kernel reads it: configure --gpt-compile, or {fix}")


def engine_plan(device: torch.device, arch: Arch, dtype: str, role: str, slots: int | None, cache_tokens: int | None,
                max_context: int, max_new_tokens: int, gpu_memory_gb: float | None, vocoders: int,
                kv_cache_dtype: str = "auto") -> memory.EnginePlan:
    """An engine's slots and KV cache on `device`: what the configuration gives, the rest from the GPU's memory
    (memory.plan: every process on the GPU plans alike). On the CPU, memory.CPU_SLOTS unless configured, and a
    cache that holds them all at the full context (slots × context: a request is never suspended)."""
    if device.type != "cuda":
        slots = memory.CPU_SLOTS[role] if slots is None else slots
        tokens = slots * max_context if cache_tokens is None else cache_tokens
        return memory.EnginePlan(slots, tokens, 0)
    total = torch.cuda.get_device_properties(device).total_memory
    plan = memory.plan(memory.budget(total, gpu_memory_gb), arch, dtype, max_context, max_new_tokens, vocoders,
                       stream=True, slots={role: slots}, cache_tokens={role: cache_tokens},
                       kv_cache_dtype=kv_cache_dtype)[role]
    log.info("%s engine on %s: %d slots, a KV cache of %d positions (%s), %.2f GiB planned (GPU memory %s)", role,
             torch.cuda.get_device_name(device), plan.slots, plan.cache_tokens,
             dtype if kv_cache_dtype == "auto" else kv_cache_dtype, plan.gib,
             f"{gpu_memory_gb:g} GiB as configured" if gpu_memory_gb else f"{total / memory.GIB:.1f} GiB, the card's")
    return plan


def limit_process_memory(device: torch.device, nbytes: int, gpu_memory_gb: float | None) -> None:
    """Where the deployment names its GPU memory, cap this process's allocator at its planned share (with the
    utilization's headroom): a process past its plan gets an out-of-memory error instead of starving the others."""
    if device.type != "cuda" or gpu_memory_gb is None:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    cap = nbytes / memory.GPU_MEMORY_UTILIZATION
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    log.info("GPU memory of this process capped at %.2f GiB (gpu_memory_gb %g)", cap / memory.GIB, gpu_memory_gb)


def device_for(kind: str, device_id: int) -> torch.device:
    if kind.upper().endswith("GPU") and torch.cuda.is_available():
        # an instance on GPU 1 must not create its graphs, streams and pools on GPU 0 (the default)
        torch.cuda.set_device(device_id)
        # Every GPU instance is its own process; with torch's default of one thread per core each,
        # they oversubscribe the host (on two GPUs that cost more than half the throughput)
        torch.set_num_threads(int(os.environ.get(GPU_INSTANCE_THREADS_ENV, GPU_INSTANCE_THREADS)))
        return torch.device("cuda", device_id)
    # Log what the stub process gets: intra-op threads decide CPU step time.
    log.info("CPU instance: torch uses %d threads of %d cores", torch.get_num_threads(), len(os.sched_getaffinity(0)))
    return torch.device("cpu")
