"""The in-flight engine (chattts_triton/runtime/engine.py): equal to upstream generate, each request equal to
itself alone whatever its batchmates, paging, admission, compiled steps and graphs, counters."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from chattts_triton.config import KV_PAGE_TOKENS
from chattts_triton.model.gpt import load_gpt
from chattts_triton.runtime.engine import Engine, EngineError, GenRequest, SamplingParams
from tests.engine_util import (
    Rec,
    assert_pool_whole,
    assert_served_without_a_new_decode_graph,
    check_same_as_alone,
    drive,
    graphs_compiled,
    greedy,
    instrument,
    load_gpt_like,
    make_engine,
    scenario_specs,
    upstream_generate,
    upstream_gpt,
)

# the engine's loop with and without overlapping the host's bookkeeping with the next step (Engine overlap: on by
# default on CUDA only; the CPU runs the same logic, its ops synchronous)
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


@OVERLAP
@pytest.mark.parametrize("scripted", [False, True, "packed"])
def test_engine_greedy_codes_and_hiddens_equal_upstream_generate(tiny, scripted, overlap):
    """"packed": the eager module with the decode kernel's interface (its reference here), whose prompts are
    prefilled packed end to end (`Engine.packed_prefill`)."""
    arch, emb, g, ours = tiny
    model = torch.jit.script(ours) if scripted is True else ours
    eng = make_engine(model, arch, overlap=overlap, decode_kernel=scripted == "packed",
                      packed_prefill=scripted == "packed")
    assert eng.packed_prefill == (scripted == "packed")
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


@OVERLAP
def test_request_output_does_not_depend_on_batchmates(tiny, overlap):
    """Real sampling (temperature 0.3): alone vs joined mid-flight by others, same tokens."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=8, overlap=overlap)
    prompts = [torch.randint(0, 21000, (5 + 7 * i,)) for i in range(6)]
    params = [SamplingParams(0.3, 0.7, 20, 1.05, 30 + 10 * i, 10, seed=100 + i) for i in range(6)]
    try:
        alone = [eng.generate(GenRequest(text_ids=p, params=sp, on_done=None))
                 for p, sp in zip(prompts, params, strict=True)]
        results = [None] * 6
        done = threading.Barrier(7)

        def run(i):
            results[i] = eng.generate(GenRequest(text_ids=prompts[i], params=params[i], on_done=None))
            done.wait()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        done.wait(timeout=120)
        for a, b in zip(alone, results, strict=True):
            assert torch.equal(a.tokens, b.tokens)
            assert torch.allclose(a.hiddens, b.hiddens, atol=1e-5)
        assert len({tuple(r.tokens.flatten().tolist()) for r in results}) == 6  # seeds matter
    finally:
        eng.stop()


@OVERLAP
def test_min_new_tokens_forbids_eos_and_max_new_tokens_stops(tiny, overlap):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, overlap=overlap)
    try:
        p = SamplingParams(5.0, None, None, 1.0, 25, 25, seed=3)  # hot sampling: EOS would be likely
        r = eng.generate(GenRequest(text_ids=torch.arange(1, 9), params=p, on_done=None))
        assert r.tokens.shape == (25, 4) and r.finish_reason == "max_tokens"
        assert not (r.tokens == 625).any()
    finally:
        eng.stop()


@OVERLAP
def test_context_overflow_and_cancel(tiny, overlap):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_context=64, max_new_tokens=60, overlap=overlap)
    try:
        with pytest.raises(ValueError, match="exceeds the context"):
            eng.submit(GenRequest(text_ids=torch.arange(1, 20), params=greedy(60, 0), on_done=lambda r: None))
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.submit(GenRequest(text_ids=torch.arange(1, 5), params=greedy(61, 0), on_done=lambda r: None))
        got = []
        ev = threading.Event()
        req = GenRequest(text_ids=torch.arange(1, 5), params=greedy(55, 55),
                         on_done=lambda r: (got.append(r), ev.set()))
        eng.submit(req)
        req.cancel()
        assert ev.wait(30)
        assert got[0].finish_reason == "cancelled" and got[0].tokens is None
        assert eng.active == 0 and len(eng.free) == 4
    finally:
        eng.stop()


