"""GPT + engine against upstream ChatTTS `GPT` (HF LlamaModel with its cache) on the same weights."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from chattts_triton.config import KV_PAGE_TOKENS
from chattts_triton.model import sampling
from chattts_triton.model.assets import infer_arch
from chattts_triton.model.gpt import load_gpt
from chattts_triton.runtime.engine import Engine, EngineError, GenRequest, SamplingParams


def upstream_gpt(folder):
    from ChatTTS.model import GPT, Embed

    arch = infer_arch(folder)
    emb = Embed(arch.gpt.hidden, arch.num_audio_tokens, arch.num_text_tokens, arch.num_vq)
    emb.load_pretrained(f"{folder}/Embed.safetensors", torch.device("cpu"))
    cfg = dict(
        hidden_size=arch.gpt.hidden,
        intermediate_size=arch.gpt.intermediate,
        num_attention_heads=arch.gpt.heads,
        num_hidden_layers=arch.gpt.layers,
        use_cache=False,
        max_position_embeddings=arch.gpt.max_positions,
        spk_emb_dim=192,
        spk_KL=False,
        num_audio_tokens=arch.num_audio_tokens,
        num_text_tokens=arch.num_text_tokens,
        num_vq=arch.num_vq,
    )
    g = GPT(cfg, emb, logger=logging.getLogger("upstream")).eval()
    g.load_pretrained(f"{folder}/gpt", f"{folder}/Embed.safetensors")
    return arch, emb, g


def upstream_generate(emb, g, ids, n_new, min_new, infer_text=False, eos=625, top_p=0.7, top_k=20, pen=1.05):
    from ChatTTS.model import gen_logits

    input_ids = ids.view(1, -1, 1).expand(-1, -1, 4).clone()
    mask = torch.ones(1, ids.numel(), dtype=torch.bool, device=ids.device)
    e = emb(input_ids, mask)
    warp, proc = gen_logits(eos if not infer_text else 21178, top_p, top_k, pen)
    temp = torch.tensor([1e-5] * (1 if infer_text else 4), device=ids.device)
    res = next(
        g.generate(
            e, input_ids, temperature=temp, eos_token=eos, attention_mask=mask, max_new_token=n_new,
            min_new_token=min_new, logits_processors=(*proc, *warp), infer_text=infer_text,
            return_hidden=True, show_tqdm=False,
        )
    )
    return res.ids[0], (res.hiddens[0] if len(res.hiddens) else None)


def greedy(n, min_new, seed=0):
    return SamplingParams(1e-5, 0.7, 20, 1.05, n, min_new, seed=seed)


def make_engine(model, arch, **kw):
    kw.setdefault("max_slots", 4)
    kw.setdefault("max_context", 512)
    kw.setdefault("max_new_tokens", 160)
    return Engine(model, hidden=arch.gpt.hidden, num_vq=arch.num_vq, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_assets):
    arch, emb, g = upstream_gpt(tiny_assets)
    return arch, emb, g, load_gpt(tiny_assets, arch)


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


@pytest.mark.parametrize("scripted", [False, True])
def test_engine_greedy_codes_and_hiddens_equal_upstream_generate(tiny, scripted):
    arch, emb, g, ours = tiny
    model = torch.jit.script(ours) if scripted else ours
    eng = make_engine(model, arch)
    try:
        for seed, (n, min_new) in enumerate([(120, 60), (40, 0), (1, 0)]):
            torch.manual_seed(seed)
            ids = torch.randint(0, 21000, (1 + 9 * seed,))
            up_ids, up_h = upstream_generate(emb, g, ids, n, min_new)
            r = eng.generate(GenRequest(text_ids=ids, params=greedy(n, min_new), on_done=None))
            assert torch.equal(r.tokens, up_ids)
            assert r.hiddens.shape == up_h.shape and (r.hiddens - up_h).abs().max() <= 1e-4
    finally:
        eng.stop()


def test_engine_refine_text_mode_equals_upstream(tiny):
    arch, emb, g, ours = tiny
    eng = make_engine(ours, arch)
    try:
        ids = torch.randint(0, 21000, (12,))
        up_ids, _ = upstream_generate(emb, g, ids, 30, 0, infer_text=True, eos=21140, pen=1.0)
        r = eng.generate(
            GenRequest(text_ids=ids, params=SamplingParams(1e-5, 0.7, 20, 1.0, 30, 0, seed=1), on_done=None,
                       mode="text", eos_id=21140, want_hidden=False)
        )
        assert torch.equal(r.tokens, up_ids)
    finally:
        eng.stop()


def test_request_output_does_not_depend_on_batchmates(tiny):
    """Real sampling (temperature 0.3): alone vs joined mid-flight by others, same tokens."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=8)
    prompts = [torch.randint(0, 21000, (5 + 7 * i,)) for i in range(6)]
    params = [SamplingParams(0.3, 0.7, 20, 1.05, 30 + 10 * i, 10, seed=100 + i) for i in range(6)]
    try:
        alone = [eng.generate(GenRequest(text_ids=p, params=sp, on_done=None)) for p, sp in zip(prompts, params)]
        results = [None] * 6
        done = threading.Barrier(7)

        def run(i):
            results[i] = eng.generate(GenRequest(text_ids=prompts[i], params=params[i], on_done=None))
            done.wait()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        done.wait(timeout=120)
        for a, b in zip(alone, results):
            assert torch.equal(a.tokens, b.tokens)
            assert torch.allclose(a.hiddens, b.hiddens, atol=1e-5)
        assert len({tuple(r.tokens.flatten().tolist()) for r in results}) == 6  # seeds matter
    finally:
        eng.stop()


def test_min_new_tokens_forbids_eos_and_max_new_tokens_stops(tiny):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch)
    try:
        p = SamplingParams(5.0, None, None, 1.0, 25, 25, seed=3)  # hot sampling: EOS would be likely
        r = eng.generate(GenRequest(text_ids=torch.arange(1, 9), params=p, on_done=None))
        assert r.tokens.shape == (25, 4) and r.finish_reason == "max_tokens"
        assert not (r.tokens == 625).any()
    finally:
        eng.stop()


