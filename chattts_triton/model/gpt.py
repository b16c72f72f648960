"""The ChatTTS acoustic model (Embed + 20-layer Llama + heads) with a paged KV cache.

TorchScript-able (`torch.jit.script`). The engine owns the cache tensors and passes them in. The cache
is a pool of pages of `KV_PAGE_TOKENS` positions; each request's positions start at 0 and its block
table row (`tables`, page ids in order) says where they live, so no left padding is ever needed and a
request computes the same numbers whichever batch or pages it gets. Page 0 is scratch: padding writes
land there and nothing attends it.

Cache layout: k_cache / v_cache [layers, pages, page positions, kv_heads, head_dim].
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import KV_CACHE_DTYPES, PRECISIONS, Arch, GPTDims
from .assets import AssetError, load_safetensors
from .attention import decode_attention
from .rowops import row_matvec

# a precision's torch dtype (config.PRECISIONS names them without torch): the GPT's weights and its engine's
# activations and KV cache
DTYPES = {k: getattr(torch, v) for k, v in PRECISIONS.items()}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def cache_dtype(dtype: str, kv_cache_dtype: str = "auto") -> torch.dtype:
    """The KV cache's torch dtype: the precision's, or config.KV_CACHE_DTYPES's."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    name = KV_CACHE_DTYPES[kv_cache_dtype]
    return DTYPES[dtype] if name is None else getattr(torch, name)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def gemv_linear(h: Tensor, weight: Tensor) -> Tensor:
    """`F.linear(h, weight)` without bias, as products summed over the input features in fp32 (as a GEMM accumulates).
    For one row under torch.compile, inductor makes it a reduction kernel of its own that reads the weight once,
    fused with the casts and elementwise work around it, where cuBLAS launches a GEMM whose time for one row is its
    launch, not its bytes. Eager, it would materialise every product: compiled graphs only (`ChatTTSGPT.set_gemv`)."""
    return (h.unsqueeze(-2).float() * weight.float()).sum(-1).to(h.dtype)