@OVERLAP
def test_a_cancelled_running_row_frees_its_slot_at_the_next_step_and_the_release_is_counted(tiny, overlap):
    """Barge-in: a cancel between steps frees the row's slot and pages at the end of the next decode step (one
    step begun since the cancel); a cancel from a stream callback (during a step, before its bookkeeping) at the
    end of that same step. Neither is counted late, and the others keep running. With overlap the bookkeeping
    that checks the cancel is the previous step's, run after the next one's launch: still one step begun."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False, overlap=overlap)
    got = {}

    def req(i, **kw):
        return GenRequest(text_ids=torch.arange(1, 6 + i), params=greedy(100, 100, seed=i),
                          on_done=lambda r, i=i: got.__setitem__(i, r), **kw)

    reqs = [req(0), req(1, on_tokens=lambda t, h: reqs[1].cancel() if reqs[1].cancelled_at is None and len(got) == 0
                        and eng.counters.steps >= 3 else None), req(2)]
    try:
        for r in reqs:
            eng.submit(r)
        while eng.counters.steps < 3:
            eng._run_once(block=False)
        # the callback cancelled row 1 during step 3's delivery: released by that step's bookkeeping
        assert got.get(1) is not None and got[1].finish_reason == "cancelled" and eng.active == 2
        free = len(eng.free)
        reqs[0].cancel()
        eng._run_once(block=False)
        assert got.get(0) is not None and got[0].finish_reason == "cancelled"
        assert eng.active == 1 and len(eng.free) == free + 1 and 2 not in got
        c = eng.counters
        assert c.cancel_releases == 2 and c.cancel_release_late == 0
        assert 0 < c.cancel_release_max_seconds <= c.cancel_release_seconds
        stats = eng.stats()
        assert stats["engine_cancel_releases"] == 2 and stats["engine_cancel_release_late"] == 0
    finally:
        eng.stop(drain=False)


def test_with_overlap_compaction_moves_the_rows_of_the_step_in_flight(tiny):
    """Overlap: a row ends while the next step is already launched; compaction moves the last row into its slot,
    and the step in flight's flags must follow it there (or that row would read the ended one's flags)."""
    from tests.engine_util import assert_counts_agree

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False, overlap=True)
    done = {}
    reqs = [GenRequest(torch.arange(1, 6 + i), greedy(30, 30, seed=i), lambda r, i=i: done.__setitem__(i, r))
            for i in range(4)]
    for r in reqs:
        eng.submit(r)
    while eng._flight is None or len(eng.rows) < 4:
        eng._run_once(block=False)
    eng._run_once(block=False)
    before = {id(s.req): s.idx for s in eng.rows}
    reqs[1].cancel()
    eng._run_once(block=False)  # launches a step of all four, then the last one's bookkeeping ends row 1
    f = eng._flight
    assert [s.idx for s in eng.rows] == [0, 1, 2] and eng.rows[1].req is reqs[3]
    assert [int(f.slot_of[s.idx]) for s in eng.rows] == [before[id(s.req)] for s in eng.rows] == [0, 3, 2]
    assert (f.slot_of[3:] == -1).all()
    while len(done) < 4:
        eng._run_once(block=False)
        assert_counts_agree(eng)
    assert done[1].finish_reason == "cancelled"
    plain = make_engine(ours, arch, start=False)
    for i in (0, 2, 3):
        assert done[i].finish_reason == "max_tokens"
        assert torch.equal(done[i].tokens, drive(plain,
                                                 [dict(ids=reqs[i].text_ids, params=reqs[i].params)])[0].result.tokens)


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
        text = eng.generate(GenRequest(text_ids=torch.arange(1, 9),
                                       params=SamplingParams(1.0, None, None, 1.0, 20, 20, seed=5),
                                       on_done=None, mode="text", eos_id=21140, want_hidden=False))
        assert text.tokens.max() >= 626  # text ids beyond the audio vocabulary were left in the slot
        code = eng.generate(GenRequest(text_ids=torch.arange(1, 9), params=greedy(10, 10), on_done=None))
        assert code.finish_reason == "max_tokens" and code.tokens.shape == (10, 4)
    finally:
        eng.stop()


@OVERLAP
@pytest.mark.parametrize("graphs", ["eager", "buckets"])
def test_compaction_and_finish_order_leave_every_request_as_alone(tiny, graphs, overlap):
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
    alone = [drive(eng, [s])[0] for s in specs]  # the plain loop: overlap must not change a token
    eng.overlap = overlap
    seen = instrument(eng)
    batched = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2])
    check_same_as_alone(alone, batched)
    assert seen["moves"] >= 3 and {"code", "mixed"} <= seen["modes"]
    if graphs == "buckets":
        assert seen["padded"] > 0
        # the joins' prefills ran padded to their buckets (rows and prompt length)
        prefills = [key for key in eng.graphs.graphs if key[0] == "prefill"]
        assert prefills and any(kb > 1 for _, kb, _ in prefills)
        # and the code admissions' first tokens came from their count buckets' graphs (refine text: eagerly)
        assert any(key[0] == "first" and key[1] > 1 for key in eng.graphs.graphs)
    assert eng.active == 0 and eng.pending == 0
    rows = eng.row_params  # free slots are reset
    assert torch.equal(rows.ints, eng._free_row.ints.expand(8, -1)) and (rows.floats == 1).all()


@OVERLAP
@pytest.mark.parametrize("graphs,cache", [("eager", torch.float32), ("buckets", torch.float32),
                                          ("eager", torch.float8_e4m3fn)])
def test_requests_suspended_for_want_of_pages_resume_exactly_where_they_stopped(tiny, graphs, cache, overlap):
    """A page pool too small for the scenario's requests together (the smallest the context allows: one
    request of the full context): the newest are suspended mid-generation, their pages copied out, and
    resumed later. Each request's tokens, hidden states and stream chunks are still what it produces
    alone, and every page comes back to the pool; an fp8 cache's pages too (moved as bytes)."""
    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    specs = scenario_specs()
    alone = [drive(make_engine(ours, arch, max_slots=8, start=False, cache_dtype=cache), [s])[0] for s in specs]
    longest = max(len(s["ids"]) + s["params"].max_new_tokens for s in specs)
    eng = make_engine(ours, arch, max_slots=8, max_context=longest, cache_tokens=longest, start=False, overlap=overlap,
                      cache_dtype=cache)
    assert eng.k_cache.dtype == cache
    assert eng.num_pages - 1 == -(-longest // KV_PAGE_TOKENS) == 5
    if graphs == "buckets":
        eng.graphs = CudaGraphs(eng, capture=False)
    batched = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2])
    check_same_as_alone(alone, batched)
    assert eng.counters.preemptions >= 3 and eng.counters.resumes == eng.counters.preemptions, eng.counters.preemptions
    stats = eng.stats()
    assert (stats["engine_preemptions"] == eng.counters.preemptions
            and stats["engine_kv_pages_free"] == stats["engine_kv_pages"] == 5)
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


@OVERLAP
def test_a_request_cancelled_while_suspended_ends_cancelled_and_frees_nothing_twice(tiny, overlap):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=4, max_context=64, cache_tokens=64, start=False, overlap=overlap)
    g = torch.Generator().manual_seed(5)
    specs = [dict(ids=torch.randint(0, 21000, (8,), generator=g),
                  params=SamplingParams(0.3, 0.7, 20, 1.05, 40, 40, seed=i))
             for i in range(3)]  # 3 × 48 positions (3 pages) in a pool of 4 pages: two start, one is suspended
    recs = [Rec(spec) for spec in specs]
    for r in recs:
        eng.submit(r.req)
    for _ in range(200):
        eng._run_once(block=False)
        if eng.scheduler.suspended:
            break
    assert eng.scheduler.suspended, "no request was suspended"
    victim = next(r for r in recs if id(r.req) in eng.scheduler.suspended)
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
        eng.submit(GenRequest(torch.randint(0, 21000, (40,), generator=g),
                              SamplingParams(0.3, 0.7, 20, 1.05, 8, 8, seed=i),
                              lambda r: None))
    eng._run_once(block=False)
    assert len(eng.rows) == 2 and eng.pending == 2  # 2 × 3 pages, and one in reserve for each of them


