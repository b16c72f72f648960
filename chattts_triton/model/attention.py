"""Decode attention that reads each row's own cache length (one query per row) through its block table.

A decode step's rows sit at different positions: a dense attention over the step's attention-length
bucket (`F.scaled_dot_product_attention` with a mask) reads every row's cache up to the longest
row's bucket. At 488 rows of the served mix (prompts of 6-116 tokens, 150 frames each) that bucket is
384 while a row holds ≈ 120 keys on average, and the keys and values are what a large step reads.
`decode_attention` reads only the keys a row attends (`lengths`), page by page through the row's block
table (the paged cache of gpt.py): on a GPU a Triton kernel (one program per row and head, an online
softmax in fp32 over blocks of keys; at few rows a row's keys split over several programs and merged);
elsewhere `reference`, the same result in PyTorch (tests, CPU; the kernel itself under Triton's interpreter).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:  # Triton ships with PyTorch's CUDA wheels; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Launch layout, measured by layout on an H100 (bench/results/2026-12-05-h100-decode-attention-layout.md): one
# program per row and head walking BLOCK_KEYS keys a loop with one warp beat the wider blocks and programs holding
# several heads of a row at every batch from 64 rows up (1024 rows: 174 against 191 µs a layer); below
# SPLIT_ROW_HEADS rows x heads a row's keys are split over SPLITS programs (whole pages each) merged by a second
# kernel, so that a few long rows do not walk their keys one block at a time (8 rows: 8.4 against 16.5 µs, 128
# rows: 27.2 against 32.1 µs; from 256 rows up the splits lose).
BLOCK_KEYS = 16
# An fp8 cache (config.KV_CACHE_DTYPES) moves the same bytes a loop with twice the keys: at 16 keys its loads were
# 64-byte pieces. 32 keys beat 16 at every row count measured; 64 keys with two warps was a few per cent faster from
# 512 rows but is unmeasured with the split layout (bench/results/2026-12-08-h100-fp8-kv-cache.md)
BLOCK_KEYS_FP8 = 32
WARPS = 1
SPLITS = 8
SPLIT_ROW_HEADS = 1536


def launch_layout(rows: int, heads: int) -> int:
    """How many programs share one row's keys (1: one program per row and head)."""
    return SPLITS if rows * heads <= SPLIT_ROW_HEADS else 1


def block_keys(cache_dtype: torch.dtype) -> int:
    """Keys a program walks a loop: BLOCK_KEYS, or BLOCK_KEYS_FP8 from a cache of one byte a value."""
    return BLOCK_KEYS_FP8 if cache_dtype.itemsize == 1 else BLOCK_KEYS


def kernel_available(device: torch.device, head_dim: int) -> bool:
    """Whether `decode_attention` runs the Triton kernel for this device (else `reference`)."""
    return triton is not None and device.type == "cuda" and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def reference(q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, lengths: Tensor) -> Tensor:
    """q [B, H, D]; keys/values [blocks, page, KVH, D] (one layer's page pool); tables [B, W]: row i's
    pages in order; lengths [B]: row i attends its keys 0..lengths[i]-1. Returns [B, H, D] in q's dtype.
    Dense in PyTorch (gathers all W pages of every row)."""
    b, h, d = q.shape
    page, kvh = keys.shape[1], keys.shape[2]
    c = tables.shape[1] * page
    # (index_select: advanced indexing has no CPU kernel for fp8 caches)
    k = keys.index_select(0, tables.reshape(-1)).reshape(b, c, kvh, d).float().repeat_interleave(h // kvh, dim=2)
    v = values.index_select(0, tables.reshape(-1)).reshape(b, c, kvh, d).float().repeat_interleave(h // kvh, dim=2)
    s = torch.einsum("bhd,bchd->bhc", q.float(), k) / math.sqrt(d)
    n = lengths.clamp(1, c).to(torch.int64)
    s = s.masked_fill(torch.arange(c, device=q.device).view(1, 1, c) >= n.view(b, 1, 1), float("-inf"))
    return torch.einsum("bhc,bchd->bhd", s.softmax(-1), v).to(q.dtype)


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, lengths: Tensor) -> Tensor:
    """`reference`'s result; on a GPU with Triton it reads only the first lengths[i] keys of row i."""
    if not kernel_available(q.device, q.shape[-1]):
        return reference(q, keys, values, tables, lengths)
    return torch.ops.chattts_triton.decode_attention(q, keys, values, tables, lengths)


# An opaque operator to torch.compile: inductor calls it, and Triton's own launcher then specialises the
# kernel on the real strides (multiples of 16: vectorised loads). Traced as a user kernel under dynamic
# shapes, inductor passes the strides as symbols without that specialisation, and the kernel runs several
# times slower (docs/performance.md).
@torch.library.custom_op("chattts_triton::decode_attention", mutates_args=())
def _decode_attention_op(q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, lengths: Tensor) -> Tensor:
    return run_kernel(q, keys, values, tables, lengths)


def run_kernel(q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, lengths: Tensor,
               traceable: bool = False, splits: int | None = None, block: int | None = None,
               warps: int = WARPS) -> Tensor:
    """The operator's work: the Triton kernel, launched with the real strides (`reference` where it
    cannot run, so the operator means the same on every device). Returns a new contiguous [B, H, D].
    traceable: launched through `torch.library.wrap_triton`, so that torch.export records the kernels
    themselves (bench/probes/aoti.py's `aoti_traced`; a plain launch there would read fake tensors' pointers).
    splits / block / warps: the launch layout (default `launch_layout`'s and `block_keys`'; bench/probes/attention.py
    tries others)."""
    if not kernel_available(q.device, q.shape[-1]) or keys.stride(-1) != 1 or values.stride(-1) != 1:
        # (the kernel reads a head's keys and values contiguously); contiguous as the fake says
        return reference(q, keys, values, tables, lengths).contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    lengths = lengths.contiguous()
    tables = tables if tables.stride(-1) == 1 else tables.contiguous()
    b, h, d = q.shape
    page, kvh = keys.shape[1], keys.shape[2]
    splits = launch_layout(b, h) if splits is None else splits
    block = block_keys(keys.dtype) if block is None else block
    out = q.new_empty(q.shape)
    # a split's unnormalised sum [.., :D], its running max [.., D] and weight [.., D + 1], per row, split and head
    part = torch.empty(b, splits, h, d + 2, dtype=torch.float32, device=q.device) if splits > 1 else out
    wrap = torch.library.wrap_triton if traceable else (lambda k: k)
    wrap(_decode_kernel)[(b, h, splits)](
        q, keys, values, out, part, tables, lengths,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), tables.stride(0),
        tables.shape[1] * page, (1.0 / math.sqrt(d)) * 1.4426950408889634,  # softmax in base 2
        REP=h // kvh, D=d, BLOCK=block, PAGE=page, SPLITS=splits, num_warps=warps,
    )
    if splits > 1:
        wrap(_merge_kernel)[(b, h)](part, out, out.stride(0), out.stride(1), D=d, SPLITS=splits, num_warps=1)
    return out