class GemvLinear(nn.Linear):
    """nn.Linear whose calls of one row traced by torch.compile are `gemv_linear`; every other call is nn.Linear's
    (`ChatTTSGPT.set_gemv` swaps a projection's class: the same parameters, only this forward differs)."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
            y = gemv_linear(x, self.weight)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return F.linear(x, self.weight, self.bias)


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class DecoderLayer(nn.Module):
    def __init__(self, d: GPTDims):
        super().__init__()
        self.heads = d.heads
        self.kv_heads = d.kv_heads
        self.head_dim = d.head_dim
        self.input_layernorm = RMSNorm(d.hidden, d.rms_eps)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.rms_eps)
        self.q_proj = nn.Linear(d.hidden, d.heads * d.head_dim, bias=False)
        self.k_proj = nn.Linear(d.hidden, d.kv_heads * d.head_dim, bias=False)
        self.v_proj = nn.Linear(d.hidden, d.kv_heads * d.head_dim, bias=False)
        self.o_proj = nn.Linear(d.heads * d.head_dim, d.hidden, bias=False)
        self.gate_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.up_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.down_proj = nn.Linear(d.intermediate, d.hidden, bias=False)
        # fuse(): q/k/v and gate/up as one GEMM each; the separate modules are then None
        self.qkv_proj = None
        self.gate_up_proj = None
        # a decode step of one row (compiled or, where a shape was not warmed, eager) computes the projections with
        # their norms, gate and skip connection as `rowops.row_matvec` kernels (`ChatTTSGPT.set_gemv`); fused
        # projections only
        self.row_kernels = False

    def fuse(self) -> None:
        """One GEMM for q/k/v and one for gate/up instead of five: each output is the same dot product
        (equal to float rounding: a GEMM library may pick other kernels for the wider shape), in fewer
        and larger kernels per decode step."""
        if self.qkv_proj is not None:
            return
        self.qkv_proj = _concat_linear([self.q_proj, self.k_proj, self.v_proj])
        self.gate_up_proj = _concat_linear([self.gate_proj, self.up_proj])
        self.q_proj = self.k_proj = self.v_proj = self.gate_proj = self.up_proj = None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        layer: int,
        write_index: Tensor,
        write_at: list[Tensor | None],
        tables: Tensor,
        attn_len: int,
        mask: Tensor,
        fresh: bool,
        lengths: Tensor | None,
    ) -> Tensor:
        b, t, _ = x.shape
        if not torch.jit.is_scripting():  # (TorchScript does not compile this branch)
            if self.row_kernels and lengths is not None and b * t == 1:
                return self._row_step(x, cos, sin, k_cache, v_cache, layer, write_index, write_at, tables, lengths)
        h = self.input_layernorm(x)
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(h).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                              self.kv_heads * self.head_dim], dim=-1)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q, k, v = self._rope_write(q, k, v, cos, sin, k_cache, v_cache, layer, write_index, write_at)
        if not torch.jit.is_scripting():  # (TorchScript does not compile this branch)
            if lengths is not None:  # a decode step reading each row's own keys only
                attn = decode_attention(q.select(1, 0).contiguous(), k_cache.select(0, layer), v_cache.select(0, layer),
                                        tables, lengths)
                x = x + self.o_proj(attn.reshape(b, t, self.heads * self.head_dim))
                return self._mlp(x)
        if fresh:  # a prefill from position 0: its own keys are all it attends (as the cache would give them)
            keys = k.view(b, t, self.kv_heads, self.head_dim).to(q.dtype)
            values = v.view(b, t, self.kv_heads, self.head_dim).to(q.dtype)
        else:  # the rows' pages in order, cut at the attention length
            page = k_cache.shape[2]
            pages = tables.narrow(1, 0, (attn_len + page - 1) // page)
            keys = _gather_pages(k_cache.select(0, layer), pages, attn_len).to(q.dtype)
            values = _gather_pages(v_cache.select(0, layer), pages, attn_len).to(q.dtype)
        rep = self.heads // self.kv_heads
        if rep > 1:
            keys = keys.repeat_interleave(rep, dim=2)
            values = values.repeat_interleave(rep, dim=2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
        )
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        return self._mlp(x)

    def _rope_write(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                    layer: int, write_index: Tensor, write_at: list[Tensor | None]) -> tuple[Tensor, Tensor, Tensor]:
        """q/k/v [B, T, heads × head_dim] → q rotated [B, T, heads, head_dim], and k/v rotated and written into each
        request's pages, [B × T, kv_heads, head_dim] in the cache's dtype."""
        b, t = q.shape[0], q.shape[1]
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # write this step's keys/values into each request's pages, then attend over them
        k = k.reshape(b * t, self.kv_heads, self.head_dim)
        v = v.reshape(b * t, self.kv_heads, self.head_dim)
        if torch.jit.is_scripting():  # the exported path: one index_copy_ into the layer's flat positions (its
            # engines keep their precision's cache)
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            n, page = k_cache.shape[1], k_cache.shape[2]
            k_cache.select(0, layer).view(n * page, self.kv_heads, self.head_dim).index_copy_(0, write_index, k)
            v_cache.select(0, layer).view(n * page, self.kv_heads, self.head_dim).index_copy_(0, write_index, v)
        else:  # torch.compile: one index_put_ on the whole cache stays in place (through a view,
            # the compiled step copied the whole cache every step)
            k, v = to_cache(k, k_cache.dtype), to_cache(v, v_cache.dtype)
            layer_ids = write_at[0]
            assert layer_ids is not None
            at: list[Tensor | None] = [layer_ids.narrow(0, layer, 1), write_at[1], write_at[2]]
            k_cache.index_put_(at, k)
            v_cache.index_put_(at, v)
        return q, k, v

    @torch.jit.ignore
    def _row_step(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, layer: int,
                  write_index: Tensor, write_at: list[Tensor | None], tables: Tensor, lengths: Tensor) -> Tensor:
        """The decode step of one row (x [1, 1, hidden]) through four `row_matvec` kernels: norm + q/k/v; o + skip;
        norm + gate/up + silu·up; down + skip. The same numbers as `forward` up to a sum's order."""
        assert self.qkv_proj is not None and self.gate_up_proj is not None
        eps = self.input_layernorm.eps
        x1 = x.view(-1)
        qkv = row_matvec(x1, self.qkv_proj.weight, self.input_layernorm.weight, None, eps, False).view(1, 1, -1)
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q, k, v = self._rope_write(q, k, v, cos, sin, k_cache, v_cache, layer, write_index, write_at)
        attn = decode_attention(q.select(1, 0).contiguous(), k_cache.select(0, layer), v_cache.select(0, layer),
                                tables, lengths)
        x1 = row_matvec(attn.reshape(-1), self.o_proj.weight, None, x1, 0.0, False)
        act = row_matvec(x1, self.gate_up_proj.weight, self.post_attention_layernorm.weight, None,
                         self.post_attention_layernorm.eps, True)
        return row_matvec(act, self.down_proj.weight, None, x1, 0.0, False).view(1, 1, -1)

    def _mlp(self, x: Tensor) -> Tensor:
        h = self.post_attention_layernorm(x)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = self.gate_proj(h), self.up_proj(h)
        return x + self.down_proj(F.silu(gate) * up)