def test_engine_is_full_once_running_and_waiting_requests_reach_max_pending(tiny):
    """What GPTService refuses by ("server busy"): running + waiting, counted by the engine's scheduler."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=2, max_pending=3, start=False)
    reqs = [GenRequest(torch.arange(1, 9), greedy(4, 4, seed=i), lambda r: None) for i in range(3)]
    for r in reqs[:2]:
        eng.submit(r)
    assert not eng.full()
    eng.submit(reqs[2])
    assert eng.full()
    eng._run_once(block=False)
    assert (eng.active, eng.pending) == (2, 1) and eng.full()  # admitted, still counted
    for _ in range(50):
        eng._run_once(block=False)
    assert (eng.active, eng.pending) == (0, 0) and not eng.full()
    assert not make_engine(ours, arch, max_slots=2, start=False).full()  # max_pending 0: no bound


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
    warm = graphs_compiled()
    assert warm >= 2  # code batch 1, batch ≥ 2 (dynamic); text mode runs the plain step
    assert (eng.graph_prefill is not None) == prefill  # it compiled: no fallback to the plain prefill
    warm_prefills = len(prefills)
    assert (warm_prefills > 0) == prefill
    # and the common prefill buckets (here up to 16 slots): graphs before any client
    assert {("prefill", k, t) for k in (1, 2, 4, 8, 16) for t in (16, 32, 64, 128)} <= set(eng.graphs.graphs)
    got = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2, 5])
    assert graphs_compiled() == warm, (warm, graphs_compiled())
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


@pytest.mark.parametrize("graphs", ["eager", "buckets"])
def test_packed_prefills_give_every_request_what_padded_prefills_give_it(tiny, graphs):
    """Prompts prefilled packed end to end (`Engine.packed_prefill`: each position a row of the decode kernel,
    here its reference) against padded to the longest, over the scenario of joins, finishes and streams plus
    a prompt with a speaker embedding and one with reference audio codes: the same tokens and stream chunks,
    hidden states equal to float rounding. "buckets": the packed prefills run from token-bucket graphs
    (standing in eagerly), one graph per bucket whatever the prompts' count and lengths."""
    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    g = torch.Generator().manual_seed(3)
    specs = scenario_specs()
    specs.append(dict(ids=torch.cat([torch.randint(0, 21000, (5,), generator=g), torch.tensor([21143]),
                                     torch.randint(0, 21000, (9,), generator=g)]),
                      params=SamplingParams(0.3, 0.7, 20, 1.05, 20, 20, seed=31),
                      spk_emb=torch.randn(arch.gpt.hidden, generator=g), spk_emb_id=21143))
    specs.append(dict(ids=torch.randint(0, 21000, (7,), generator=g), params=SamplingParams(0.3, 0.7, 20, 1.05, 24, 24,
                                                                                           seed=32),
                      audio_codes=torch.randint(0, 625, (6, arch.num_vq), generator=g)))
    got = {}
    for packed in (False, True):
        eng = make_engine(ours, arch, max_slots=12, start=False, decode_kernel=True, packed_prefill=packed)
        assert eng.packed_prefill == packed
        if graphs == "buckets":
            eng.graphs = CudaGraphs(eng, capture=False)
        got[packed] = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2, 0, 5])
        if graphs == "buckets":
            kinds = {key[0] for key in eng.graphs.graphs}
            assert ("packed" in kinds) == packed and ("prefill" in kinds) == (not packed)
    for padded, packed in zip(got[False], got[True], strict=True):
        assert padded.result.finish_reason == packed.result.finish_reason
        assert (padded.result.tokens is None) == (packed.result.tokens is None)
        if padded.result.tokens is not None:
            assert torch.equal(padded.result.tokens, packed.result.tokens)
        if padded.result.hiddens is not None:
            assert (padded.result.hiddens - packed.result.hiddens).abs().max() <= 1e-4
        assert [c.tolist() for c in padded.chunks] == [c.tolist() for c in packed.chunks]


def test_packed_prefill_switched_on_later_without_the_decode_kernel_stays_padded(tiny):
    """`Engine.packed_prefill` set True after construction on an engine without the decode kernel (only the kernel
    reads a packed prompt's keys) stays off: a prompt longer than the padded mask's first length bucket gets the
    tokens it gets from an engine never asked for packing, instead of being cut."""
    arch, _, _, ours = tiny

    def req():
        return GenRequest(torch.arange(3, 203) % 21000, SamplingParams(0.3, 0.7, 20, 1.05, 8, 8, seed=5), None)

    plain = make_engine(ours, arch, decode_kernel=False)
    try:
        want = plain.generate(req()).tokens.tolist()
    finally:
        plain.stop()
    eng = make_engine(ours, arch, decode_kernel=False, start=False)
    eng.packed_prefill = True
    assert not eng.decode_kernel and not eng.packed_prefill
    eng.start()
    try:
        assert eng.generate(req()).tokens.tolist() == want
    finally:
        eng.stop()


