"""How the model processes on one GPU share its memory: the engines' slots and KV pages that fit the card.

Every process on a GPU (the GPT model, the stream model, each vocoder instance; the preprocess model runs
on the CPU) plans with the same inputs, so they agree without talking to each other: the budget (the
card's memory, or `gpu_memory_gb` of the deployment where it names less, × `GPU_MEMORY_UTILIZATION`), minus what each
process needs besides its engine (`PROCESS_CONTEXT_BYTES` outside torch's allocator, `VOCODER_BYTES` for a codec,
`ENGINE_WORKSPACE_BYTES` and the weights for an engine), is split between the two engines
(`GPT_SHARE`); an engine then takes as many slots as fit with `AVG_TOKENS_PER_SLOT` positions of KV cache
each (the paged cache lends a long request the pages short ones leave), up to its largest batch.
The per-process constants are what the processes were seen to take on a GPU (docs/performance.md); `plan` is pure
arithmetic (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import KV_PAGE_TOKENS, Arch

GIB = 1 << 30
GPU_MEMORY_UTILIZATION = 0.90  # of the card's memory: the rest is headroom (allocator fragmentation, spikes)
PROCESS_CONTEXT_BYTES = 640 << 20  # a CUDA context and torch's kernels, per GPU process (outside the allocator)
VOCODER_BYTES = 1536 << 20  # a codec's weights, CUDA graphs and the activations of a batch (allocator)
ENGINE_WORKSPACE_BYTES = 1 * GIB  # an engine's graph pool, prefill and sampling activations (allocator)
AVG_TOKENS_PER_SLOT = 512  # KV positions per slot: a 150-frame utterance and its prompt hold ≈ 260
GPT_SHARE = 0.75  # of the memory left for the engines' caches and slot state, the GPT model's
# the largest batch an engine runs (its CUDA graph buckets); docs/performance.md: where the step
# grows slower than the rows
MAX_SLOTS = {"gpt": 1024, "stream": 128}
CPU_SLOTS = {"gpt": 8, "stream": 2}  # an engine's slots on the CPU (the GPU's are planned)
MIN_SLOTS = 8
SLOT_ROUND = 8  # slot counts are multiples of this
ROLES = ("gpt", "stream")


@dataclass(frozen=True)
class EnginePlan:
    slots: int
    cache_tokens: int  # positions of the paged KV cache, all slots together
    bytes: int  # what the engine's process allocates through torch: weights, workspace, slot state, cache

    @property
    def gib(self) -> float:
        return self.bytes / GIB


class MemoryPlanError(ValueError):
    """The budget cannot hold the deployment."""


def dtype_bytes(dtype: str) -> int:
    return {"fp32": 4, "int8": 4, "fp16": 2, "bf16": 2}[dtype]


def kv_dtype_bytes(dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one cached key or value: the engine's precision's, or one for an fp8 cache (config.KV_CACHE_DTYPES)."""
    return 1 if kv_cache_dtype == "fp8" else dtype_bytes(dtype)


def kv_bytes_per_token(arch: Arch, nbytes: int) -> int:
    g = arch.gpt
    return g.layers * 2 * g.kv_heads * g.head_dim * nbytes


def gpt_weight_bytes(arch: Arch, nbytes: int) -> int:
    g = arch.gpt
    layer = 4 * g.hidden * g.hidden + 3 * g.hidden * g.intermediate + 2 * g.hidden
    embeddings = 2 * arch.num_text_tokens * g.hidden + 2 * arch.num_vq * arch.num_audio_tokens * g.hidden
    return (g.layers * layer + embeddings + g.hidden) * nbytes


def slot_state_bytes(arch: Arch, nbytes: int, max_new_tokens: int) -> int:
    """A slot's generated tokens (int64 per codebook) and hidden states (compute dtype), whatever it holds."""
    return (max_new_tokens + 1) * (arch.num_vq * 8 + arch.gpt.hidden * nbytes)


def _round_slots(n: int) -> int:
    return n // SLOT_ROUND * SLOT_ROUND


def plan(budget_bytes: int, arch: Arch, dtype: str, max_context: int, max_new_tokens: int, vocoders: int = 1,
         stream: bool = True, slots: dict[str, int | None] | None = None,
         cache_tokens: dict[str, int | None] | None = None, kv_cache_dtype: str = "auto") -> dict[str, EnginePlan]:
    """The engines' plans on one GPU of `budget_bytes`. `slots` / `cache_tokens` pin a role's values (None:
    sized here). Raises MemoryPlanError when the budget cannot hold MIN_SLOTS slots of an engine."""
    slots, cache_tokens = dict(slots or {}), dict(cache_tokens or {})
    nbytes = dtype_bytes(dtype)
    roles = ["gpt"] + (["stream"] if stream else [])
    fixed = {"gpt": gpt_weight_bytes(arch, nbytes) + ENGINE_WORKSPACE_BYTES}
    fixed["stream"] = fixed["gpt"] + VOCODER_BYTES
    procs = len(roles) + vocoders
    left = budget_bytes - procs * PROCESS_CONTEXT_BYTES - vocoders * VOCODER_BYTES - sum(fixed[r] for r in roles)
    page = KV_PAGE_TOKENS
    per_token = kv_bytes_per_token(arch, kv_dtype_bytes(dtype, kv_cache_dtype))
    state = slot_state_bytes(arch, nbytes, max_new_tokens)
    full = -(-max_context // page) * page  # positions of one request at the full context, whole pages
    shares = {"gpt": GPT_SHARE if stream else 1.0, "stream": 1.0 - GPT_SHARE}
    out: dict[str, EnginePlan] = {}
    for role in roles:
        share = left * shares[role]
        n = slots.get(role)
        if n is None:
            fit = int(share // (state + AVG_TOKENS_PER_SLOT * per_token)) if share > 0 else 0
            n = min(MAX_SLOTS[role], _round_slots(fit)) if fit >= MIN_SLOTS else 0
            if n < MIN_SLOTS:
                need = procs * PROCESS_CONTEXT_BYTES + vocoders * VOCODER_BYTES + sum(fixed[r] for r in roles) + \
                    sum(MIN_SLOTS * (state + AVG_TOKENS_PER_SLOT * per_token) / shares[r] for r in roles) / len(roles)
                raise MemoryPlanError(f"a GPU memory budget of {budget_bytes / GIB:.1f} GiB cannot hold {MIN_SLOTS} "
                                      f"{role} slots beside the other models' processes (about {need / GIB:.1f} GiB "
                                      "needed)")
        tokens = cache_tokens.get(role)
        if tokens is None:
            # the slots' average, within what the share holds, and never below one request at the full context
            room = int((share - n * state) // per_token) if share > n * state else 0
            tokens = max(full, min(n * AVG_TOKENS_PER_SLOT, room) // page * page)
        out[role] = EnginePlan(n, tokens, fixed[role] + n * state + (-(-tokens // page) + 1) * page * per_token)
    return out


def budget(total_bytes: int, gpu_memory_gb: float | None = None) -> int:
    """The bytes the deployment plans with on a card of `total_bytes`, or of `gpu_memory_gb` GiB (a card
    that small, or the part of a shared card this deployment may take)."""
    if gpu_memory_gb is not None:
        if gpu_memory_gb <= 0:
            raise MemoryPlanError(f"gpu_memory_gb must be positive, got {gpu_memory_gb}")
        total_bytes = min(total_bytes, int(gpu_memory_gb * GIB)) if total_bytes else int(gpu_memory_gb * GIB)
    return int(total_bytes * GPU_MEMORY_UTILIZATION)
