"""What the GPT, engine and service tests share: upstream ChatTTS's GPT on the same weights, engines and request
scenarios driven on the test's thread, and the checks that a batched request equals itself alone."""

from __future__ import annotations

import logging

import torch

from chattts_triton.model.assets import infer_arch
from chattts_triton.runtime.engine import Engine, GenRequest, SamplingParams


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


class Rec:
    """One request of a scenario: what its on_tokens and on_done received."""

    def __init__(self, spec):
        self.spec = spec
        self.chunks, self.hids, self.result = [], [], None
        self.req = GenRequest(
            text_ids=spec["ids"], params=spec["params"], on_done=self.done, mode=spec.get("mode", "code"),
            eos_id=spec.get("eos", 625), want_hidden=spec.get("want_hidden", spec.get("mode", "code") == "code"),
            on_tokens=self.on_tokens if spec.get("every") else None, stream_every=spec.get("every") or 1,
            audio_codes=spec.get("audio_codes"), spk_emb=spec.get("spk_emb"), spk_emb_id=spec.get("spk_emb_id", -1),
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
    specs = [dict(ids=torch.randint(0, 21000, (4 + 5 * i,), generator=g),
                  params=SamplingParams(0.3, 0.7, 20, 1.05, n, m, seed=200 + i))
             for i, (n, m) in enumerate(lim)]
    specs[1]["every"] = 1
    specs[3]["every"] = 4
    specs[5].update(every=7, every_then=2)
    specs[6].update(every=3, cancel_after=10)  # cancels itself from its stream callback
    specs.append(dict(ids=torch.randint(0, 21000, (11,), generator=g),
                      params=SamplingParams(0.7, 0.7, 20, 1.0, 30, 5, seed=9),
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
                recs[i] = Rec(spec)
                eng.submit(recs[i].req)
        if all(r is not None and r.result is not None for r in recs):
            return recs
        eng._run_once(block=False)
        assert_counts_agree(eng)
        it += 1
        assert it < limit, "scenario did not finish"


def assert_counts_agree(eng):
    """The host's count of each running row's tokens is the device's, except (overlap) for a row that the step in
    flight ran and did not end: one behind, until that step's bookkeeping. Every step is counted exactly once,
    for the rows it ran, wherever compaction has moved them since."""
    import numpy as np

    assert eng._first is None, "an admission's first tokens left unread past its iteration"
    b = len(eng.rows)
    lag = eng.n_dev[:b].cpu().numpy() - eng.h_n[:b]
    want = np.zeros(b, dtype=np.int64)
    f = eng._flight
    if f is not None:
        where = f.slot_of[:b]
        ran = where >= 0
        want[ran] = 1 - f.host[where[ran]]
    assert (lag == want).all(), (lag, want)


def check_same_as_alone(alone, batched, hidden_atol=1e-5):
    # tokens and stream chunk boundaries exactly; hidden states to 1e-5: a CPU GEMM rounds a row
    # differently with the number of rows beside it (a few ulp, measured ≤ 5e-7 here)
    for a, b in zip(alone, batched, strict=True):
        assert a.result.finish_reason == b.result.finish_reason
        assert len(a.chunks) == len(b.chunks)
        for x, y in zip(a.chunks, b.chunks, strict=True):
            assert torch.equal(x, y)
        for x, y in zip(a.hids, b.hids, strict=True):
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


def assert_pool_whole(eng):
    assert sorted(eng.free_pages) == list(range(1, eng.num_pages)) and not eng.scheduler.suspended
    assert not eng.h_table.any() and not eng.h_pages.any()


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


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def assert_served_without_a_new_decode_graph(eng, reqs, want, decode) -> None:
    """`reqs` served by `eng` after its warm-up: no decode graph beyond `decode`, the tokens of `want`."""
    got = [eng.generate(GenRequest(r.text_ids, r.params, None)) for r in reqs]
    assert {k for k in eng.graphs.graphs if k[0] == "code"} == decode
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.tokens, b.tokens)


# Reduced-precision exports against upstream fp32. A bf16 value carries 8 significant bits
# (unit roundoff 2**-9 ≈ 2e-3), fp16 11 bits (2**-12 ≈ 2.4e-4); through 20 residual layers the
# errors add up to ~5x that. Measured on the full-size synthetic weights (prefill, relative
# Frobenius error of the hidden states): bf16 1.3e-2, fp16 1.6e-3. Bounds: 2.5x those.
REDUCED_BOUNDS = {torch.bfloat16: (3e-2, 0.08), torch.float16: (4e-3, 0.01)}  # (hidden rel, logits abs)
