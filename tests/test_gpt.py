"""The GPT (chattts_triton/model/gpt.py) against upstream ChatTTS `GPT` (HF LlamaModel with its cache) on the
same weights: prefill, cached decode over pages, exported forms, reduced precision."""

from __future__ import annotations

import pytest
import torch

from chattts_triton.config import KV_PAGE_TOKENS
from chattts_triton.model.assets import infer_arch
from chattts_triton.model.gpt import load_gpt
from chattts_triton.runtime.engine import EngineError
from tests.engine_util import REDUCED_BOUNDS, load_gpt_like, make_engine, upstream_gpt


def test_prefill_and_cached_decode_match_llama_with_its_cache(tiny):
    """Keys and values in scattered pages of the pool (the block table's order, not the pool's)."""
    from transformers import DynamicCache

    arch, emb, g, ours = tiny
    torch.manual_seed(0)
    ids = torch.randint(0, arch.num_text_tokens, (1, 17))
    kc, vc = ours.new_cache(9, KV_PAGE_TOKENS, torch.float32, torch.device("cpu"))
    tables = torch.tensor([[5, 2, 8, 3]])  # positions 0-15 in page 5, 16-31 in page 2, ...
    with torch.no_grad():
        out = g.gpt(inputs_embeds=emb.emb_text(ids), use_cache=True, past_key_values=DynamicCache())
        h = ours(ours.embed_text(ids), torch.arange(17).unsqueeze(0), tables, kc, vc, 17)
        assert (out.last_hidden_state - h).abs().max() <= 1e-4
        up_text = emb.head_text(out.last_hidden_state[:, -1])
        assert (up_text - ours.logits_text(h[:, -1])).abs().max() <= 1e-4
        pkv = out.past_key_values
        for step in range(20):
            codes = torch.randint(0, 626, (1, 1, 4))
            e_up = torch.stack([emb.emb_code[i](codes[:, :, i]) for i in range(4)], 3).sum(3)
            o = g.gpt(inputs_embeds=e_up, past_key_values=pkv, use_cache=True, position_ids=torch.tensor([[17 + step]]))
            pkv = o.past_key_values
            hm = ours(ours.embed_code(codes), torch.tensor([[17 + step]]), tables, kc, vc, 18 + step)
            assert (o.last_hidden_state - hm).abs().max() <= 1e-4
            up_codes = torch.stack([emb.head_code[i](o.last_hidden_state[:, -1]) for i in range(4)], 1)
            assert (up_codes - ours.logits_code(hm[:, -1])).abs().max() <= 1e-4
    assert kc[:, [1, 4, 6, 7]].abs().sum() == 0  # pages no row holds are never written


@pytest.mark.parametrize("scripted", [False, True])
def test_prefill_equals_the_forward_over_the_same_pages(tiny, scripted):
    """`prefill` (attention over the prompt's own keys: what a CUDA graph can replay for any pages)
    computes what `forward` over the same block tables does, and writes the same cache; a bucket-padding
    row (all positions -1) writes only the scratch page 0, which nothing reads."""
    arch, _, _, ours = tiny
    model = torch.jit.script(ours) if scripted else ours
    g = torch.Generator().manual_seed(3)
    lens, t, page = [7, 20, 3], 20, KV_PAGE_TOKENS
    ids = torch.randint(0, arch.num_text_tokens, (len(lens), t), generator=g)
    pos = torch.full((len(lens) + 1, t), -1, dtype=torch.int64)
    for i, n in enumerate(lens):
        pos[i, :n] = torch.arange(n)
    x = model.embed_text(torch.cat([ids, ids[:1]]))
    tables = torch.tensor([[3, 0], [6, 1], [2, 0], [3, 0]])  # the padding row points at the first row's pages
    with torch.no_grad():
        kf, vf = model.new_cache(7, page, torch.float32, torch.device("cpu"))
        for c in (kf, vf):
            c.normal_(generator=g)  # an earlier occupant's leftovers
        kp, vp = kf.clone(), vf.clone()
        h_fwd = model(x[:3], pos[:3], tables[:3], kf, vf, t)
        h_pre = model.prefill(x, pos, tables, kp, vp)
    for i, n in enumerate(lens):
        assert torch.allclose(h_pre[i, :n], h_fwd[i, :n], atol=1e-6, rtol=0)
    read = torch.ones(7, dtype=torch.bool)
    read[0] = False  # scratch: padding writes land there
    assert torch.equal(kp[:, read], kf[:, read]) and torch.equal(vp[:, read], vf[:, read])