def test_context_overflow_and_cancel(tiny):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_context=64, max_new_tokens=60)
    try:
        with pytest.raises(ValueError, match="exceeds the context"):
            eng.submit(GenRequest(text_ids=torch.arange(1, 20), params=greedy(60, 0), on_done=lambda r: None))
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.submit(GenRequest(text_ids=torch.arange(1, 5), params=greedy(61, 0), on_done=lambda r: None))
        got = []
        ev = threading.Event()
        req = GenRequest(text_ids=torch.arange(1, 5), params=greedy(55, 55), on_done=lambda r: (got.append(r), ev.set()))
        eng.submit(req)
        req.cancel()
        assert ev.wait(30)
        assert got[0].finish_reason == "cancelled" and got[0].tokens is None
        assert eng.active == 0 and len(eng.free) == 4
    finally:
        eng.stop()


def test_sampling_filters_equal_transformers_warpers():
    from ChatTTS.model.processors import CustomRepetitionPenaltyLogitsProcessorRepeat
    from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(8, 626) * 3
    for p in (0.1, 0.7, 0.95):
        ref = TopPLogitsWarper(p, min_tokens_to_keep=3)(None, logits)
        assert torch.equal(sampling.top_p_filter(logits, torch.full((8,), p)), ref)
    for k in (1, 3, 20, 700):
        ref = TopKLogitsWarper(k, min_tokens_to_keep=3)(None, logits)
        assert torch.equal(sampling.top_k_filter(logits, torch.full((8,), k)), ref)
    hist = torch.randint(0, 626, (8, 30))
    ref = CustomRepetitionPenaltyLogitsProcessorRepeat(1.3, 625, 16)(hist, logits)
    ours = sampling.repetition_penalty(logits, sampling.window(hist), torch.full((8,), 30), torch.full((8,), 1.3))
    assert torch.allclose(ours, ref)


def test_counter_based_draw_is_deterministic_and_uniform():
    seed = torch.tensor([1, 1, 2, (1 << 40) + 1])
    u1 = sampling.uniform(seed, torch.tensor([0, 1, 0, 0]), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    u2 = sampling.uniform(seed, torch.tensor([0, 1, 0, 0]), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    assert torch.equal(u1, u2) and len(set(u1.tolist())) == 4
    many = sampling.uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long), torch.zeros(20000, dtype=torch.long), torch.zeros(20000, dtype=torch.long))
    assert 0 <= many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.01
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]])
    draws = [sampling.draw(probs, torch.tensor([u])).item() for u in (0.0, 0.2, 0.26, 0.99)]
    assert draws == [1, 1, 3, 3]


def test_uniform_is_strictly_inside_0_1_even_for_seed_0():
    """All-zero counters hashed to 0 (the mix maps 0 to 0): seed 0's first draw had u = 0, which picks
    the first token of positive probability however small."""
    z = torch.zeros(1, dtype=torch.long)
    assert 0 < sampling.uniform(z, z, z, z).item() < 1
    n = 1 << 16
    seeds = torch.arange(n).repeat_interleave(4)
    rows = torch.arange(4).repeat(n)
    many = sampling.uniform(seeds, torch.zeros_like(seeds), rows, torch.zeros_like(seeds))
    assert 0 < many.min() and many.max() < 1


def test_draw_never_lands_on_a_token_of_zero_probability():
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    # u * total rounding up to the total: searchsorted ends past the last positive token
    assert sampling.draw(probs, torch.tensor([1.0])).item() == 1


def test_seed_0_first_draw_takes_the_favourite_at_low_temperature():
    """The case that failed the GPU parity test: two logits 0.001 apart at temperature 1e-5 leave the
    runner-up a probability of ≈ 1e-44 (a denormal, not 0); upstream never draws it, nor may we."""
    r, v = 4, 626
    logits = torch.zeros(r, v)
    logits[:, 536], logits[:, 544] = 1.5880, 1.5890
    lg = sampling.process_logits(logits, torch.full((r,), 1e-5), torch.full((r,), 1.05), torch.full((r,), 0.7),
                                 torch.full((r,), 20), torch.zeros(r, 16, dtype=torch.long), torch.zeros(r, dtype=torch.long),
                                 torch.zeros(r, dtype=torch.bool), torch.full((r,), 625))
    probs = lg.softmax(-1)
    assert 0 < probs[0, 536] < 1e-40  # the trap: a positive probability before the favourite
    z = torch.zeros(r, dtype=torch.long)
    u = sampling.uniform(z, z, torch.arange(r), z)  # seed 0, step 0, rows 0..3, attempt 0
    assert sampling.sample(lg, u).tolist() == [544] * r


@pytest.mark.slow
def test_full_size_engine_greedy_equals_upstream(full_assets):
    arch, emb, g = upstream_gpt(full_assets)
    ours = torch.jit.script(load_gpt(full_assets, arch))
    eng = make_engine(ours, arch)
    try:
        ids = torch.randint(0, 21000, (30,))
        up_ids, up_h = upstream_generate(emb, g, ids, 24, 12)
        r = eng.generate(GenRequest(text_ids=ids, params=greedy(24, 12), on_done=None))
        assert torch.equal(r.tokens, up_ids)
        assert (r.hiddens - up_h).abs().max() <= 1e-4
    finally:
        eng.stop()