def test_warm_up_and_warm_graphs_capture_every_packed_prefill_bucket_before_a_load(tiny):
    """With packed prefills, warm_up captures the token buckets up to PACKED_WARM_TOKENS and warm_graphs the rest
    up to PREFILL_GRAPH_TOKENS (graphs standing in eagerly), none padded; a load of many prompt counts and
    lengths afterwards meets no new prefill bucket and gets a plain engine's tokens."""
    from chattts_triton.runtime.engine import PREFILL_GRAPH_TOKENS, CudaGraphs
    from chattts_triton.runtime.graphs import PACKED_STEP, PACKED_WARM_TOKENS, bucket_sizes

    arch, _, _, ours = tiny
    reqs = [GenRequest(torch.arange(3 + i, 20 + 4 * i), SamplingParams(0.3, 0.7, 20, 1.05, 6, 6, seed=i), None)
            for i in range(24)]
    # a prefill budget of 1536 positions: buckets up to 1536 (the reference attention is slow on a CPU)
    kw = dict(max_slots=64, max_context=256, decode_kernel=True, packed_prefill=True, max_prefill_tokens=1536)
    plain = make_engine(ours, arch, **kw)
    try:
        want = [plain.generate(r) for r in reqs[:3]]
    finally:
        plain.stop()
    eng = make_engine(ours, arch, start=False, **kw)
    eng.graphs = CudaGraphs(eng, capture=False)
    eng.start()
    try:
        eng.warm_up()
        buckets = [t for t in bucket_sizes(PACKED_STEP, PREFILL_GRAPH_TOKENS) if t <= 1536]
        assert buckets[-3:] == [1024, 1280, 1536] and PACKED_WARM_TOKENS == 1024
        assert {k for k in eng.graphs.graphs if k[0] == "packed"} == {("packed", t) for t in buckets
                                                                      if t <= PACKED_WARM_TOKENS}
        eng.warm_graphs()
        prefill = {k for k in eng.graphs.graphs if k[0] in ("packed", "prefill")}
        assert prefill == {("packed", t) for t in buckets}
        assert [eng.generate(r).tokens.tolist() for r in reqs[:3]] == [w.tokens.tolist() for w in want]
        done = []
        for r in reqs:  # one admission, several prompt lengths: a bucket warmed before
            r.on_done = done.append
        with eng.cv:
            for r in reqs:
                eng.submit(r)
        deadline = time.monotonic() + 120
        while len(done) < len(reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(done) == len(reqs) and all(d.finish_reason == "max_tokens" for d in done)
        assert {k for k in eng.graphs.graphs if k[0] in ("packed", "prefill")} == prefill
    finally:
        eng.stop()


def test_warm_graphs_captures_every_bucket_a_load_reaches_on_the_engine_thread(tiny):
    """warm_graphs on a started engine (graphs standing in eagerly on the CPU): the decode graph of
    every batch bucket at every attention bucket up to WARM_DECODE_LEN and the prefill graphs of the
    prompt counts past PREFILL_WARM_BATCHES, captured on the engine's own thread (where graphs
    replay) before any client; requests served afterwards capture nothing new and get the tokens a
    plain engine gives them."""
    from chattts_triton.runtime.engine import (
        BATCH_STEP,
        MAX_EMPTY_RETRIES,
        PREFILL_GRAPH_TOKENS,
        PREFILL_WARM_BATCHES,
        PREFILL_WARM_LENGTHS,
        WARM_DECODE_LEN,
        CudaGraphs,
        bucket_sizes,
    )

    arch, _, _, ours = tiny
    reqs = [GenRequest(torch.arange(3 + i, 20 + 2 * i), SamplingParams(0.3, 0.7, 20, 1.05, 30, 30, seed=i), None)
            for i in range(5)]
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
        first = {k for k in eng.graphs.graphs if k[0] == "first"}
        assert first == {("first", kb, MAX_EMPTY_RETRIES) for kb in (1, 2, 4, 8, 16, 32, 64, 80)}
        assert n == len(eng.graphs.graphs)
        assert_served_without_a_new_decode_graph(eng, reqs, want, decode)
        assert {k for k in eng.graphs.graphs if k[0] == "first"} == first
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
        def inner():
            names.append(threading.current_thread().name)
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
        spec = [dict(ids=torch.arange(3, 14), params=SamplingParams(0.7, 0.7, 20, 1.0, 12, 4, seed=9), mode="text",
                     eos=21140)]
    else:
        g = torch.Generator().manual_seed(5)
        spec = [dict(ids=torch.randint(0, 21000, (150,), generator=g),
                     params=SamplingParams(0.3, 0.7, 20, 1.05, 12, 12, seed=8))]
    plain = make_engine(ours, arch, start=False)
    plain.graphs = CudaGraphs(plain, capture=False)
    expected = drive(plain, spec)
    torch._dynamo.reset()
    eng = make_engine(ours, arch, start=False)
    eng.graphs = CudaGraphs(eng, capture=False)
    eng.compile_step(backend="aot_eager", dynamic=case == "text_mode")
    eng.warm_up(text_eos_id=None, freeze=case != "text_mode")  # code only
    assert eng.compiled_frozen == (case != "text_mode")
    warm = graphs_compiled()
    got = drive(eng, spec)
    assert graphs_compiled() == warm
    check_same_as_alone(expected, got)


def _plain_and_gemv_runs(ours, arch, decode_kernel: bool | None = None, **compile_kw):
    """Two requests (one alone, then beside the other, then alone again) through a plain engine, then through one whose
    step is compiled with gemv by a backend that keeps each traced graph: (plain's, gemv's, the graphs). The caller
    turns gemv off again (`ours.set_gemv(False)`)."""
    from chattts_triton.runtime.engine import CudaGraphs

    specs = [dict(ids=torch.arange(1, 12), params=SamplingParams(0.3, 0.7, 20, 1.05, 14, 14, seed=8)),
             dict(ids=torch.arange(3, 9), params=SamplingParams(0.3, 0.7, 20, 1.05, 20, 20, seed=9))]
    plain = make_engine(ours, arch, start=False, decode_kernel=decode_kernel)
    plain.graphs = CudaGraphs(plain, capture=False)
    expected = drive(plain, specs, join=[0, 6])
    traced = []

    def record(gm, example_inputs):  # a torch.compile backend: keep the graph, run it as traced
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()
    eng = make_engine(ours, arch, start=False, decode_kernel=decode_kernel)
    eng.graphs = CudaGraphs(eng, capture=False)
    eng.compile_step(backend=record, gemv=True, **compile_kw)
    return expected, drive(eng, specs, join=[0, 6]), traced


def test_with_gemv_the_compiled_step_of_one_row_sums_products_instead_of_gemms_and_gives_the_same_tokens(tiny):
    """--gpt-gemv: the decode step compiled for one row traces no GEMM (linear, einsum) but products summed over the
    input (`gemv_linear`); the step compiled for more rows keeps its GEMMs; eager calls never take it. A request that
    runs alone, then beside another, then alone again gets the same tokens and, to float rounding, the same hidden
    states as from the plain step."""
    import torch.nn.functional as F

    arch, _, _, ours = tiny
    try:
        expected, got, traced = _plain_and_gemv_runs(ours, arch, gemv_kernels=False)
        gemms = [sum(n.target in (F.linear, torch._C._nn.linear, torch.einsum, torch.functional.einsum)
                     for n in gm.graph.nodes) for gm in traced]
        sums = [sum(n.target == "sum" or n.target is torch.sum for n in gm.graph.nodes) for gm in traced]
        assert len(traced) >= 2 and 0 in gemms and max(gemms) > 0, gemms  # one row's graph; more rows'
        assert all(s >= arch.gpt.layers * 3 for s, g in zip(sums, gemms, strict=True) if g == 0), sums
        check_same_as_alone(expected, got, hidden_atol=1e-5)
        assert [r.tokens.shape for r in (e.result for e in got)] == [(14, 4), (20, 4)]
    finally:
        ours.set_gemv(False)
        torch._dynamo.reset()


def test_with_gemv_kernels_the_one_row_step_runs_four_row_kernels_a_layer_and_gives_the_same_tokens(tiny, monkeypatch):
    """--gpt-gemv with its row kernels (the default where they pay: Hopper's programmatic dependent launch): the decode
    step compiled for one row calls
    `chattts_triton::row_matvec` four times a layer (norm + q/k/v, o + skip, norm + gate/up, down + skip) and traces no
    GEMM; the step of more rows keeps its GEMMs and never calls it. A request alone, then beside another, then alone
    again gets the plain step's tokens and, to float rounding, its hidden states (on a CPU the operator computes
    `rowops.reference`; the kernel itself: tests/test_rowops.py). Where they do not pay, inductor's reductions."""
    import torch.nn.functional as F

    from chattts_triton.model import gpt as gpt_module
    from chattts_triton.model import rowops

    # on a CPU row_matvec skips the operator: route it through, and let the engine take it, as on an H100
    monkeypatch.setattr(gpt_module, "row_matvec", lambda *a: torch.ops.chattts_triton.row_matvec(*a))
    monkeypatch.setattr(rowops, "kernels_pay", lambda device: True)
    arch, _, _, ours = tiny
    try:
        expected, got, traced = _plain_and_gemv_runs(ours, arch, decode_kernel=True)  # as on a GPU
        assert all(layer.row_kernels for layer in ours.layers)
        op = torch.ops.chattts_triton.row_matvec
        ops = [sum(n.target in (op, op.default) for n in gm.graph.nodes) for gm in traced]
        # (the attention's stand-in on a CPU is an einsum: linears only)
        gemms = [sum(n.target in (F.linear, torch._C._nn.linear) for n in gm.graph.nodes) for gm in traced]
        assert len(traced) >= 2 and sorted(set(ops)) == [0, 4 * arch.gpt.layers], ops
        assert all((o == 0) == (g > 0) for o, g in zip(ops, gemms, strict=True)), (ops, gemms)
        check_same_as_alone(expected, got, hidden_atol=1e-5)
        assert [r.tokens.shape for r in (e.result for e in got)] == [(14, 4), (20, 4)]
    finally:
        ours.set_gemv(False)
        ours.decode_kernel = False
        torch._dynamo.reset()
    assert not any(layer.row_kernels for layer in ours.layers)
    monkeypatch.setattr(rowops, "kernels_pay", lambda device: False)  # a GPU without programmatic dependent launch
    try:
        make_engine(ours, arch, start=False, decode_kernel=True).compile_step(backend=lambda gm, _: gm.forward,
                                                                             gemv=True)
        assert ours.gemv and not any(layer.row_kernels for layer in ours.layers)
    finally:
        ours.set_gemv(False)
        ours.decode_kernel = False
        torch._dynamo.reset()


def test_with_gemv_the_one_row_bucket_runs_a_compile_of_its_own_that_inductor_tunes_when_asked(tiny, monkeypatch):
    """--gpt-gemv: the one-row bucket runs its own compile of the step (`compiled_step(1)`), with inductor's
    coordinate-descent tuning (`tuning.ONE_ROW_OPTIONS`) under --gpt-gemv-tune; buckets of more rows run the shared
    dynamic compile, untuned. Without gemv every bucket runs the shared one."""
    calls = []

    def compile_recorded(fn, **kw):  # stands in for torch.compile: what it was asked, the function itself
        calls.append(kw)
        return lambda *a, **k: fn(*a, **k)

    arch, _, _, ours = tiny
    monkeypatch.setattr(torch, "compile", compile_recorded)
    try:
        eng = make_engine(ours, arch, start=False)
        eng.compile_step(gemv=True, gemv_tune=True)
        assert [c.get("options") for c in calls] == [None, {"coordinate_descent_tuning": True}]
        assert all(c["backend"] == "inductor" and c["dynamic"] for c in calls)
        assert eng.compiled_step(1) is eng.graph_step_one and eng.graph_step_one is not eng.graph_step
        assert eng.compiled_step(2) is eng.compiled_step(64) is eng.graph_step
        calls.clear()
        untuned = make_engine(ours, arch, start=False)
        untuned.compile_step(gemv=True)  # its own compile, with the heuristic's launch configurations
        assert [c.get("options") for c in calls] == [None, None] and untuned.compiled_step(1) is untuned.graph_step_one
        calls.clear()
        plain = make_engine(ours, arch, start=False)
        plain.compile_step(gemv=False)
        assert len(calls) == 1 and plain.graph_step_one is None and plain.compiled_step(1) is plain.graph_step
    finally:
        ours.set_gemv(False)


def test_padding_row_over_a_slot_left_by_refine_text(tiny):
    """A free slot that held text-vocabulary tokens pads a code-only bucket: its lookups stay in
    range and the live rows are unaffected."""
    from chattts_triton.runtime.engine import CudaGraphs

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=4, start=False)
    eng.graphs = CudaGraphs(eng, capture=False)
    seen = instrument(eng)
    code = [dict(ids=torch.arange(1 + i, 9 + i), params=SamplingParams(0.3, 0.7, 20, 1.05, 30, 30, seed=i))
            for i in range(3)]
    text = dict(ids=torch.arange(1, 9), params=SamplingParams(1.0, None, None, 1.0, 10, 10, seed=5), mode="text",
                eos=21140)
    recs = drive(eng, code + [text])
    assert recs[3].result.tokens.max() >= 626 and seen["padded"] > 0  # slot 3 held text ids, then padded
    alone = [drive(eng, [c])[0] for c in code]
    check_same_as_alone(alone, recs[:3])