def _concat_linear(parts: list[nn.Linear | None]) -> nn.Linear:
    ws = [p.weight for p in parts if p is not None]
    w = torch.cat(ws).detach()
    fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    fused.weight = nn.Parameter(w, requires_grad=False)
    return fused


def to_cache(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in the cache's dtype. An fp8 cache (config.KV_CACHE_DTYPES) saturates: a cast to e4m3 makes NaN of what
    lies past its largest finite value, where a saturated key only sharpens its attention a little."""
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def _gather_pages(pool: Tensor, pages: Tensor, length: int) -> Tensor:
    """pool [pages, page, kvh, d], pages [B, n] → the rows' positions 0..length-1 [B, length, kvh, d]."""
    b, n = pages.shape[0], pages.shape[1]
    return pool.index_select(0, pages.reshape(-1)).view(b, n * pool.shape[1], pool.shape[2],
                                                        pool.shape[3]).narrow(1, 0, length)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ChatTTSGPT(nn.Module):
    """Embeddings, transformer with a paged KV cache, text head and code heads (weight norm folded)."""

    def __init__(self, arch: Arch):
        super().__init__()
        d = arch.gpt
        self.hidden = d.hidden
        self.num_vq = arch.num_vq
        self.num_audio_tokens = arch.num_audio_tokens
        self.layers_n = d.layers
        self.gemv = False  # one row's code heads as `gemv_linear` under torch.compile (`set_gemv`)
        # decode steps through `attention.decode_attention` (each row's own keys); set by the engine for the
        # eager module (torch.compile or eager on a GPU), never in TorchScript
        self.decode_kernel = False
        self.kv_heads = d.kv_heads
        self.head_dim = d.head_dim
        self.emb_text = nn.Embedding(arch.num_text_tokens, d.hidden)
        self.emb_code = nn.Parameter(torch.zeros(arch.num_vq, arch.num_audio_tokens, d.hidden))
        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(d.layers)])
        self.norm = RMSNorm(d.hidden, d.rms_eps)
        self.head_text = nn.Parameter(torch.zeros(arch.num_text_tokens, d.hidden))
        self.head_code = nn.Parameter(torch.zeros(arch.num_vq, arch.num_audio_tokens, d.hidden))
        inv_freq = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.int64).float() / d.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # offsets to index the flattened [codebook, token] code embedding table
        self.register_buffer(
            "code_offsets", torch.arange(arch.num_vq, dtype=torch.int64) * arch.num_audio_tokens, persistent=False
        )

    @torch.jit.ignore
    def fuse_projections(self) -> ChatTTSGPT:
        """Every layer's q/k/v and gate/up as one GEMM each (`DecoderLayer.fuse`)."""
        for layer in self.layers:
            layer.fuse()
        return self

    @torch.jit.ignore
    def set_gemv(self, on: bool, kernels: bool = False) -> ChatTTSGPT:
        """Decode steps of one row traced by torch.compile compute their projections and code heads as products
        summed in fp32 (`gemv_linear`), which inductor fuses into reductions of its own, instead of cuBLAS GEMMs;
        eager calls and more rows keep the GEMMs. kernels: with `on`, the layers of a decode step of one row, compiled
        or eager, run their projections as `rowops.row_matvec` kernels instead (each fused with its norm, gate or skip
        connection; layers with fused, unquantized projections)."""
        self.gemv = bool(on)
        for layer in self.layers:
            plain = True
            for name in PROJECTIONS:
                m = getattr(layer, name)
                if type(m) in (nn.Linear, GemvLinear):  # not an int8 model's quantized linears
                    m.__class__ = GemvLinear if self.gemv else nn.Linear
                elif m is not None:
                    plain = False
            layer.row_kernels = self.gemv and kernels and plain and layer.qkv_proj is not None
        return self

    @torch.jit.export
    def embed_text(self, ids: Tensor) -> Tensor:
        """ids [...] → [..., hidden]"""
        return self.emb_text(ids)

    @torch.jit.export
    def embed_code(self, codes: Tensor) -> Tensor:
        """codes [..., num_vq] → sum of the per-codebook embeddings [..., hidden]"""
        table = self.emb_code.view(self.num_vq * self.num_audio_tokens, self.hidden)
        return F.embedding(codes + self.code_offsets, table).sum(-2)

    @torch.jit.export
    def logits_code(self, h: Tensor) -> Tensor:
        """h [B, hidden] → float logits [B, num_vq, num_audio_tokens]"""
        if not torch.jit.is_scripting():  # (TorchScript does not compile this branch)
            if self.gemv and torch.compiler.is_compiling() and h.shape[0] == 1:
                table = self.head_code.to(h.dtype).view(self.num_vq * self.num_audio_tokens, self.hidden)
                return gemv_linear(h, table).view(1, self.num_vq, self.num_audio_tokens).float()
        return torch.einsum("bh,qah->bqa", h, self.head_code.to(h.dtype)).float()

    @torch.jit.export
    def logits_text(self, h: Tensor) -> Tensor:
        """h [B, hidden] → float logits [B, num_text_tokens]"""
        return F.linear(h, self.head_text.to(h.dtype)).float()

    def forward(self, x: Tensor, positions: Tensor, tables: Tensor, k_cache: Tensor, v_cache: Tensor,
                attn_len: int) -> Tensor:
        """One prefill or decode step.

        x [B, T, hidden]; positions [B, T] int64 (absolute, -1 = padding: written to the scratch page
        and never attended); tables [B, W] int64: row i's pages (its positions p live in page
        tables[i, p // page]); attn_len = 1 + the largest position in the step. Returns the final-norm
        hidden states [B, T, hidden].
        """
        return self._layers(x, positions, tables, k_cache, v_cache, attn_len, False)

    @torch.jit.export
    def prefill(self, x: Tensor, positions: Tensor, tables: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Prompts from position 0: row i is written to the pages tables[i] and attends only its own
        prompt (the cache holds nothing before it). positions [B, T] are 0.. then -1 (padding); a row of
        all -1 (bucket padding) computes without effect (its writes land in the scratch page)."""
        return self._layers(x, positions, tables, k_cache, v_cache, x.shape[1], True)

    def _layers(self, x: Tensor, positions: Tensor, tables: Tensor, k_cache: Tensor, v_cache: Tensor,
                attn_len: int, fresh: bool) -> Tensor:
        b, t, _ = x.shape
        page = k_cache.shape[2]
        valid = positions >= 0
        pos = torch.where(valid, positions, torch.zeros_like(positions))
        # each position's page and place in it; padding goes to the scratch page 0
        blocks = torch.where(valid, tables.gather(1, torch.div(pos, page, rounding_mode="floor")),
                             torch.zeros_like(pos))
        places = torch.where(valid, torch.remainder(pos, page), torch.zeros_like(pos))
        write_index = (blocks * page + places).reshape(b * t)  # within a layer (TorchScript)
        write_at: list[Tensor | None] = []
        if not torch.jit.is_scripting():  # (layer ids, page, place) for torch.compile's index_put_
            layer_ids = torch.arange(self.layers_n, dtype=torch.int64, device=x.device)
            write_at = [layer_ids, blocks.reshape(b * t), places.reshape(b * t)]
        freqs = pos.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype).unsqueeze(2)
        sin = emb.sin().to(x.dtype).unsqueeze(2)
        key_pos = torch.arange(attn_len, device=x.device)
        allowed = key_pos.view(1, 1, attn_len) <= pos.unsqueeze(-1)  # [B, T, attn_len]
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(~allowed, float("-inf")).unsqueeze(1)
        lengths: Tensor | None = None
        if not torch.jit.is_scripting():
            if self.decode_kernel and t == 1 and not fresh:
                lengths = pos.select(1, 0) + 1  # keys 0..pos, as the mask allows
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, k_cache, v_cache, i, write_index, write_at, tables, attn_len, mask, fresh, lengths)
        return self.norm(x)

    @torch.jit.export
    def new_cache(self, pages: int, page: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        """Keys and values of `pages` pages of `page` positions (page 0: scratch). Zeros: a page's places past
        a row's length are masked, but a masked score times a value must not be NaN."""
        shape = [self.layers_n, pages, page, self.kv_heads, self.head_dim]
        return [torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)]