def test_slot_reused_after_refine_text_request(tiny):
    """A slot that held text-vocabulary tokens serves an audio-code request next."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=1)
    try:
        text = eng.generate(GenRequest(text_ids=torch.arange(1, 9), params=SamplingParams(1.0, None, None, 1.0, 20, 20, seed=5),
                                       on_done=None, mode="text", eos_id=21140, want_hidden=False))
        assert text.tokens.max() >= 626  # text ids beyond the audio vocabulary were left in the slot
        code = eng.generate(GenRequest(text_ids=torch.arange(1, 9), params=greedy(10, 10), on_done=None))
        assert code.finish_reason == "max_tokens" and code.tokens.shape == (10, 4)
    finally:
        eng.stop()


# Reduced-precision exports against upstream fp32. A bf16 value carries 8 significant bits
# (unit roundoff 2**-9 ≈ 2e-3), fp16 11 bits (2**-12 ≈ 2.4e-4); through 20 residual layers the
# errors add up to ~5x that. Measured on the full-size synthetic weights (prefill, relative
# Frobenius error of the hidden states): bf16 1.3e-2, fp16 1.6e-3. Bounds: 2.5x those.
REDUCED_BOUNDS = {torch.bfloat16: (3e-2, 0.08), torch.float16: (4e-3, 0.01)}  # (hidden rel, logits abs)


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


# --- compaction, bucket padding rows, streaming, admission ---------------------------------------
class _Rec:
    """One request of a scenario: what its on_tokens and on_done received."""

    def __init__(self, spec):
        self.spec = spec
        self.chunks, self.hids, self.result = [], [], None
        self.req = GenRequest(
            text_ids=spec["ids"], params=spec["params"], on_done=self.done, mode=spec.get("mode", "code"),
            eos_id=spec.get("eos", 625), want_hidden=spec.get("mode", "code") == "code",
            on_tokens=self.on_tokens if spec.get("every") else None, stream_every=spec.get("every") or 1,
        )

    def on_tokens(self, toks, hid):
        self.chunks.append(toks.cpu())
        self.hids.append(None if hid is None else hid.cpu())
        got = sum(len(c) for c in self.chunks)
        if self.spec.get("cancel_after") and got >= self.spec["cancel_after"]:
            self.req.cancel()
        if self.spec.get("every_then"):
            self.req.stream_every = self.spec["every_then"]  # consumers may change it at any time

    def done(self, res):
        assert self.result is None
        self.result = res


def scenario_specs(seed=7):
    """Code requests finishing at different steps (max_tokens and EOS), a refine-text one, a
    streaming consumer that cancels mid-way, and streaming with several chunk sizes."""
    g = torch.Generator().manual_seed(seed)
    lim = [(12, 12), (40, 5), (25, 25), (33, 0), (18, 18), (50, 20), (40, 40), (9, 9), (28, 10)]
    specs = [dict(ids=torch.randint(0, 21000, (4 + 5 * i,), generator=g), params=SamplingParams(0.3, 0.7, 20, 1.05, n, m, seed=200 + i))
             for i, (n, m) in enumerate(lim)]
    specs[1]["every"] = 1
    specs[3]["every"] = 4
    specs[5].update(every=7, every_then=2)
    specs[6].update(every=3, cancel_after=10)  # cancels itself from its stream callback
    specs.append(dict(ids=torch.randint(0, 21000, (11,), generator=g), params=SamplingParams(0.7, 0.7, 20, 1.0, 30, 5, seed=9),
                      mode="text", eos=21140, every=3))
    return specs


def drive(eng, specs, join=None, limit=2000):
    """Run the engine loop on this thread; spec i is submitted before iteration join[i]."""
    join = join or [0] * len(specs)
    recs = [None] * len(specs)
    it = 0
    while True:
        for i, spec in enumerate(specs):
            if recs[i] is None and join[i] <= it:
                recs[i] = _Rec(spec)
                eng.submit(recs[i].req)
        if all(r is not None and r.result is not None for r in recs):
            return recs
        eng._run_once(block=False)
        it += 1
        assert it < limit, "scenario did not finish"


def check_same_as_alone(alone, batched, hidden_atol=1e-5):
    # tokens and stream chunk boundaries exactly; hidden states to 1e-5: a CPU GEMM rounds a row
    # differently with the number of rows beside it (a few ulp, measured ≤ 5e-7 here)
    for a, b in zip(alone, batched):
        assert a.result.finish_reason == b.result.finish_reason
        assert len(a.chunks) == len(b.chunks)
        for x, y in zip(a.chunks, b.chunks):
            assert torch.equal(x, y)
        for x, y in zip(a.hids, b.hids):
            assert (x is None) == (y is None) and (x is None or torch.allclose(x, y, atol=hidden_atol, rtol=0))
        for r in (a, b):
            if r.result.tokens is None:  # cancelled: it streamed part of its tokens first
                assert r.result.finish_reason == "cancelled" and r.chunks
                continue
            # concatenated stream chunks + the tail of the final result == the final result
            toks = r.result.tokens.cpu()
            if r.chunks:
                sent = torch.cat(r.chunks)
                sent = sent[:, 0] if toks.dim() == 1 else sent
                assert torch.equal(sent, toks[: len(sent)])
                if r.hids[0] is not None:
                    assert torch.equal(torch.cat(r.hids), r.result.hiddens.cpu()[: len(sent)])
        if a.result.tokens is not None:
            assert torch.equal(a.result.tokens.cpu(), b.result.tokens.cpu())
            if a.result.hiddens is not None:
                assert torch.allclose(a.result.hiddens.cpu(), b.result.hiddens.cpu(), atol=hidden_atol, rtol=0)


def instrument(eng):
    """Record compaction moves, step modes and (bucket, live) pairs of the engine."""
    seen = {"moves": 0, "modes": set(), "padded": 0}
    compact, step_core = eng._compact, eng.step_core

    def _compact(done):
        seen["moves"] += sum(1 for i in done if i < len(eng.rows) - len(done))
        return compact(done)

    def _step_core(start, b, attn_len, mode="code", n_live=None, groups=None):
        seen["modes"].add(mode)
        if n_live is not None and b > eng._live:
            seen["padded"] += 1
        return step_core(start, b, attn_len, mode, n_live, groups)

    eng._compact, eng.step_core = _compact, _step_core
    return seen


@pytest.mark.parametrize("graphs", ["eager", "buckets"])
def test_compaction_and_finish_order_leave_every_request_as_alone(tiny, graphs):
    """Requests leave in many orders (EOS, max_tokens, a cancel from a stream callback), others join
    mid-flight; compaction moves slots under them. Each one's tokens, hiddens and stream chunks are
    what it produces alone. "buckets" runs the CUDA-graph bucket logic eagerly: padding rows (free
    slots, warm-up runs over live rows) must not change anything."""
    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=8, start=False)
    if graphs == "buckets":
        eng.graphs = CudaGraphs(eng, capture=False)
    specs = scenario_specs()
    alone = [drive(eng, [s])[0] for s in specs]
    seen = instrument(eng)
    batched = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2])
    check_same_as_alone(alone, batched)
    assert seen["moves"] >= 3 and {"code", "mixed"} <= seen["modes"]
    if graphs == "buckets":
        assert seen["padded"] > 0
        # the joins' prefills ran padded to their buckets (rows and prompt length)
        prefills = [key for key in eng.graphs.graphs if key[0] == "prefill"]
        assert prefills and any(kb > 1 for _, kb, _ in prefills)
    assert eng.active == 0 and eng.pending == 0
    assert torch.equal(eng.pi, eng._free_pi.expand(8, -1)) and (eng.pf == 1).all()  # free slots are reset


def assert_pool_whole(eng):
    assert sorted(eng.free_pages) == list(range(1, eng.num_pages)) and not eng._suspended
    assert not eng.h_table.any() and not eng.h_pages.any()


@pytest.mark.parametrize("graphs", ["eager", "buckets"])
def test_requests_suspended_for_want_of_pages_resume_exactly_where_they_stopped(tiny, graphs):
    """A page pool too small for the scenario's requests together (the smallest the context allows: one
    request of the full context): the newest are suspended mid-generation, their pages copied out, and
    resumed later. Each request's tokens, hidden states and stream chunks are still what it produces
    alone, and every page comes back to the pool."""
    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    specs = scenario_specs()
    alone = [drive(make_engine(ours, arch, max_slots=8, start=False), [s])[0] for s in specs]
    longest = max(len(s["ids"]) + s["params"].max_new_tokens for s in specs)
    eng = make_engine(ours, arch, max_slots=8, max_context=longest, cache_tokens=longest, start=False)
    assert eng.num_pages - 1 == -(-longest // KV_PAGE_TOKENS) == 5
    if graphs == "buckets":
        eng.graphs = CudaGraphs(eng, capture=False)
    batched = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2])
    check_same_as_alone(alone, batched)
    assert eng.preemptions >= 3 and eng.resumes == eng.preemptions, eng.preemptions
    stats = eng.stats()
    assert stats["engine_preemptions"] == eng.preemptions and stats["engine_kv_pages_free"] == stats["engine_kv_pages"] == 5
    assert_pool_whole(eng)


def test_a_half_precision_engine_keeps_its_hidden_states_exactly_at_half_the_memory(tiny):
    """bf16 compute: the hidden states are kept in bf16 (the model's final norm outputs bf16, so nothing is
    lost) and handed out as float32, suspended and resumed included."""
    arch, _, _, ours = tiny
    model = load_gpt_like(ours, arch, torch.bfloat16)
    specs = scenario_specs()[:5]
    alone = [drive(make_engine(model, arch, max_slots=8, start=False, cache_dtype=torch.bfloat16,
                               compute_dtype=torch.bfloat16), [s])[0] for s in specs]
    longest = max(len(s["ids"]) + s["params"].max_new_tokens for s in specs)
    eng = make_engine(model, arch, max_slots=8, start=False, cache_dtype=torch.bfloat16, compute_dtype=torch.bfloat16,
                      max_context=longest, cache_tokens=longest)
    assert eng.hiddens.dtype == torch.bfloat16
    batched = drive(eng, specs)
    check_same_as_alone(alone, batched, hidden_atol=0.1)
    for r in batched:
        if r.result.hiddens is not None:
            h = r.result.hiddens
            assert h.dtype == torch.float32 and torch.equal(h, h.to(torch.bfloat16).float())


def test_a_request_cancelled_while_suspended_ends_cancelled_and_frees_nothing_twice(tiny):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=4, max_context=64, cache_tokens=64, start=False)
    g = torch.Generator().manual_seed(5)
    specs = [dict(ids=torch.randint(0, 21000, (8,), generator=g), params=SamplingParams(0.3, 0.7, 20, 1.05, 40, 40, seed=i))
             for i in range(3)]  # 3 × 48 positions (3 pages) in a pool of 4 pages: two start, one is suspended
    recs = [_Rec(spec) for spec in specs]
    for r in recs:
        eng.submit(r.req)
    for _ in range(200):
        eng._run_once(block=False)
        if eng._suspended:
            break
    assert eng._suspended, "no request was suspended"
    victim = next(r for r in recs if id(r.req) in eng._suspended)
    victim.req.cancel()
    for _ in range(400):
        if all(r.result is not None for r in recs):
            break
        eng._run_once(block=False)
    assert victim.result.finish_reason == "cancelled" and victim.result.steps > 0
    assert all(r.result.finish_reason == "max_tokens" and len(r.result.tokens) == 40 for r in recs if r is not victim)
    assert_pool_whole(eng)


def test_admission_waits_for_pages_and_a_pool_below_one_full_context_is_refused(tiny):
    arch, _, _, ours = tiny
    with pytest.raises(EngineError, match="full context"):
        make_engine(ours, arch, max_context=128, cache_tokens=100, start=False)
    eng = make_engine(ours, arch, max_slots=8, max_context=128, cache_tokens=128, start=False)
    g = torch.Generator().manual_seed(6)
    for i in range(4):  # 4 prompts of 3 pages each in a pool of 8 pages
        eng.submit(GenRequest(torch.randint(0, 21000, (40,), generator=g), SamplingParams(0.3, 0.7, 20, 1.05, 8, 8, seed=i),
                              lambda r: None))
    eng._run_once(block=False)
    assert len(eng.rows) == 2 and eng.pending == 2  # 2 × 3 pages, and one in reserve for each of them


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
            assert torch.allclose(outs[0].float(), outs[1].float(), atol=1e-5 if dtype == torch.float32 else 0.1, rtol=0)


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
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def load_gpt_like(model, arch, dtype, fused=True):
    from chattts_triton.model.gpt import ChatTTSGPT

    m = ChatTTSGPT(arch).to(dtype)
    m.fuse_projections()
    m.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    if not fused:  # as exported before fusing: the five projections apart
        for layer in m.layers:
            q, k, v = layer.qkv_proj.weight.split([layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim,
                                                   layer.kv_heads * layer.head_dim])
            gate, up = layer.gate_up_proj.weight.chunk(2)
            for name, w in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("gate_proj", gate), ("up_proj", up)):
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
                lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
                setattr(layer, name, lin)
            layer.qkv_proj = layer.gate_up_proj = None
    return m.eval()


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("prefill", [False, True], ids=["step", "step_and_prefill"])
def test_compiled_step_equals_the_plain_step_and_warm_up_leaves_nothing_to_compile(tiny, prefill):
    """The graph buckets through torch.compile (aot_eager here: dynamo and the functionalised
    in-place cache writes; the GPU test runs inductor) give every request of the mixed scenario
    (finish orders, compaction, streaming, a refine-text row, batch sizes 1..10, prompts up to 150
    tokens so attention lengths cross a bucket) exactly its plain-step tokens, and after
    `warm_up` (code and text, 1 and 2 requests) nothing compiles again; with `prefill` the prefills
    (every bucket shape of the warm-up and the scenario's others) run compiled too."""
    import torch._dynamo

    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    g = torch.Generator().manual_seed(3)
    specs = scenario_specs() + [dict(ids=torch.randint(0, 21000, (150,), generator=g),
                                     params=SamplingParams(0.3, 0.7, 20, 1.05, 20, 20, seed=77))]
    plain = make_engine(ours, arch, max_slots=16, start=False)
    plain.graphs = CudaGraphs(plain, capture=False)
    expected = drive(plain, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2, 5])

    torch._dynamo.reset()
    eng = make_engine(ours, arch, max_slots=16, start=False)
    eng.graphs = CudaGraphs(eng, capture=False)
    eng.compile_step(backend="aot_eager", prefill=prefill)
    assert (eng.graph_prefill is not None) == prefill
    prefills = []
    if prefill:  # count the compiled prefill's calls
        compiled_prefill = eng.graph_prefill
        eng.graph_prefill = lambda *a: prefills.append(a[0].shape[:2]) or compiled_prefill(*a)
    eng.warm_up(text_eos_id=21140, freeze=False)
    warm = _graphs_compiled()
    assert warm >= 2  # code batch 1, batch ≥ 2 (dynamic); text mode runs the plain step
    assert (eng.graph_prefill is not None) == prefill  # it compiled: no fallback to the plain prefill
    warm_prefills = len(prefills)
    assert (warm_prefills > 0) == prefill
    # and the common prefill buckets (here up to 16 slots): graphs before any client
    assert {("prefill", k, t) for k in (1, 2, 4, 8, 16) for t in (16, 32, 64, 128)} <= set(eng.graphs.graphs)
    got = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2, 5])
    assert _graphs_compiled() == warm, (warm, _graphs_compiled())
    assert (eng.graph_prefill is not None) == prefill
    assert (len(prefills) > warm_prefills) == prefill  # the scenario's prefills ran it too
    check_same_as_alone(expected, got)
    assert eng.active == 0 and eng.pending == 0


