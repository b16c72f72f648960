"""One row's decoder-layer projections as single Triton kernels: a norm, a matrix-vector product and its epilogue.

A decode step of one row (concurrency 1, a lone stream) is a chain of small kernels whose time is their launches
and latency, not their bytes: the weights of a layer are read in a few microseconds. `row_matvec` computes
`weight @ x` for one row with what surrounds it in the layer fused into the same kernel:
- `norm_weight`: x first goes through the layer's RMSNorm (each program recomputes the row's statistics: a few
  hundred values, cheaper than a launch);
- `gated`: the weight is gate and up stacked ([2N, K]); the result is `silu(gate) * up` [N];
- `residual`: the result is `residual + weight @ x` (the layer's skip connection).
Each program owns a block of outputs and reads its rows of the weight whole, accumulating in fp32 as a GEMM does;
intermediate roundings follow the PyTorch layer (`reference`), so the two agree to a product's summation order.
On a GPU with Triton it is the kernel (`torch.ops.chattts_triton.row_matvec`, opaque to torch.compile, as
`attention.decode_attention` is); elsewhere `reference`, the same computation in PyTorch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # Triton ships with PyTorch's CUDA wheels; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Launch layout per product, (outputs per program, weight columns per load, warps), each product's best on an H100 in
# `bench.probes.rowops` as a chain of its own dependent launches (bench/results/2026-12-07-h100-row-kernels.md): few
# outputs and warps per program, so that a product spreads over several programs per SM.
LAYOUT_SMALL_K = (2, 1024, 1)  # K ≤ 1024, not gated: q/k/v (2304 × 768), o (768 × 768)
LAYOUT_GATED = (2, 1024, 1)  # gate/up (2 × 3072 × 768)
LAYOUT_LARGE_K = (4, 1024, 4)  # down (768 × 3072)
# Hopper's programmatic dependent launch: each kernel lets the next one start at once, and a kernel reads its
# weights before it waits for the previous kernel's results (`griddepcontrol`), so that the weights of the next
# product stream in while this one runs. Read before the wait: only the weights, which no kernel writes.
PDL = True


def kernel_available(device: torch.device) -> bool:
    """Whether `row_matvec` runs the Triton kernel on this device (else `reference`)."""
    return triton is not None and device.type == "cuda"


def default_layout(k: int, gated: bool = False) -> tuple[int, int, int]:
    if gated:
        return LAYOUT_GATED
    return LAYOUT_SMALL_K if k <= 1024 else LAYOUT_LARGE_K


@functools.cache
def pdl_available(device: torch.device) -> bool:
    """Whether the GPU launches a kernel before the previous one ends (NVIDIA's Hopper and later; ROCm's devices
    also say "cuda" with capabilities of their own). Cached: an eager step of one row asks at each of its launches."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def kernels_pay(device: torch.device) -> bool:
    """Whether a one-row step gains by the kernels on this device: only where the GPU has programmatic dependent
    launch. Their layouts suit it; launched one after the other, they made an H100's one-row step slower than
    inductor's reductions (bench/results/2026-12-07-h100-row-kernels.md)."""
    return kernel_available(device) and PDL and pdl_available(device)


def reference(x: Tensor, weight: Tensor, norm_weight: Tensor | None = None, residual: Tensor | None = None,
              eps: float = 0.0, gated: bool = False) -> Tensor:
    """x [K]; weight [N, K] ([2N, K] gated); norm_weight [K] or None; residual [N] or None → [N] in x's dtype:
    what the decoder layer computes for one row (RMSNorm, nn.Linear, silu(gate) * up, the skip connection)."""
    dtype = x.dtype
    h = x
    if norm_weight is not None:
        f = x.float()
        h = norm_weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = F.linear(h, weight)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def row_matvec(x: Tensor, weight: Tensor, norm_weight: Tensor | None = None, residual: Tensor | None = None,
               eps: float = 0.0, gated: bool = False) -> Tensor:
    """`reference`'s result; on a GPU with Triton one kernel."""
    if not kernel_available(x.device):
        return reference(x, weight, norm_weight, residual, eps, gated)
    return torch.ops.chattts_triton.row_matvec(x, weight, norm_weight, residual, eps, gated)