@OVERLAP
def test_more_requests_than_slots_queue_and_match_alone(tiny, overlap):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=3, start=False)
    specs = scenario_specs(seed=3)
    alone = [drive(eng, [s])[0] for s in specs]
    eng.overlap = overlap
    check_same_as_alone(alone, drive(eng, specs))


@OVERLAP
def test_admission_batches_prefills_when_busy_and_admits_at_once_when_idle(tiny, overlap):
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=8, start=False, admit_batch=3, admit_wait_steps=4, overlap=overlap)
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

    assert [_bucket(n, 32, 512) for n in (1, 2, 3, 5, 32, 33, 64, 65, 500, 512)] == [1, 2, 4, 8,
                                                                                     32, 64, 64, 96, 512, 512]
    assert _bucket(300, 32, 300) == 300 and _bucket(129, 128, 200) == 200


def test_model_with_the_old_slots_signature_is_refused(tiny):
    from chattts_triton.runtime.engine import EngineError

    arch = tiny[0]

    class Old(torch.nn.Module):
        def forward(self, x, positions, slots, k_cache, v_cache, attn_len):
            return x

    with pytest.raises(EngineError, match="re-export"):
        make_engine(Old(), arch, start=False)


def test_engine_stats_are_exactly_the_engine_gauges_the_backend_publishes(tiny):
    """Every `engine_*` key the backend describes (STAT_HELP) comes from Engine.stats(), and nothing else does;
    the counters of `EngineStats` are among them, as numbers."""
    from chattts_triton.runtime.stats import EngineStats
    from chattts_triton.triton.backend import STAT_HELP

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False)
    s = eng.stats()
    assert set(s) == {k for k in STAT_HELP if k.startswith("engine_")}
    assert set(EngineStats().report()) < set(s) and all(isinstance(v, (int, float)) for v in s.values())