def test_a_compiled_prefill_that_fails_falls_back_to_the_plain_prefill(tiny, caplog):
    """If the compiled prefill raises (inductor unable to compile it on some host), the engine logs it,
    runs that prefill and every later one plainly, and the requests get their plain tokens."""
    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    specs = [dict(ids=torch.arange(1 + i, 12 + 3 * i), params=SamplingParams(0.3, 0.7, 20, 1.05, 12, 12, seed=i))
             for i in range(3)]
    plain = make_engine(ours, arch, max_slots=4, start=False)
    plain.graphs = CudaGraphs(plain, capture=False)
    expected = drive(plain, specs)
    eng = make_engine(ours, arch, max_slots=4, start=False)
    eng.graphs = CudaGraphs(eng, capture=False)
    calls = []

    def broken(*args):
        calls.append(len(args))
        raise RuntimeError("inductor: no C compiler")

    eng.graph_prefill = broken
    with caplog.at_level("ERROR"):
        got = drive(eng, specs)
    assert calls == [3] and eng.graph_prefill is None  # tried once, then never again
    assert "the compiled prefill failed" in caplog.text
    check_same_as_alone(expected, got)


def assert_served_without_a_new_decode_graph(eng, reqs, want, decode) -> None:
    """`reqs` served by `eng` after its warm-up: no decode graph beyond `decode`, the tokens of `want`."""
    got = [eng.generate(GenRequest(r.text_ids, r.params, None)) for r in reqs]
    assert {k for k in eng.graphs.graphs if k[0] == "code"} == decode
    for a, b in zip(want, got):
        assert torch.equal(a.tokens, b.tokens)