class _ExportBeforePages(torch.nn.Module):
    """A gpt.pt exported before the paged cache: its forward takes a slot range."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, x, positions, slot_start: int, k_cache, v_cache, attn_len: int):
        raise AssertionError("never called")


def test_an_export_before_the_paged_cache_is_refused_with_what_to_do(tiny):
    arch, _, _, ours = tiny
    with pytest.raises(EngineError, match="re-export"):
        make_engine(_ExportBeforePages(ours), arch, start=False)


@pytest.mark.parametrize("dtype", list(REDUCED_BOUNDS))
@pytest.mark.parametrize("size", ["tiny", pytest.param("full", marks=pytest.mark.slow)])
def test_reduced_precision_gpt_stays_within_stated_bound(request, size, dtype):
    from transformers import DynamicCache

    folder = request.getfixturevalue(f"{size}_assets")
    arch, emb, g = upstream_gpt(folder)
    ours = torch.jit.script(load_gpt(folder, arch).to(dtype))
    rel_bound, logit_bound = REDUCED_BOUNDS[dtype]
    ids = torch.randint(0, 21000, (1, 30), generator=torch.Generator().manual_seed(0))
    kc, vc = ours.new_cache(5, KV_PAGE_TOKENS, dtype, torch.device("cpu"))
    tables = torch.tensor([[4, 1, 3, 2]])
    with torch.no_grad():
        out = g.gpt(inputs_embeds=emb.emb_text(ids), use_cache=True, past_key_values=DynamicCache())
        pkv = out.past_key_values
        ref = out.last_hidden_state
        h = ours(ours.embed_text(ids), torch.arange(30).unsqueeze(0), tables, kc, vc, 30).float()
        for step in range(21):
            assert ((h - ref).norm() / ref.norm()).item() <= rel_bound
            up_logits = torch.stack([emb.head_code[i](ref[:, -1]) for i in range(4)], 1)
            assert (ours.logits_code(h[:, -1].to(dtype)) - up_logits).abs().max().item() <= logit_bound
            codes = torch.randint(0, 626, (1, 1, 4), generator=torch.Generator().manual_seed(step))
            e_up = torch.stack([emb.emb_code[i](codes[:, :, i]) for i in range(4)], 3).sum(3)
            o = g.gpt(inputs_embeds=e_up, past_key_values=pkv, use_cache=True, position_ids=torch.tensor([[30 + step]]))
            pkv, ref = o.past_key_values, o.last_hidden_state
            h = ours(ours.embed_code(codes), torch.tensor([[30 + step]]), tables, kc, vc, 31 + step).float()


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", ["tiny", pytest.param("full", marks=pytest.mark.slow)])
def test_an_fp8_cache_stays_within_the_bf16_bound_of_upstream(request, size, compute):
    """kv_cache_dtype fp8: the module the compiled step traces, its keys and values held as e4m3 (one byte each),
    prefill and 21 cached decode steps against upstream fp32 with its own cache: within the bound of a bf16 engine
    (REDUCED_BOUNDS; docs/performance.md has the errors measured). The cache really is one byte a value, and
    finite."""
    from transformers import DynamicCache

    folder = request.getfixturevalue(f"{size}_assets")
    arch, emb, g = upstream_gpt(folder)
    ours = load_gpt(folder, arch).to(compute)
    rel_bound, logit_bound = REDUCED_BOUNDS[torch.bfloat16]
    ids = torch.randint(0, 21000, (1, 30), generator=torch.Generator().manual_seed(0))
    kc, vc = ours.new_cache(5, KV_PAGE_TOKENS, torch.float8_e4m3fn, torch.device("cpu"))
    tables = torch.tensor([[4, 1, 3, 2]])
    with torch.no_grad():
        out = g.gpt(inputs_embeds=emb.emb_text(ids), use_cache=True, past_key_values=DynamicCache())
        pkv, ref = out.past_key_values, out.last_hidden_state
        h = ours(ours.embed_text(ids), torch.arange(30).unsqueeze(0), tables, kc, vc, 30).float()
        for step in range(21):
            assert ((h - ref).norm() / ref.norm()).item() <= rel_bound, step
            up_logits = torch.stack([emb.head_code[i](ref[:, -1]) for i in range(4)], 1)
            assert (ours.logits_code(h[:, -1].to(compute)).float() - up_logits).abs().max().item() <= logit_bound
            codes = torch.randint(0, 626, (1, 1, 4), generator=torch.Generator().manual_seed(step))
            e_up = torch.stack([emb.emb_code[i](codes[:, :, i]) for i in range(4)], 3).sum(3)
            o = g.gpt(inputs_embeds=e_up, past_key_values=pkv, use_cache=True, position_ids=torch.tensor([[30 + step]]))
            pkv, ref = o.past_key_values, o.last_hidden_state
            h = ours(ours.embed_code(codes), torch.tensor([[30 + step]]), tables, kc, vc, 31 + step).float()
    assert kc.element_size() == 1 and torch.isfinite(kc.float()).all() and kc.float().abs().max() > 0


def test_values_past_e4m3s_range_are_cached_saturated_not_as_nan():
    from chattts_triton.model.gpt import FP8_MAX, to_cache

    x = torch.tensor([1000.0, -1e9, 448.0, 1.0, 0.3])
    got = to_cache(x, torch.float8_e4m3fn).float()
    assert got.tolist() == [FP8_MAX, -FP8_MAX, 448.0, 1.0, 0.3125]
    assert torch.isnan(x.to(torch.float8_e4m3fn).float()[0])  # the plain cast, which it guards against
    assert torch.equal(to_cache(x, torch.bfloat16), x.to(torch.bfloat16))  # other caches: the plain cast


@pytest.mark.parametrize("fused_export", [True, False])
def test_eager_module_from_the_exported_torchscript_computes_the_same(tiny, fused_export):
    """torch.compile traces the plain module rebuilt from gpt.pt's weights, buffers included; it has
    its projections fused, also from a gpt.pt exported before they were (then to rounding)."""
    from chattts_triton.model.gpt import eager_from_script

    arch, _, _, ours = tiny
    for dtype in (torch.float32, torch.bfloat16):
        script = torch.jit.script(load_gpt_like(ours, arch, dtype, fused_export))
        assert ("layers.0.qkv_proj.weight" in script.state_dict()) == fused_export
        eager = eager_from_script(script, arch)
        assert not isinstance(eager, torch.jit.ScriptModule)
        assert all(layer.qkv_proj is not None and layer.q_proj is None for layer in eager.layers)
        assert eager.inv_freq.dtype == script.inv_freq.dtype and torch.equal(eager.inv_freq, script.inv_freq)
        torch.manual_seed(1)
        ids = torch.randint(0, arch.num_text_tokens, (2, 9))
        outs = []
        for m in (script, eager):
            kc, vc = m.new_cache(4, KV_PAGE_TOKENS, dtype, torch.device("cpu"))
            with torch.no_grad():
                outs.append(m(m.embed_text(ids), torch.arange(9).expand(2, 9), torch.tensor([[2], [3]]), kc, vc, 9))
        if fused_export:
            assert torch.equal(outs[0], outs[1])
        else:
            assert torch.allclose(outs[0].float(), outs[1].float(),
                                  atol=1e-5 if dtype == torch.float32 else 0.1, rtol=0)


@pytest.mark.parametrize("scripted", [False, True])
def test_fused_projections_compute_what_the_separate_ones_do(tiny_assets, scripted):
    """q/k/v and gate/up as one GEMM each (the default) against the five separate ones, decode
    steps and prefill, cache writes included (fp32: the same dot products, to rounding)."""
    arch = infer_arch(tiny_assets)
    sep, fused = load_gpt(tiny_assets, arch, fused=False), load_gpt(tiny_assets, arch)
    assert sep.layers[0].qkv_proj is None and fused.layers[0].q_proj is None
    assert sum(p.numel() for p in sep.parameters()) == sum(p.numel() for p in fused.parameters())
    if scripted:
        sep, fused = torch.jit.script(sep), torch.jit.script(fused)
    torch.manual_seed(2)
    x = sep.embed_text(torch.randint(0, arch.num_text_tokens, (3, 11)))
    pos = torch.arange(11).expand(3, 11)
    outs = []
    for m in (sep, fused):
        kc, vc = m.new_cache(4, KV_PAGE_TOKENS, torch.float32, torch.device("cpu"))
        tables = torch.tensor([[3], [1], [2]])
        with torch.no_grad():
            h = m.prefill(x, pos, tables, kc, vc)
            step = m(x[:, :1], torch.full((3, 1), 11), tables, kc, vc, 12)
        outs.append((h, step, kc, vc))
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