@OVERLAP
def test_engine_counts_its_steps_rows_and_busy_time(tiny, overlap):
    """With overlap too: a row that its step in flight takes to max_tokens is not counted in the next step (it
    runs there, but nothing reads it), and no step is launched once every row ends with the one in flight."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False, overlap=overlap)
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
    # the first step follows a prefill from idle, every later one ran on rows of the one before
    assert s["engine_step_gaps"] == 18 and 0 < s["engine_step_gap_max_seconds"] <= s["engine_step_gap_seconds"]


def test_a_step_gap_that_cannot_be_read_stops_the_gap_counts_not_the_requests(tiny, caplog):
    """A measurement must never fail the requests in flight: where the end of a step cannot be read (on CUDA an
    event), the engine logs it once and counts no more gaps; every request finishes as without it."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False)
    real = eng._mark_end

    def unreadable(f, carried):
        real(f, carried)
        f.end = object()  # no clock reading: subtracting it raises

    eng._mark_end = unreadable
    recs = drive(eng, [dict(ids=torch.arange(1, 9), params=greedy(12, 12, seed=0))])
    assert recs[0].result.finish_reason == "max_tokens" and recs[0].result.tokens.shape[0] == 12
    assert eng.counters.step_gaps == 0 and eng._gap_timing_failed
    assert sum("no more step gaps" in r.getMessage() for r in caplog.records) == 1