def test_warm_graphs_captures_every_bucket_a_load_reaches_on_the_engine_thread(tiny):
    """warm_graphs on a started engine (graphs standing in eagerly on the CPU): the decode graph of
    every batch bucket at every attention bucket up to WARM_DECODE_LEN and the prefill graphs of the
    prompt counts past PREFILL_WARM_BATCHES, captured on the engine's own thread (where graphs
    replay) before any client; requests served afterwards capture nothing new and get the tokens a
    plain engine gives them."""
    from chattts_triton.runtime.engine import (
        BATCH_STEP,
        PREFILL_GRAPH_TOKENS,
        PREFILL_WARM_BATCHES,
        PREFILL_WARM_LENGTHS,
        WARM_DECODE_LEN,
        CudaGraphs,
        bucket_sizes,
    )

    arch, _, _, ours = tiny
    reqs = [GenRequest(torch.arange(3 + i, 20 + 2 * i), SamplingParams(0.3, 0.7, 20, 1.05, 30, 30, seed=i), None) for i in range(5)]
    plain = make_engine(ours, arch, max_slots=80, max_context=640)
    try:
        want = [plain.generate(r) for r in reqs]
    finally:
        plain.stop()
    eng = make_engine(ours, arch, max_slots=80, max_context=640)
    try:
        eng.graphs = CudaGraphs(eng, capture=False)
        threads = set()
        decode_graph = eng.graphs.decode_graph

        def on_thread(*key):
            threads.add(threading.current_thread().name)
            return decode_graph(*key)

        eng.graphs.decode_graph = on_thread
        assert bucket_sizes(BATCH_STEP, 80) == [1, 2, 4, 8, 16, 32, 64, 80]
        n = eng.warm_graphs()
        decode = {k for k in eng.graphs.graphs if k[0] == "code"}
        assert decode == {("code", bb, lb) for bb in (1, 2, 4, 8, 16, 32, 64, 80) for lb in (128, 256, 384, 512)}
        assert WARM_DECODE_LEN == 512 and threads == {"chattts-engine"}
        prefill = {k for k in eng.graphs.graphs if k[0] == "prefill"}
        assert prefill == {("prefill", k, t) for k in (64, 80) for t in PREFILL_WARM_LENGTHS
                           if k not in PREFILL_WARM_BATCHES and k * t <= PREFILL_GRAPH_TOKENS}
        assert n == len(eng.graphs.graphs)
        assert_served_without_a_new_decode_graph(eng, reqs, want, decode)
    finally:
        eng.stop()


