"""Upstream ChatTTS sampling, batched over rows that each carry their own parameters.

Order as upstream `GPT.generate`: logits / temperature → repetition penalty over the last 16
generated tokens → top-P → top-K (both keep at least 3 tokens) → EOS masked while fewer than
`min_new_token` tokens exist → softmax → draw. All rows are processed together on the device;
nothing here syncs with the host.

The draw uses a counter-based generator: the uniform number of a row depends only on
(seed, step, row-within-request, attempt), so a request samples the same tokens whatever batch it
shares and on whichever device it runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import MIN_TOKENS_TO_KEEP, REPETITION_WINDOW

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (lowbias32-style) on int64 tensors holding values < 2**32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


_SALT = 0x9E3779B9  # the hash maps 0 to 0: without it seed 0's first draw was u = 0 exactly


def uniform(seed: Tensor, step: Tensor, row: Tensor, attempt: Tensor) -> Tensor:
    """Deterministic uniform per row from int64 tensors of equal shape, in (0, 1) strictly: one of
    2**23 float32 values (k + 1/2) / 2**23. A 0 drew the first token of positive probability however
    small (seed 0's first draw picked a token of probability 1e-44 over the favourite); a 1 (float32
    rounding of 32 bits) drew past the last."""
    h = _mix32((seed & _MASK32) ^ _SALT)
    h = _mix32(h ^ ((seed >> 32) & _MASK32))
    h = _mix32(h ^ (step & _MASK32))
    h = _mix32(h ^ (row & _MASK32))
    h = _mix32(h ^ (attempt & _MASK32))
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def repetition_penalty(logits: Tensor, history: Tensor, history_len: Tensor, penalty: Tensor) -> Tensor:
    """Upstream CustomRepetitionPenaltyLogitsProcessorRepeat, one window per row.

    history [R, W] holds each row's last W generated tokens (left part unused when fewer exist);
    history_len [R] how many of them are real; penalty [R].
    """
    r, w = history.shape
    v = logits.shape[1]
    used = torch.arange(w, device=logits.device).unsqueeze(0) >= (w - history_len.clamp(max=w)).unsqueeze(1)
    freq = torch.zeros(r, v, device=logits.device, dtype=logits.dtype)
    # unused places may hold stale ids of another vocabulary: point them at 0 (they add nothing)
    freq.scatter_add_(1, torch.where(used, history, torch.zeros_like(history)), used.to(logits.dtype))
    alpha = torch.pow(penalty.unsqueeze(1), freq)
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def top_p_filter(logits: Tensor, top_p: Tensor) -> Tensor:
    """transformers TopPLogitsWarper(top_p, min_tokens_to_keep=3) with a top_p per row."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p).unsqueeze(1)
    remove[..., -MIN_TOKENS_TO_KEEP:].fill_(False)  # an in-place kernel: safe in CUDA graph capture
    remove = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(remove, float("-inf"))


def top_k_filter(logits: Tensor, top_k: Tensor) -> Tensor:
    """transformers TopKLogitsWarper(top_k, min_tokens_to_keep=3) with a top_k per row."""
    v = logits.shape[1]
    k = top_k.clamp(min=MIN_TOKENS_TO_KEEP, max=v)
    sorted_desc = torch.sort(logits, dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_top_k_filter(logits: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """`top_p_filter` then `top_k_filter` (each only on the rows whose top_p < 1 / top_k > 0), the same values
    from one sort instead of two: top-P keeps the m largest logits, so top-K's k-th largest of what it leaves is
    the k-th largest of all where k <= m, and where k > m that value is below all m kept (none removed)."""
    v = logits.shape[1]
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p.clamp(max=1.0)).unsqueeze(1)
    remove[..., -MIN_TOKENS_TO_KEEP:].fill_(False)  # an in-place kernel: safe in CUDA graph capture
    remove &= (top_p < 1.0).unsqueeze(1)
    logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    k = top_k.clamp(min=MIN_TOKENS_TO_KEEP, max=v)
    kth = sorted_logits.gather(1, (v - k).unsqueeze(1))
    return torch.where((top_k > 0).unsqueeze(1), logits.masked_fill(logits < kth, float("-inf")), logits)


def process_logits(
    logits: Tensor,
    temperature: Tensor,
    penalty: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    history: Tensor,
    history_len: Tensor,
    forbid_eos: Tensor,
    eos: Tensor,
) -> Tensor:
    """Everything upstream does to the logits before the softmax. All parameters are per row;
    top_p ≥ 1 and top_k ≤ 0 switch that filter off for the row (upstream `None`); eos [R] is each
    row's end token, masked while forbid_eos."""
    logits = logits / temperature.unsqueeze(1)
    apply_pen = penalty != 1.0
    penalised = repetition_penalty(logits, history, history_len, penalty)
    logits = torch.where(apply_pen.unsqueeze(1), penalised, logits)
    logits = top_p_top_k_filter(logits, top_p, top_k)
    col = eos.unsqueeze(1)  # each row's EOS id
    masked = logits.gather(1, col).masked_fill(forbid_eos.unsqueeze(1), float("-inf"))
    return logits.scatter(1, col, masked)


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw of one token per row from probabilities [R, V] with uniforms [R] (or, several draws of
    each row from the same probabilities, [R, A] → tokens [R, A])."""
    many = u.dim() == 2
    cdf = probs.cumsum(dim=-1)
    target = (u if many else u.unsqueeze(1)) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True)
    # u * total can round up to the total: never past the last token of positive probability
    v = probs.shape[1]
    last = v - 1 - torch.argmax(probs.flip(-1).gt(0).to(torch.uint8), dim=-1)
    idx = torch.minimum(idx, last.unsqueeze(1))
    return idx if many else idx.squeeze(1)


def sample(logits: Tensor, u: Tensor) -> Tensor:
    return draw(torch.softmax(logits, dim=-1), u)


def window(tokens: Tensor, n: int = REPETITION_WINDOW) -> Tensor:
    """Last n tokens of [R, T] as [R, n], left-filled with zeros when T < n."""
    r, t = tokens.shape
    if t >= n:
        return tokens[:, t - n :]
    out = torch.zeros(r, n, dtype=tokens.dtype, device=tokens.device)
    out[:, n - t :] = tokens
    return out