@torch.library.custom_op("chattts_triton::row_matvec", mutates_args=())
def _row_matvec_op(x: Tensor, weight: Tensor, norm_weight: Tensor | None, residual: Tensor | None, eps: float,
                   gated: bool) -> Tensor:
    return run_kernel(x, weight, norm_weight, residual, eps, gated)


@_row_matvec_op.register_fake
def _(x: Tensor, weight: Tensor, norm_weight: Tensor | None, residual: Tensor | None, eps: float,
      gated: bool) -> Tensor:
    return x.new_empty(weight.shape[0] // (2 if gated else 1))


def run_kernel(x: Tensor, weight: Tensor, norm_weight: Tensor | None = None, residual: Tensor | None = None,
               eps: float = 0.0, gated: bool = False, layout: tuple[int, int, int] | None = None,
               pdl: bool | None = None) -> Tensor:
    """The operator's work: one launch of `_row_kernel` (`reference` where it cannot run, so the operator means the
    same on every device). layout: (outputs per program, columns per load, warps); `default_layout`'s if None.
    With a norm the columns per load cover all inputs (the statistics come from the one load). pdl: launched as a
    programmatic dependent (`PDL` where the GPU has it, if None)."""
    if not kernel_available(x.device):
        return reference(x, weight, norm_weight, residual, eps, gated).contiguous()
    x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 and weight.stride(0) == weight.shape[1] else weight.contiguous()
    k = x.shape[-1]
    n = weight.shape[0] // (2 if gated else 1)
    block_n, block_k, warps = default_layout(k, gated) if layout is None else layout
    block_k = min(block_k, triton.next_power_of_2(k))
    if norm_weight is not None:
        block_k = triton.next_power_of_2(k)
    pdl = (PDL if pdl is None else pdl) and pdl_available(x.device)
    y = x.new_empty(n)
    _row_kernel[(triton.cdiv(n, block_n),)](
        x, weight, x if norm_weight is None else norm_weight.contiguous(),
        y if residual is None else residual.contiguous(), y, n, float(eps),
        K=k, NORM=norm_weight is not None, RES=residual is not None, GATED=gated,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )
    return y


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _row_kernel(X, W, NW, R, Y, N, eps, K: tl.constexpr, NORM: tl.constexpr, RES: tl.constexpr,
                    GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        dtype = Y.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < N
        w_rows = rows[:, None].to(tl.int64) * K
        u_rows = (rows[:, None] + N).to(tl.int64) * K
        if PDL:
            gdc_launch_dependents()
        # the first columns' weights before waiting for the previous kernel: nothing writes them
        cols = tl.arange(0, BLOCK_K)
        m = live[:, None] & (cols < K)[None, :]
        w = tl.load(W + w_rows + cols[None, :], mask=m, other=0.0)
        u = w
        if GATED:
            u = tl.load(W + u_rows + cols[None, :], mask=m, other=0.0)
        if PDL:
            gdc_wait()
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            inside = cols < K
            if k0 > 0:
                m = live[:, None] & inside[None, :]
                w = tl.load(W + w_rows + cols[None, :], mask=m, other=0.0)
                if GATED:
                    u = tl.load(W + u_rows + cols[None, :], mask=m, other=0.0)
            a = tl.load(X + cols, mask=inside, other=0.0).to(tl.float32)
            if NORM:  # one load holds all K inputs (run_kernel): the RMS of the row, then RMSNorm's roundings
                rstd = tl.rsqrt(tl.sum(a * a, axis=0) / K + eps)
                a = (a * rstd).to(dtype).to(tl.float32)
                a = (tl.load(NW + cols, mask=inside, other=0.0).to(tl.float32) * a).to(dtype).to(tl.float32)
            acc += w.to(tl.float32) * a[None, :]
            if GATED:
                acc_up += u.to(tl.float32) * a[None, :]
        y = tl.sum(acc, axis=1).to(dtype).to(tl.float32)
        if GATED:  # silu(gate) * up, each rounded to the model's dtype as the eager layer's tensors are
            up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
            y = (y * tl.sigmoid(y)).to(dtype).to(tl.float32) * up
            y = y.to(dtype).to(tl.float32)
        if RES:
            y = tl.load(R + rows, mask=live, other=0.0).to(tl.float32) + y
        tl.store(Y + rows, y.to(dtype), mask=live)