def test_an_engine_task_fails_its_caller_not_the_engine(tiny):
    """_on_engine_thread: what the task raises reaches the caller; a task asking for another runs it
    in place (no wait on itself); the engine serves on."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch)
    try:
        with pytest.raises(ValueError, match="bad bucket"):
            eng._on_engine_thread(lambda: (_ for _ in ()).throw(ValueError("bad bucket")), time.monotonic() + 30)
        names, t0 = [], time.monotonic()
        inner = lambda: names.append(threading.current_thread().name)  # noqa: E731
        eng._on_engine_thread(lambda: eng._on_engine_thread(inner, time.monotonic() + 30), time.monotonic() + 30)
        assert names == ["chattts-engine"] and time.monotonic() - t0 < 10
        r = eng.generate(GenRequest(torch.arange(1, 9), SamplingParams(0.3, 0.7, 20, 1.05, 5, 5, seed=1), None))
        assert r.finish_reason == "max_tokens"
    finally:
        eng.stop()


def test_warm_graphs_refuses_an_engine_with_running_requests(tiny):
    """Its warm-up steps run every row of a bucket in one mode: with requests running it refuses
    rather than step them."""
    from chattts_triton.runtime.engine import CudaGraphs, EngineError

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False)
    eng.graphs = CudaGraphs(eng, capture=False)
    eng.submit(GenRequest(torch.arange(1, 9), SamplingParams(0.3, 0.7, 20, 1.05, 20, 20, seed=1), None))
    eng._run_once(block=False)
    assert eng.active == 1
    with pytest.raises(EngineError, match="idle"):
        eng.warm_graphs()
    assert not [k for k in eng.graphs.graphs if k[0] == "code" and k[2] > 128]


def test_a_result_whose_copies_failed_reaches_its_consumer_as_an_error():
    """Engine._call: if waiting for a finished result's host copies raises (a device error), the
    consumer still gets one reply, an error, instead of none."""
    from chattts_triton.runtime.engine import GenResult

    class Broken:
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    got = []
    req = GenRequest(torch.arange(1, 5), SamplingParams(0.3, 0.7, 20, 1.05, 5, 5, seed=0), got.append)
    Engine._call(req, GenResult(torch.zeros(5, 4), None, "max_tokens", steps=5, ready=Broken()))
    assert len(got) == 1 and got[0].finish_reason == "error" and "illegal memory" in str(got[0].error)


@pytest.mark.parametrize("case", ["longer_attention_bucket", "text_mode"])
def test_frozen_compiled_step_runs_an_unwarmed_bucket_plainly_instead_of_compiling(tiny, case):
    """A compiled engine compiles nothing after its warm-up, and the tokens stay the plain step's:
    after freeze, a bucket the warm-up never compiled (one compile per bucket: a 150-token prompt
    needs attention length 256, the warm-up saw 128) runs the plain step instead of stalling every
    running request for a compile; text mode (refine text) always runs the plain step, frozen or not."""
    import torch._dynamo

    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    if case == "text_mode":
        spec = [dict(ids=torch.arange(3, 14), params=SamplingParams(0.7, 0.7, 20, 1.0, 12, 4, seed=9), mode="text", eos=21140)]
    else:
        g = torch.Generator().manual_seed(5)
        spec = [dict(ids=torch.randint(0, 21000, (150,), generator=g), params=SamplingParams(0.3, 0.7, 20, 1.05, 12, 12, seed=8))]
    plain = make_engine(ours, arch, start=False)
    plain.graphs = CudaGraphs(plain, capture=False)
    expected = drive(plain, spec)
    torch._dynamo.reset()
    eng = make_engine(ours, arch, start=False)
    eng.graphs = CudaGraphs(eng, capture=False)
    eng.compile_step(backend="aot_eager", dynamic=case == "text_mode")
    eng.warm_up(text_eos_id=None, freeze=case != "text_mode")  # code only
    assert eng.compiled_frozen == (case != "text_mode")
    warm = _graphs_compiled()
    got = drive(eng, spec)
    assert _graphs_compiled() == warm
    check_same_as_alone(expected, got)


def test_padding_row_over_a_slot_left_by_refine_text(tiny):
    """A free slot that held text-vocabulary tokens pads a code-only bucket: its lookups stay in
    range and the live rows are unaffected."""
    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=4, start=False)
    eng.graphs = CudaGraphs(eng, capture=False)
    seen = instrument(eng)
    code = [dict(ids=torch.arange(1 + i, 9 + i), params=SamplingParams(0.3, 0.7, 20, 1.05, 30, 30, seed=i)) for i in range(3)]
    text = dict(ids=torch.arange(1, 9), params=SamplingParams(1.0, None, None, 1.0, 10, 10, seed=5), mode="text", eos=21140)
    recs = drive(eng, code + [text])
    assert recs[3].result.tokens.max() >= 626 and seen["padded"] > 0  # slot 3 held text ids, then padded
    alone = [drive(eng, [c])[0] for c in code]
    check_same_as_alone(alone, recs[:3])


def test_more_requests_than_slots_queue_and_match_alone(tiny):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=3, start=False)
    specs = scenario_specs(seed=3)
    alone = [drive(eng, [s])[0] for s in specs]
    check_same_as_alone(alone, drive(eng, specs))


def test_admission_batches_prefills_when_busy_and_admits_at_once_when_idle(tiny):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=8, start=False, admit_batch=3, admit_wait_steps=4)
    prefills = []
    prefill = eng._prefill
    eng._prefill = lambda reqs: (prefills.append(len(reqs)), prefill(reqs))
    done = []

    def req(n):
        return GenRequest(text_ids=torch.arange(1, 6), params=greedy(n, n), on_done=done.append)

    eng.submit(req(40))
    eng._run_once(block=False)
    assert prefills == [1] and eng.active == 1  # idle: at once
    eng.submit(req(30))
    for _ in range(4):
        eng._run_once(block=False)
        assert prefills == [1] and eng.pending == 1  # busy: waits for company
    eng._run_once(block=False)
    assert prefills == [1, 1] and eng.active == 2  # ... for admit_wait_steps decode steps at most
    for _ in range(3):
        eng.submit(req(20))
    eng._run_once(block=False)
    assert prefills == [1, 1, 3] and eng.active == 5  # admit_batch waiting: one prefill at once
    for _ in range(3):
        eng.submit(req(20))
    eng._run_once(block=False)
    assert prefills == [1, 1, 3, 3] and eng.active == 8  # they fill the free slots: no wait either
    eng.submit(req(5))
    while eng.active:
        eng._run_once(block=False)
        assert eng.active + eng.pending + len(done) == 9
    assert len(done) == 9 and len(prefills) == 5
    eng.submit(req(5))
    eng._run_once(block=False)
    assert prefills[-1] == 1 and eng.active == 1  # idle again: at once
    while eng.active:
        eng._run_once(block=False)
    assert [r.finish_reason for r in done] == ["max_tokens"] * 10
    alone = drive(eng, [dict(ids=torch.arange(1, 6), params=greedy(40, 40))])[0]
    for r in done:  # same prompt and seed: each is a prefix of the longest one run alone
        assert torch.equal(r.tokens, alone.result.tokens[: r.steps])


def test_bucket_sizes():
    from chattts_triton.runtime.graphs import bucket as _bucket

    assert [_bucket(n, 32, 512) for n in (1, 2, 3, 5, 32, 33, 64, 65, 500, 512)] == [1, 2, 4, 8, 32, 64, 64, 96, 512, 512]
    assert _bucket(300, 32, 300) == 300 and _bucket(129, 128, 200) == 200


def test_model_with_the_old_slots_signature_is_refused(tiny):
    from chattts_triton.runtime.engine import EngineError

    arch = tiny[0]

    class Old(torch.nn.Module):
        def forward(self, x, positions, slots, k_cache, v_cache, attn_len):
            return x

    with pytest.raises(EngineError, match="re-export"):
        make_engine(Old(), arch, start=False)


@pytest.mark.parametrize("compile_fails", [False, True])
def test_gpt_service_compiles_the_step_or_falls_back_to_torchscript(tiny_repo, monkeypatch, caplog, compile_fails):
    """`compile_step` serves the eager module through torch.compile; if compiling fails at warm-up
    (say, no C compiler in the image) the model still loads, on the exported TorchScript step, and the
    failed engine (its KV cache: GBs on a GPU) is gone, not kept beside the one that serves."""
    import weakref

    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.config import GPT, Arch
    from chattts_triton.triton.repo_config import read_manifest

    man = read_manifest(tiny_repo)
    arch = Arch.from_json(man["arch"])
    monkeypatch.setattr(gpt_runtime, "compile_applies", lambda device: True)  # CPU stands in for CUDA here
    real_warm_up = Engine.warm_up

    def warm_up(self, *args, **kw):
        if compile_fails and self.graph_step is not None:
            raise RuntimeError("inductor: no working C compiler")
        return real_warm_up(self, *args, **kw)

    monkeypatch.setattr(Engine, "warm_up", warm_up)
    engines = []
    real_init = Engine.__init__

    def init(self, *args, **kw):
        engines.append(weakref.ref(self))
        real_init(self, *args, **kw)

    monkeypatch.setattr(Engine, "__init__", init)
    caplog.set_level(logging.INFO)
    svc = gpt_runtime.GPTService(tiny_repo / GPT / "1" / "gpt.pt", arch, torch.device("cpu"), "fp32", max_slots=2,
                              max_context=256, max_new_tokens=32, text_eos_id=man["tokens"]["text_eos_id"],
                              spk_emb_id=man["tokens"]["spk_emb_id"], compile_step=True)
    try:
        assert isinstance(svc.engine.model, torch.jit.ScriptModule) == compile_fails
        assert (svc.engine.graph_step is None) == compile_fails
        assert ("serving the TorchScript step instead" in caplog.text) == compile_fails
        assert len(engines) == 1 + compile_fails and [e() for e in engines if e() is not None] == [svc.engine]
        r = svc.engine.generate(GenRequest(torch.arange(1, 9), greedy(6, 6), None))
        assert r.finish_reason == "max_tokens" and r.tokens.shape == (6, arch.num_vq)
    finally:
        svc.engine.stop()


@pytest.mark.parametrize("failed", ["prefill", "code"])
def test_only_a_failed_decode_graph_sends_a_compiled_engine_back_to_torchscript(tiny_repo, monkeypatch, failed):
    """A warm-up graph that could not be captured: a decode bucket's means the compiled step cannot be
    served as measured (TorchScript instead); a prefill bucket's runs no compiled code and just runs
    eagerly, so the compiled step stays. (CPU has no graphs: the warm-up's outcome is stood in for.)"""
    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.config import GPT, Arch
    from chattts_triton.runtime.engine import CudaGraphs
    from chattts_triton.triton.repo_config import read_manifest

    man = read_manifest(tiny_repo)
    monkeypatch.setattr(gpt_runtime, "compile_applies", lambda device: True)
    real_warm_up = Engine.warm_up

    def warm_up(self, *args, **kw):
        real_warm_up(self, *args, **kw)
        if self.graph_step is not None:
            ok = lambda: None  # noqa: E731
            self.graphs = CudaGraphs(self, capture=False)
            self.graphs.graphs.update({("prefill", 1, 16): None if failed == "prefill" else ok,
                                       ("code", 1, 128): None if failed == "code" else ok})

    monkeypatch.setattr(Engine, "warm_up", warm_up)
    svc = gpt_runtime.GPTService(tiny_repo / GPT / "1" / "gpt.pt", Arch.from_json(man["arch"]), torch.device("cpu"), "fp32",
                              max_slots=2, max_context=256, max_new_tokens=32, text_eos_id=man["tokens"]["text_eos_id"],
                              spk_emb_id=man["tokens"]["spk_emb_id"], compile_step=True)
    try:
        assert isinstance(svc.engine.model, torch.jit.ScriptModule) == (failed == "code")
    finally:
        svc.engine.stop()


def test_step_bench_times_steps_and_prefills_of_each_variant_on_cpu(tiny_assets, tmp_path):
    """bench.probes.step's CPU mode (the GPU one needs the device): one JSON per variant, a step and forward
    time per batch, an eager prefill time per shape (more prompts than batch rows fit too)."""
    import json

    from bench.probes import step

    args = ["--assets", str(tiny_assets), "--out", str(tmp_path), "--device", "cpu", "--dtype", "fp32",
            "--batches", "1,2", "--variants", "script,script_unfused", "--iters", "2", "--prefill", "1x8,4x16",
            "--context", "128", "--max-new-tokens", "16", "--attn-len", "32", "--profile", "2", "--lengths", "uniform"]
    assert step.main(args) == 0
    ops = {}
    for variant in ("script", "script_unfused"):
        res = json.loads((tmp_path / f"step-{variant}.json").read_text())
        assert res["variant"] == variant and res["gpu"] == "cpu" and res["lengths"] == "uniform"
        assert res["decode_kernel"] is False  # TorchScript
        assert set(res["batches"]) == {"1", "2"} and all(r["step_ms"] > 0 and r["forward_ms"] > 0 for r in res["batches"].values())
        prof = res["batches"]["1"]["profile"]
        assert prof["kernel_ms_per_step"] > 0 and 0 < len(prof["top"]) <= 12
        assert sum(k["per_step"] for k in prof["top"]) <= prof["kernels_per_step"]
        ops[variant] = prof["kernels_per_step"]
        assert set(res["prefill"]) == {"1x8", "4x16"} and all(r["eager_ms"] > 0 for r in res["prefill"].values())
    # fused projections: one GEMM for q/k/v and one for gate/up instead of five per layer
    assert ops["script"] < ops["script_unfused"], ops
    with pytest.raises(SystemExit, match="on a CPU"):  # inductor's step is a GPU variant
        step.main([a if a != "script,script_unfused" else "compile" for a in args])


def test_engine_counts_its_steps_rows_and_busy_time(tiny):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False)
    s0 = eng.stats()
    assert s0["engine_steps"] == 0 and s0["engine_active"] == 0 and s0["engine_step_seconds"] == 0
    specs = [dict(ids=torch.arange(1, 9), params=greedy(n, n, seed=i)) for i, n in enumerate((10, 20))]
    drive(eng, specs)  # both admitted by one prefill
    s = eng.stats()
    # each first token comes from the prefill: 9 steps with both rows, then 10 with one
    assert s["engine_steps"] == 19 and s["engine_step_rows"] == 9 * 2 + 10
    assert s["engine_step_seconds"] > 0 and s["engine_prefill_seconds"] > 0 and s["engine_active"] == 0
    assert (s["engine_prefills"], s["engine_prefill_rows"]) == (1, 2)
    assert 0 < s["engine_step_device_seconds"] <= s["engine_step_seconds"]
    assert s["engine_step_gpu_seconds"] == s["engine_step_gpu_samples"] == 0  # CPU: no GPU clock to read
    assert s["engine_step_graph_seconds"] == s["engine_step_graph_samples"] == 0
    assert s["engine_gil_wait_samples"] == 1 and s["engine_gil_wait_seconds"] >= 0  # step 0 of 19 (one in 64)