def _fold_weight_norm(sd: dict[str, Tensor], prefix: str) -> Tensor:
    """weight_norm(dim=0): W = g * v / ||v|| with the norm over each output row."""
    g = sd[f"{prefix}.parametrizations.weight.original0"]
    v = sd[f"{prefix}.parametrizations.weight.original1"]
    return torch._weight_norm(v, g, 0)


def load_gpt(folder: Path, arch: Arch, fused: bool = True) -> ChatTTSGPT:
    """Build ChatTTSGPT from `gpt/model.safetensors` and `Embed.safetensors` of an asset folder;
    fused: q/k/v and gate/up as one GEMM each (`fuse_projections`)."""
    folder = Path(folder)
    model = ChatTTSGPT(arch)
    llama = load_safetensors(folder / "gpt/model.safetensors")
    llama = {k[len("model."):] if k.startswith("model.") else k: v for k, v in llama.items()}
    emb = load_safetensors(folder / "Embed.safetensors")
    sd: dict[str, Tensor] = {
        "emb_text.weight": emb["emb_text.weight"],
        "emb_code": torch.stack([emb[f"emb_code.{i}.weight"] for i in range(arch.num_vq)]),
        "head_text": _fold_weight_norm(emb, "head_text"),
        "head_code": torch.stack([_fold_weight_norm(emb, f"head_code.{i}") for i in range(arch.num_vq)]),
        "norm.weight": llama["norm.weight"],
    }
    names = {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "post_attention_layernorm.weight",
        "self_attn.q_proj.weight": "q_proj.weight",
        "self_attn.k_proj.weight": "k_proj.weight",
        "self_attn.v_proj.weight": "v_proj.weight",
        "self_attn.o_proj.weight": "o_proj.weight",
        "mlp.gate_proj.weight": "gate_proj.weight",
        "mlp.up_proj.weight": "up_proj.weight",
        "mlp.down_proj.weight": "down_proj.weight",
    }
    for i in range(arch.gpt.layers):
        for src, dst in names.items():
            key = f"layers.{i}.{src}"
            if key not in llama:
                raise AssetError(f"gpt/model.safetensors: tensor {key!r} is missing")
            sd[f"layers.{i}.{dst}"] = llama[key]
    expected = model.state_dict()
    for k, v in sd.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise AssetError(f"{k}: shape {tuple(v.shape)} does not match the architecture {tuple(expected[k].shape)}")
    model.load_state_dict(sd, strict=True)
    if fused:
        model.fuse_projections()
    return model.eval()


def eager_from_script(script, arch: Arch) -> ChatTTSGPT:
    """The plain module holding an exported gpt.pt's weights (what torch.compile traces: it cannot
    trace TorchScript), its projections fused whether or not the export fused them. Cast before
    loading, as the export did, so buffers match too."""
    sd = dict(script.state_dict())
    dtype, device = sd["norm.weight"].dtype, sd["norm.weight"].device
    model = ChatTTSGPT(arch).to(dtype)
    fused_export = "layers.0.qkv_proj.weight" in sd
    if fused_export:
        model.fuse_projections()
    # TorchScript keeps the non-persistent buffers in its state_dict: take them as exported
    buffers = {k: sd.pop(k) for k in ("inv_freq", "code_offsets") if k in sd}
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:  # e.g. an int8 (CPU-only) export
        raise AssetError(f"gpt.pt does not hold plain {dtype} weights of this architecture: {e}") from None
    for k, v in buffers.items():
        getattr(model, k).copy_(v)
    if not fused_export:
        model.fuse_projections()
    return model.to(device).eval()