@OVERLAP
def test_a_prefill_between_two_steps_of_running_rows_is_inside_their_step_gap(tiny, overlap):
    """EngineStats.step_gaps, the running rows' cadence: a request's long prompt prefilled while another runs
    lengthens that one's gap between two steps by at least the prefill's time, and the largest gap says so; a
    step after an idle engine's admission is no running row's gap; `restart_step_gaps` (after start-up's
    warm-up) starts the largest afresh and keeps the counts."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False, overlap=overlap)
    drive(eng, [dict(ids=torch.arange(1, 9), params=greedy(12, 12, seed=0))])
    c = eng.counters
    assert c.step_gaps == c.steps - 1 == 10 and c.step_gap_max_seconds > 0
    eng.restart_step_gaps()
    assert c.step_gap_max_seconds == 0 and c.step_gaps == 10
    prefills = []  # (whether rows were running, its time)
    real = eng._prefill

    def timed(reqs):
        running, t0 = bool(eng.rows), time.perf_counter()
        real(reqs)
        prefills.append((running, time.perf_counter() - t0))

    eng._prefill = timed
    drive(eng, [dict(ids=torch.arange(1, 9), params=greedy(30, 30, seed=1)),
                dict(ids=torch.arange(1, 61), params=greedy(5, 5, seed=2))], join=[0, 3])
    assert [r for r, _ in prefills] == [False, True]
    assert c.step_gaps == c.steps - 2  # after each idle admission, one step not counted
    assert c.step_gap_max_seconds >= prefills[1][1] > 0
    assert c.step_gap_seconds / c.step_gaps < c.step_gap_max_seconds


def test_the_gil_probe_reads_the_wait_another_python_thread_causes(tiny, monkeypatch):
    """The engine's GIL-wait figure is the wait its thread meets: with a thread spinning in Python and a
    10-ms switch interval, taking the GIL back after a release can wait the whole interval (a mean of
    ≥ 2 ms over 7 samples needs two of them to have waited); alone, the probe's own ≈ 0.07 ms (more on
    a loaded box, where the sleep lets other processes run: hence the ratio, not a bound)."""
    import sys
    import threading

    import chattts_triton.runtime.engine as engine_mod

    arch, _, _, ours = tiny
    specs = [dict(ids=torch.arange(1, 9), params=greedy(8, 8, seed=0))]
    monkeypatch.setattr(engine_mod, "GIL_PROBE_EVERY", 1)  # 7 samples in 7 steps (each contended step costs seconds)

    def mean_wait_ms(spin: bool) -> float:
        eng = make_engine(ours, arch, start=False)
        stop = threading.Event()

        def spinner() -> None:
            while not stop.is_set():
                pass

        t = threading.Thread(target=spinner, daemon=True)
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.01)
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
        assert s["engine_gil_wait_samples"] == 7  # every decode step: the first token comes with the prefill
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
    assert eng.active == 0 and eng.pending == 0 and eng.counters.steps >= 39 and order == []
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


def test_first_token_redraws_drawn_at_once_equal_drawing_them_one_after_another(tiny):
    """ensure_non_empty on the device (`sample_first`): every attempt is drawn at once, and each row keeps what
    drawing attempt after attempt (`sample_core` with the attempt counter set) keeps — the first draw that does
    not end the row, or the last attempt's; a row without ensure_non_empty keeps its first draw, EOS or not.
    Each row's EOS is set to its own first draw, so attempt 0 always ends it; a near-greedy row ends every
    attempt (all 16 tried, it ends); text rows too."""
    from chattts_triton.runtime.engine import MAX_EMPTY_RETRIES
    from chattts_triton.runtime.row_params import RowParams

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=8, start=False)
    specs = [  # (mode, temperature, ensure_non_empty)
        ("code", 1.0, True), ("code", 1.0, True), ("code", 1e-5, True), ("code", 1.0, False),
        ("text", 1.0, True), ("text", 1e-5, True),
    ]
    k = len(specs)
    reqs = [GenRequest(text_ids=torch.arange(1, 6), on_done=None, mode=m, eos_id=625 if m == "code" else 21140,
                       params=SamplingParams(t, None, None, 1.0, 20, 0, seed=100 + i, ensure_non_empty=e))
            for i, (m, t, e) in enumerate(specs)]
    torch.manual_seed(0)
    h = torch.randn(k, arch.gpt.hidden)

    def fresh():
        eng.row_params.narrow(0, k).copy_(RowParams.of(reqs))
        eng.tokens.zero_()

    def rows_of(mode):
        return torch.tensor([i for i, s in enumerate(specs) if s[0] == mode])

    with torch.inference_mode():
        fresh()  # each row's EOS := its attempt-0 draw (code rows: codebook 0)
        for mode in ("code", "text"):
            st = rows_of(mode)
            tok, _ = eng.sample_core(st, eng.row_params.select(st), h[st], mode)
            eng.row_params.eos[st] = tok[:, 0]
        for r, e in zip(reqs, eng.row_params.eos[:k].tolist(), strict=True):
            r.eos_id = e
        expected = {}
        for mode in ("code", "text"):
            st = rows_of(mode)
            for i in st.tolist():
                tries = MAX_EMPTY_RETRIES if specs[i][2] else 1
                for a in range(tries):
                    fresh()
                    p = eng.row_params.select(st[st == i])
                    p.attempt.fill_(a)
                    tok, hit = eng.sample_core(st[st == i], p, h[i : i + 1], mode)
                    if not hit[0]:
                        break
                expected[i] = (a, bool(hit[0]), eng.tokens[i, 0].clone())
        fresh()
        got_hit = {}
        for mode in ("code", "text"):
            st = rows_of(mode)
            ensure = torch.tensor([specs[i][2] for i in st.tolist()])
            got = eng.sample_first(st, eng.row_params.select(st), h[st], mode, ensure, MAX_EMPTY_RETRIES)
            got_hit.update(zip(st.tolist(), got.tolist(), strict=True))
    assert expected[0][0] >= 1 and expected[1][0] >= 1  # attempt 0 ended them: redrawn
    assert expected[2][:2] == (MAX_EMPTY_RETRIES - 1, True)  # near-greedy: every attempt ends it
    assert expected[3][:2] == (0, True)  # no ensure_non_empty: its first draw, an EOS
    for i, (a, hit, tok) in expected.items():
        assert got_hit[i] == hit, i
        assert int(eng.row_params.attempt[i]) == a, i
        assert int(eng.row_params.n[i]) == (0 if hit else 1), i
        assert torch.equal(eng.tokens[i, 0], tok), i


def test_first_tokens_from_their_count_buckets_graph_equal_the_eager_draws_and_pad_over_free_slots(tiny):
    """An admission's first tokens from the graph of its prompt-count bucket (`CudaGraphs.first_tokens`, standing in
    eagerly) are what `sample_first` draws for the same rows: EOS flags, tokens, hidden states, counts and attempts,
    redraws included. Its padding rows run over the free slot after the admission and leave its count and attempt
    a free slot's; the running rows before it are untouched. A bucket that would reach past the last slot gives
    None (the engine draws eagerly)."""
    from chattts_triton.runtime.engine import MAX_EMPTY_RETRIES, CudaGraphs
    from chattts_triton.runtime.row_params import RowParams

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=8, start=False)
    b0, k = 2, 3  # bucket 4: slot 5 pads
    running = [GenRequest(text_ids=torch.arange(1, 6), on_done=None,
                          params=SamplingParams(0.7, None, None, 1.0, 20, 0, seed=50 + i)) for i in range(b0)]
    kinds = [(1.0, True), (1e-5, True), (1.0, False)]  # (temperature, ensure_non_empty)
    reqs = [GenRequest(text_ids=torch.arange(1, 6), on_done=None,
                       params=SamplingParams(t, None, None, 1.0, 20, 0, seed=100 + i, ensure_non_empty=e))
            for i, (t, e) in enumerate(kinds)]
    redraw = [e for _, e in kinds]
    torch.manual_seed(0)
    h = torch.randn(k, arch.gpt.hidden)
    st = torch.arange(b0, b0 + k)

    def fresh():
        eng.row_params.copy_(RowParams.free(8))
        eng.row_params.narrow(0, b0).copy_(RowParams.of(running))
        eng.row_params.n[:b0] = 5  # mid-generation
        eng.row_params.narrow(b0, k).copy_(RowParams.of(reqs))
        eng.tokens.fill_(7)
        eng.hiddens.fill_(0.5)

    with torch.inference_mode():
        fresh()  # each new row's EOS := its attempt-0 draw, so that ensure_non_empty redraws it
        tok, _ = eng.sample_core(st, eng.row_params.select(st), h, "code")
        for r, e in zip(reqs, tok[:, 0].tolist(), strict=True):
            r.eos_id = e
        fresh()
        hit = eng.sample_first(st, eng.row_params.select(st), h, "code", torch.tensor(redraw), MAX_EMPTY_RETRIES)
        want = [t.clone() for t in (hit, eng.tokens, eng.hiddens, eng.row_params.ints, eng.row_params.floats)]
        fresh()
        eng.graphs = CudaGraphs(eng, capture=False)
        got = eng.graphs.first_tokens(b0, k, h, redraw, MAX_EMPTY_RETRIES)
        assert set(eng.graphs.graphs) == {("first", 4, MAX_EMPTY_RETRIES)} and got.shape == (4,)
        assert torch.equal(got[:k], want[0])
        assert torch.equal(eng.tokens[: b0 + k], want[1][: b0 + k])
        assert torch.equal(eng.hiddens[: b0 + k], want[2][: b0 + k])
        assert torch.equal(eng.row_params.ints, want[3]) and torch.equal(eng.row_params.floats, want[4])
        attempts = eng.row_params.attempt[b0 : b0 + k].tolist()
        assert attempts[0] >= 1 and attempts[1] == MAX_EMPTY_RETRIES - 1 and attempts[2] == 0  # redrawn, all, none
        assert eng.graphs.first_tokens(5, 3, h, redraw, MAX_EMPTY_RETRIES) is None  # slots 5..8: past the last


@OVERLAP
def test_a_request_whose_every_first_draw_ends_it_ends_at_once_and_its_batchmates_as_alone(tiny, overlap):
    """Its EOS set to its greedy first token: all redraws end it too, so it ends with no tokens (reason eos), with
    overlap read back one step late, while requests admitted with it run as they would alone."""
    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, start=False, overlap=overlap)
    ids = torch.arange(3, 20)
    probe = drive(eng, [dict(ids=ids, params=greedy(5, 0))])[0].result
    specs = [dict(ids=torch.arange(40, 60), params=greedy(30, 10, seed=3)),
             dict(ids=ids, params=greedy(5, 0), eos=int(probe.tokens[0, 0])),
             dict(ids=torch.arange(7, 30), params=greedy(25, 0, seed=4), every=4)]
    alone = [drive(eng, [s])[0] for s in specs]
    together = drive(eng, specs)
    assert together[1].result.finish_reason == "eos" and together[1].result.steps == 0
    for a, b in zip(alone, together, strict=True):
        assert a.result.finish_reason == b.result.finish_reason
        assert (a.result.tokens is None) == (b.result.tokens is None)
        if a.result.tokens is not None and a.result.tokens.numel():
            assert torch.equal(a.result.tokens, b.result.tokens)
        assert [c.tolist() for c in a.chunks] == [c.tolist() for c in b.chunks]


def test_rows_finishing_together_are_copied_to_the_host_per_kind_not_per_result(tiny):
    """Rows that finish at one step (codes with hidden states, codes without, refine text, one cancelled) get
    their results from one gathered copy per kind (`_finished_results`), each result its own row's tokens and
    hidden states: what each gets alone."""
    arch, _, _, ours = tiny
    g = torch.Generator().manual_seed(11)

    def specs():
        out = [dict(ids=torch.randint(0, 21000, (5 + 3 * i,), generator=g), params=SamplingParams(
            0.3, 0.7, 20, 1.05, 16, 16, seed=40 + i)) for i in range(7)]
        out[2]["want_hidden"] = False
        out[4].update(mode="text", eos=21140)
        out[5].update(every=4, cancel_after=8)
        return out

    batch = specs()
    for s in batch:
        s["ids"] = s["ids"].clone()
    eng = make_engine(ours, arch, max_slots=8, start=False)
    copies = []
    d2h = eng._d2h

    def counted(t):
        copies.append(tuple(t.shape))
        return d2h(t)

    eng._d2h = counted
    got = drive(eng, batch)
    finishing = [c for c in copies if len(c) >= 2 and c[0] > 1]  # gathered [rows, frames, ...] copies
    assert finishing, "no gathered copy"
    assert len(copies) <= 12  # chunks of the streamed row, then a handful per finish, not two per result
    for i, rec in enumerate(got):
        alone_eng = make_engine(ours, arch, max_slots=8, start=False)
        (alone,) = drive(alone_eng, [batch[i]])
        check_same_as_alone([alone], [rec])
        if rec.result.tokens is not None:
            assert rec.result.tokens.is_contiguous() and len(rec.result.tokens) == rec.result.steps
            assert (rec.result.hiddens is None) == (i in (2, 4))


def test_prompt_inputs_of_other_dtypes_give_the_tokens_of_int64_ids_and_a_float32_speaker(tiny):
    """The admission builds its inputs in numpy (`Runner._prompt_rows`): int32 text ids and audio codes, a bfloat16
    speaker embedding (numpy has none) and a non-contiguous id tensor are taken as int64 and float, so a prompt
    gets what it gets from int64 ids and a float32 embedding."""
    arch, _, _, ours = tiny
    g = torch.Generator().manual_seed(5)
    ids = torch.cat([torch.randint(0, 21000, (4,), generator=g), torch.tensor([21143]),
                     torch.randint(0, 21000, (9,), generator=g)])
    spk = torch.randn(arch.gpt.hidden, generator=g).bfloat16().float()  # exactly representable in bfloat16
    codes = torch.randint(0, 625, (5, arch.num_vq), generator=g)
    params = SamplingParams(0.3, 0.7, 20, 1.05, 10, 10, seed=8)

    def run(ids, spk, codes):
        eng = make_engine(ours, arch, start=False, decode_kernel=True, packed_prefill=True)
        (rec,) = drive(eng, [dict(ids=ids, params=params, spk_emb=spk, spk_emb_id=21143, audio_codes=codes)])
        return rec.result.tokens

    want = run(ids, spk, codes)
    strided = torch.stack([ids.int(), ids.int()], 1)[:, 0]  # int32, stride 2
    assert not strided.is_contiguous()
    assert torch.equal(run(strided, spk.bfloat16(), codes.int()), want)