@_decode_attention_op.register_fake
def _(q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, lengths: Tensor) -> Tensor:
    return q.new_empty(q.shape)


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, O, Part, T, Lens, sqb, sqh, skb, skp, skh, svb, svp, svh, sob, soh, stb, max_keys,  # noqa: E741  Q, K, V, O: attention's own names
                       scale, REP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
                       SPLITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # the cache is larger than 2**31 elements
        head = tl.program_id(1)
        kv_head = head // REP
        n = tl.minimum(tl.maximum(tl.load(Lens + row).to(tl.int32), 1), max_keys)
        if SPLITS == 1:
            lo = 0
            hi = n
        else:  # each split a run of whole pages; the splits past a short row's keys find none
            split = tl.program_id(2)
            per = tl.cdiv(tl.cdiv(n, SPLITS), PAGE) * PAGE
            lo = split * per
            hi = tl.minimum(lo + per, n)
        d = tl.arange(0, D)
        # fp32 again: AOTInductor passes `scale` as a double, which would make the loop's m_i fp64
        q = (tl.load(Q + row * sqb + head * sqh + d).to(tl.float32) * scale).to(tl.float32)
        table = T + row * stb
        k_head = K + kv_head * skh
        v_head = V + kv_head * svh
        m_i = tl.full((1,), float("-inf"), tl.float32)
        l_i = tl.zeros((1,), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for start in range(lo, hi, BLOCK):
            keys_at = start + tl.arange(0, BLOCK)
            live = keys_at < hi
            # each key's page through the row's block table, then its place in the page
            pages = tl.load(table + keys_at // PAGE, mask=live, other=0).to(tl.int64)
            in_page = (keys_at % PAGE).to(tl.int64)
            k = tl.load(k_head + pages[:, None] * skb + in_page[:, None] * skp + d[None, :], mask=live[:, None],
                        other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
            s = tl.where(live, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp2(s - m_new)
            alpha = tl.exp2(m_i - m_new)
            v = tl.load(v_head + pages[:, None] * svb + in_page[:, None] * svp + d[None, :], mask=live[:, None],
                        other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        if SPLITS == 1:
            tl.store(O + row * sob + head * soh + d, (acc / l_i).to(O.dtype.element_ty))
        else:
            at = Part + ((row * SPLITS + tl.program_id(2)) * tl.num_programs(1) + head) * (D + 2)
            tl.store(at + d, acc)
            tl.store(at + D + tl.arange(0, 1), m_i)
            tl.store(at + D + 1 + tl.arange(0, 1), l_i)

    @triton.jit
    def _merge_kernel(Part, O, sob, soh, D: tl.constexpr, SPLITS: tl.constexpr):  # noqa: E741  O: the output
        """One row and head: its splits' partial softmax states into the output (a split without keys weighs 0)."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        at = Part + ((row * SPLITS + sp) * tl.num_programs(1) + head) * (D + 2)  # [SPLITS]
        m = tl.load(at + D)
        w = tl.exp2(m - tl.max(m, axis=0))  # split 0 always holds a key: the max is finite
        total = tl.sum(tl.load(at + D + 1) * w, axis=0)
        acc = tl.sum(tl.load(at[:, None] + d[None, :]) * w[:, None], axis=0)
        tl.store(O + row * sob + head * soh + d, (acc / total).to(O.dtype.element_ty))