def test_the_gil_probe_reads_the_wait_another_python_thread_causes(tiny, monkeypatch):
    """The engine's GIL-wait figure is the wait its thread meets: with a thread spinning in Python and a
    20-ms switch interval, taking the GIL back after a release can wait the whole interval (a mean of
    ≥ 2 ms over 10 samples needs one of them to have waited); alone, the probe's own ≈ 0.07 ms (more on
    a loaded box, where the sleep lets other processes run: hence the ratio, not a bound)."""
    import sys
    import threading

    import chattts_triton.runtime.engine as engine_mod

    arch, _, _, ours = tiny
    specs = [dict(ids=torch.arange(1, 9), params=greedy(80, 80, seed=0))]
    monkeypatch.setattr(engine_mod, "GIL_PROBE_EVERY", 8)  # 10 samples in 80 steps

    def mean_wait_ms(spin: bool) -> float:
        eng = make_engine(ours, arch, start=False)
        stop = threading.Event()

        def spinner() -> None:
            while not stop.is_set():
                pass

        t = threading.Thread(target=spinner, daemon=True)
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.02)
        try:
            if spin:
                t.start()
            drive(eng, specs)
        finally:
            stop.set()
            sys.setswitchinterval(old)
            if spin:
                t.join()
        s = eng.stats()
        assert s["engine_gil_wait_samples"] == 10  # steps 0, 8, .. 72 of 79
        return 1000 * s["engine_gil_wait_seconds"] / s["engine_gil_wait_samples"]

    alone, contended = mean_wait_ms(False), mean_wait_ms(True)
    assert contended >= max(2.0, 3 * alone), (contended, alone)


def test_a_slow_result_consumer_does_not_hold_up_the_running_batch(tiny):
    """A started engine hands results to their on_done on a thread of its own (the GPT model's copies
    and Triton reply): while one request's on_done blocks, the others keep generating and finish;
    results arrive in finish order; stop(drain) returns only once every on_done has run."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch)
    release = threading.Event()
    order, threads = [], set()

    def on_done(name):
        def cb(res):
            threads.add(threading.current_thread().name)
            if name == "short":
                release.wait(60)  # the consumer of the first result is stuck
            order.append((name, res.finish_reason, int(res.tokens.shape[0])))
        return cb

    eng.submit(GenRequest(torch.arange(1, 9), greedy(3, 3, seed=1), on_done("short")))
    eng.submit(GenRequest(torch.arange(1, 9), greedy(40, 40, seed=2), on_done("long")))
    deadline = time.monotonic() + 30
    while eng.active + eng.pending and time.monotonic() < deadline:  # the long one finishes meanwhile
        time.sleep(0.01)
    # a finished row leaves `active` just before its result is queued: wait for the queue too
    while eng.stats()["engine_results_pending"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.active == 0 and eng.pending == 0 and eng.steps >= 39 and order == []
    assert eng.stats()["engine_results_pending"] == 1  # the long one's, behind the stuck consumer
    release.set()
    eng.stop(drain=True, timeout=60)
    assert order == [("short", "max_tokens", 3), ("long", "max_tokens", 40)]
    assert eng.stats()["engine_results_pending"] == 0
    assert threads == {"chattts-engine-results"}


def test_a_graph_whose_timing_events_fail_to_capture_is_captured_without_them(monkeypatch):
    """Timing is a measurement: a capture that refuses the graph's own timing events is redone
    without them, so the bucket still replays from a graph (not eagerly) and reports no events.
    (CUDA is stood in for: the capture calls are recorded, not made.)"""
    import contextlib
    from types import SimpleNamespace

    from chattts_triton.runtime import graphs

    cache = graphs.GraphCache(torch.device("cpu"), capture=False)
    cache.capture, cache.stream = True, SimpleNamespace(wait_stream=lambda s: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_stream=lambda s: None))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graphs, "graph_events", lambda: ("start", "end"))
    tried, replays = [], []

    def record(fn, events):
        tried.append(events)
        if events is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return SimpleNamespace(replay=lambda: replays.append(1)), fn()

    monkeypatch.setattr(cache, "_record", record)
    run = cache._graph("bucket", lambda: None, lambda: torch.ones(2), timed=True)
    assert tried == [("start", "end"), None]
    assert run is not None and run.events is None and torch.equal(run(), torch.ones(2)) and replays == [1]
    tried.clear()
    untimed = cache._graph("other", lambda: None, lambda: torch.zeros(1))
    assert tried == [None] and untimed.events is None  # untimed graphs never ask for events
