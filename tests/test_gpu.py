"""GPU checks (run on the GPU host: `pytest -m gpu`; CI has no GPU and skips them)."""

from __future__ import annotations

import queue
import sys
import threading
import time
import warnings
from unittest import mock

import pytest
import torch

from chattts_triton.model.assets import infer_arch
from chattts_triton.model.gpt import load_gpt
from chattts_triton.runtime.engine import Engine, GenRequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(model, arch, graphs, dtype=torch.float32, slots=8, max_context=512, max_new_tokens=200, cache_dtype=None,
            **kw):
    if kw.get("compile_step"):
        # one compiled engine per process, as served: dynamo's caches from an earlier test's engine
        # make a second one fail its guards (torch 2.11: "sources must not be empty for symbol")
        torch._dynamo.reset()
    return Engine(model, max_slots=slots, max_context=max_context, max_new_tokens=max_new_tokens,
                  hidden=arch.gpt.hidden,
                  num_vq=arch.num_vq, device="cuda", cache_dtype=cache_dtype or dtype, compute_dtype=dtype,
                  cuda_graphs=graphs, **kw)


def _without_a_host_sync(fn, *args):
    """fn(*args) under CUDA's sync debug mode: its result, asserting that it made no synchronizing call."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert not [x for x in w if "called a synchronizing" in str(x.message)]
    return out


@pytest.mark.parametrize("compiled", [False, True, "prefill", "packed", "gemv"])
def test_cuda_graph_engine_equals_upstream_greedy_on_gpu(full_assets, compiled):
    """TorchScript graphs, or the step compiled by inductor (`--gpt-compile`; "prefill": the prefills
    too, `--gpt-compile-prefill`; "packed": prompts prefilled packed, `--gpt-packed-prefill`; "gemv": each request
    alone, so every step of one row with its projections as inductor's reductions, `--gpt-gemv`), against upstream."""
    from tests.engine_util import upstream_generate, upstream_gpt

    arch, emb, g = upstream_gpt(full_assets)
    emb, g = emb.cuda(), g.cuda()
    g.device = g.device_gpt = torch.device("cuda")
    model = load_gpt(full_assets, arch).cuda()
    eng = _engine(model if compiled else torch.jit.script(model), arch, graphs=True, compile_step=bool(compiled),
                  compile_prefill=compiled == "prefill", packed_prefill=compiled == "packed", gemv=compiled == "gemv")
    gen = torch.Generator().manual_seed(11)  # the same prompts whatever ran before
    try:
        if compiled:
            eng.warm_up()
            assert (eng.graph_prefill is not None) == (compiled == "prefill")  # compiled, no fallback
        for i, (n, m) in enumerate([(100, 50), (37, 0)]):
            ids = torch.randint(0, 21000, (20 + 7 * i,), generator=gen)
            up_ids, up_h = upstream_generate(emb, g, ids.cuda(), n, m)
            r = eng.generate(GenRequest(text_ids=ids, params=SamplingParams(1e-5, 0.7, 20, 1.05, n, m, seed=0),
                                        on_done=None))
            assert torch.equal(r.tokens.cpu(), up_ids.cpu())
            assert (r.hiddens - up_h.cpu()).abs().max().item() <= 1e-3
        assert compiled != "prefill" or eng.graph_prefill is not None
    finally:
        eng.stop()


@pytest.mark.parametrize("dtype,compiled", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_request_alone_equals_request_in_a_graphed_batch(full_assets, dtype, compiled):
    arch = infer_arch(full_assets)
    model = load_gpt(full_assets, arch).to(dtype).cuda()
    prompts = [torch.randint(0, 21000, (5 + 3 * i,)) for i in range(12)]
    params = [SamplingParams(0.3, 0.7, 20, 1.05, 40 + 5 * i, 10, seed=i) for i in range(12)]
    eng = _engine(model if compiled else torch.jit.script(model), arch, True, dtype, slots=16, compile_step=compiled)
    try:
        if compiled:
            eng.warm_up()
        alone = [eng.generate(GenRequest(prompts[i], params[i], None)) for i in range(12)]
        batched = [None] * 12
        threads = [threading.Thread(
                       target=lambda i=i: batched.__setitem__(i, eng.generate(GenRequest(prompts[i], params[i], None))))
                   for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        eng.stop()
    same = sum(torch.equal(a.tokens, b.tokens) for a, b in zip(alone, batched, strict=True))
    first_diff = [next((k for k in range(min(len(a.tokens), len(b.tokens)))
                        if not torch.equal(a.tokens[k], b.tokens[k])), None)
                  for a, b in zip(alone, batched, strict=True)]
    print(f"{dtype} compiled={compiled}: {same}/12 requests identical alone vs in a batch of 12; first differing step: "
          f"{first_diff}")
    if dtype == torch.float32:
        assert same == 12


def test_compaction_graph_buckets_streaming_and_text_rows_equal_alone_on_gpu(tiny_assets):
    """The CPU scenario (finish orders, a cancel from a stream callback, joins, a refine-text row)
    with captured graphs: padding rows, warm-ups over live rows and compaction change nothing."""
    from tests.engine_util import check_same_as_alone, drive, instrument, scenario_specs

    arch = infer_arch(tiny_assets)
    model = torch.jit.script(load_gpt(tiny_assets, arch).cuda())
    eng = _engine(model, arch, True, start=False)
    specs = scenario_specs()
    alone = [drive(eng, [s])[0] for s in specs]
    seen = instrument(eng)
    batched = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2])
    check_same_as_alone(alone, batched, hidden_atol=1e-4)
    assert seen["moves"] >= 3 and "mixed" in seen["modes"]
    assert any(v is not None for v in eng.graphs.graphs.values())


@pytest.mark.parametrize("scripted", [True, False])  # False: the eager module a compiled-step engine holds
def test_graphed_prefill_equals_the_eager_prefill_without_a_sync(full_assets, scripted):
    """A prefill replayed from its bucket's graph (any slots and pages: they are inputs) computes exactly what
    the same padded prefill computes eagerly, cache writes included, and adds no host sync. Under
    inference mode, as on the engine's thread; the eager reference runs after the capture's warm-up
    runs, so a scripted model's JIT executor has settled on the plan the graph holds."""
    arch = infer_arch(full_assets)
    model = load_gpt(full_assets, arch).cuda()
    eng = _engine(torch.jit.script(model) if scripted else model, arch, True, slots=8, start=False)
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(0.3, 0.7, 20, 1.05, 20, 20, seed=0)

    def fresh_cache() -> None:
        for c in (eng.k_cache, eng.v_cache):
            c.zero_()

    def cache() -> list:
        return [c[:, 1:].clone() for c in (eng.k_cache, eng.v_cache)]  # all but the scratch page padding writes

    with torch.inference_mode():
        for b0, lens in ((2, (7, 20, 13)), (5, (30,)), (1, (9, 17, 3))):  # the first and last share a bucket
            reqs = [GenRequest(torch.randint(0, 21000, (n,), generator=g), params, None) for n in lens]
            for i in range(eng.max_slots):
                eng._release(i)
            for i, n in enumerate(lens):  # pages as admission grants them
                eng._grant(b0 + i, -(-n // eng.page))
            eng._sync_tables()
            kb, tb = eng.graphs.prefill_buckets(len(reqs), max(lens))
            fresh_cache()
            first = eng.graphs.prefill(b0, reqs)[: len(reqs)].clone()  # captured now if new
            cache_first = cache()
            fresh_cache()
            eager = eng.prefill_core(*eng._prompt_batch(reqs, kb, tb, b0))[: len(reqs)].clone()
            cache_eager = cache()
            fresh_cache()
            again = _without_a_host_sync(eng.graphs.prefill, b0, reqs)[: len(reqs)]
            assert eng.graphs.graphs[("prefill", kb, tb)] is not None
            assert torch.equal(first, eager) and torch.equal(again, eager)
            assert all(torch.equal(a, e) for a, e in zip(cache_first, cache_eager, strict=True))
            assert all(torch.equal(a, e) for a, e in zip(cache(), cache_eager, strict=True))
    assert len([k for k in eng.graphs.graphs if k[0] == "prefill"]) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_prefill_from_its_graph_equals_it_eager_and_the_padded_prefill(full_assets, dtype):
    """Prompts packed end to end (`Engine.packed_prefill`, each position a row of the decode kernel): replayed from
    its token bucket's graph it computes exactly what it computes eagerly, cache writes included, with no host
    sync; against the padded prefill (dense attention over the padded batch) its last hidden states and cache
    writes agree to the dtype's rounding."""
    arch = infer_arch(full_assets)
    model = load_gpt(full_assets, arch).to(dtype).cuda()
    eng = _engine(model, arch, True, dtype, slots=8, start=False, packed_prefill=True)
    assert eng.packed_prefill and eng.decode_kernel
    g = torch.Generator().manual_seed(6)
    params = SamplingParams(0.3, 0.7, 20, 1.05, 20, 20, seed=0)
    tol = 1e-4 if dtype == torch.float32 else 6e-2

    def cache() -> list:
        return [c[:, 1:].clone() for c in (eng.k_cache, eng.v_cache)]  # all but the scratch page

    def fresh_cache() -> None:
        for c in (eng.k_cache, eng.v_cache):
            c.zero_()

    with torch.inference_mode():
        for b0, lens in ((2, (7, 20, 13)), (5, (30,)), (0, (116, 6, 44, 90, 3))):
            reqs = [GenRequest(torch.randint(0, 21000, (n,), generator=g), params, None) for n in lens]
            for i in range(eng.max_slots):
                eng._release(i)
            for i, n in enumerate(lens):
                eng._grant(b0 + i, -(-n // eng.page))
            eng._sync_tables()
            tb = eng.graphs.packed_bucket(sum(lens))
            fresh_cache()
            first = eng.graphs.prefill_packed(b0, reqs).clone()
            cache_first = cache()
            fresh_cache()
            *inputs, last = eng._packed_batch(reqs, tb, b0)  # the graph's shape: the same GEMM kernels
            eager = eng.prefill_core(*inputs).index_select(0, last)
            cache_eager = cache()
            fresh_cache()
            kb, tpad = eng.graphs.prefill_buckets(len(reqs), max(lens))
            padded = eng.prefill_core(*eng._prompt_batch(reqs, kb, tpad, b0))[: len(reqs)]
            cache_padded = cache()
            fresh_cache()
            again = _without_a_host_sync(eng.graphs.prefill_packed, b0, reqs)
            assert eng.graphs.graphs[("packed", tb)] is not None
            assert first.shape == (len(reqs), arch.gpt.hidden)
            assert torch.equal(first, eager) and torch.equal(again, eager)
            assert all(torch.equal(a, e) for a, e in zip(cache_first, cache_eager, strict=True))
            assert all(torch.equal(a, e) for a, e in zip(cache(), cache_eager, strict=True))
            scale = padded.abs().max().item()
            assert (eager - padded).abs().max().item() <= tol * scale
            for a, p in zip(cache_eager, cache_padded, strict=True):
                assert (a.float() - p.float()).abs().max().item() <= tol * max(p.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("codec_compile", [0, 1])
def test_codec_graphs_give_the_eager_audio_on_gpu(full_repo, codec_compile):
    """The stream codec's CUDA graphs (a window's decoder + Vocos as one replay) against the same
    TorchScript run kernel by kernel: the same audio to float rounding (cuDNN may pick other kernels
    for the padded shape), and every bucket met is captured. A call of 40 items of one length is three groups
    enqueued before one wait, two of them through the same graph (its static buffers reused in stream order).
    `--codec-compile`: the graphs replay the networks through torch.compile (inductor), compiled at start-up."""
    import numpy as np

    from chattts_triton.config import VOCODER
    from chattts_triton.triton.backend import ModelContext, vocoder_service

    ctx = ModelContext.from_repo(full_repo, VOCODER, kind="GPU", vocoder_graphs=1, codec_compile=codec_compile)
    arch, voc = ctx.arch, vocoder_service(ctx)
    assert voc.graphs is not None and (voc.graph_nets[0] is not voc.decoder) == bool(codec_compile)
    warm = set(voc.graphs.graphs)  # the compiled networks' start-up calls
    g = torch.Generator().manual_seed(0)
    for sizes in ((16,), (40, 38, 24), (40, 38, 24), (150,), (100,) * 40):
        items = [(True, torch.randn(n, arch.gpt.hidden, generator=g) * 0.3) for n in sizes]
        got = voc.synthesize(items)
        graphs, voc.graphs = voc.graphs, None
        try:
            want = voc.synthesize(items)
        finally:
            voc.graphs = graphs
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())
    assert set(voc.graphs.graphs) - warm == {("decoder", 1, 16), ("decoder", 4, 64), ("decoder", 1, 160),
                                             ("decoder", 16, 128), ("decoder", 8, 128)} - warm
    assert bool(warm) == bool(codec_compile)
    assert all(v is not None for v in voc.graphs.graphs.values())


def test_to_host_copies_through_pinned_memory():
    from chattts_triton.runtime.graphs import to_host

    t = torch.randn(5, 7, device="cuda") * 3
    host = to_host(t)
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, t.cpu())


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_step_syncs_the_host_once(full_assets, overlap):
    """Steady state with graphs, streaming consumers, a request finishing (compaction) and one admitted: exactly
    one synchronizing CUDA call per decode step and one for the admission's first tokens without overlap; with
    it, none: each step's flags are waited for after the next step's launch (the step before it), and the
    admission's first tokens' flags after the launch of the step that runs them too."""
    arch = infer_arch(full_assets)
    model = torch.jit.script(load_gpt(full_assets, arch).cuda())
    eng = _engine(model, arch, True, slots=8, start=False, overlap=overlap)
    got = []
    for i in range(6):
        n = 28 if i == 0 else 60  # slot 0 finishes inside the counted steps: the last slot moves into it
        eng.submit(GenRequest(torch.randint(0, 21000, (20,)), SamplingParams(0.3, 0.7, 20, 1.05, n, n, seed=i),
                              got.append,
                              on_tokens=(lambda t, h: None) if i % 2 else None, stream_every=1 + i))
    for _ in range(20):  # admission, graph capture
        eng._run_once(block=False)

    def admit_one(seed):
        eng.submit(GenRequest(torch.randint(0, 21000, (20,)), SamplingParams(0.3, 0.7, 20, 1.05, 60, 60, seed=seed),
                              got.append))

    admit_one(10)  # captures the one-prompt prefill's graph (a capture synchronises) before the count
    while eng.pending:
        eng._run_once(block=False)
    torch.cuda.synchronize()
    eng._results = queue.SimpleQueue()  # finished results wait for a consumer thread, as when started
    landed = []  # overlap: the step's host wait is on the event after its flags' copy, in _land
    wait = torch.cuda.Event.synchronize

    def counted(event):
        if sys._getframe(1).f_code.co_name == "_land":
            landed.append(event)
        return wait(event)

    with warnings.catch_warnings(record=True) as w, mock.patch.object(torch.cuda.Event, "synchronize", counted):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            admit_one(11)
            for _ in range(10):
                eng._run_once(block=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    (req, res), = [eng._results.get_nowait() for _ in range(eng._results.qsize())]
    eng._call(req, res)  # what the results thread does: wait for the result's copies, then deliver
    assert len(got) == 1 and eng.active == 7 and not eng.pending
    assert got[0].tokens.device.type == "cpu" and got[0].tokens.is_pinned() and got[0].tokens.shape == (28, 4)
    syncs = [x for x in w if "called a synchronizing" in str(x.message)]  # not the "prototype feature" notice
    # without overlap the flags are read with a synchronizing copy; with it, from pinned memory after its event
    assert (len(syncs), len(landed)) == ((0, 11) if overlap else (11, 0)), [str(x.message) for x in syncs]
    eng.stop(drain=False)


def test_stream_first_chunk_leaves_while_the_utterance_is_generated_on_gpu(tiny_repo):
    """On the H200 (2026-11-30) the chunks of a lone stream left in one burst at its end; the CPU
    sends the first after its frames plus lookahead (tests/test_streaming.py). Same check on CUDA."""
    from chattts_triton.config import STREAM
    from chattts_triton.triton.backend import ModelContext, stream_service
    from tests.test_streaming import first_chunk_steps

    svc = stream_service(ModelContext.from_repo(tiny_repo, STREAM, kind="GPU", stream_first_chunk_frames=4,
                                                stream_chunk_frames=8,
                                                stream_slots=4, stream_max_pending=8))
    try:
        first_chunk_steps(svc)  # warm-up: graph capture, first codec calls
        steps, frames = first_chunk_steps(svc)
        print(f"first chunk: {frames} frames, sent after {steps} engine steps of 200; counters {svc.counters}")
        assert steps < 100, f"the first chunk waited for {steps} of 200 steps"
    finally:
        svc.close()


@pytest.mark.parametrize("switch", ["stream_codec_stream", "stream_engine_priority"])
def test_stream_codec_and_engine_on_streams_of_their_own_give_the_offline_audio_on_gpu(tiny_repo, switch):
    """`--stream-codec-stream`: the codec thread launches on a CUDA stream of its own while the engine
    steps on the default one; `--stream-engine-priority`: the engine steps on a stream of the highest priority
    while the codec launches on the default one. Several streams at once still equal their non-streamed audio."""
    import numpy as np

    from chattts_triton.config import STREAM
    from chattts_triton.triton.backend import ModelContext, stream_service
    from tests.test_streaming import Recorder, contract, offline

    svc = stream_service(ModelContext.from_repo(tiny_repo, STREAM, kind="GPU", stream_first_chunk_frames=4,
                                                stream_chunk_frames=8,
                                                stream_first_lookahead_frames=0, stream_fade_frames=4, stream_slots=4,
                                                stream_max_pending=8,
                                                **{switch: 1}))
    try:
        launch = svc.gpt.engine.launch_stream
        if switch == "stream_codec_stream":
            assert svc.codec_stream is not None and launch is None
        else:
            assert svc.codec_stream is None and launch.priority == torch.cuda.Stream.priority_range()[1] < 0
        recs = [Recorder(contract(seed=40 + i, n=60 + 7 * i)) for i in range(4)]
        svc.execute([r.call for r in recs])
        for r in recs:  # all ended before the references: those use the same codec graphs on this thread
            assert r.ended.wait(120) and r.error is None and r.final == 1 and len(r.chunks) > 3
        for i, r in enumerate(recs):
            ref = offline(svc, contract(seed=40 + i, n=60 + 7 * i))
            audio = np.concatenate(r.chunks)
            assert audio.shape == ref.shape and np.abs(audio - ref).max() <= 1e-4, np.abs(audio - ref).max()
    finally:
        svc.close()


def test_warm_graphs_captures_every_decode_bucket_before_a_load_on_gpu(tiny_assets):
    """Engine.warm_graphs with real captures (the CPU test stands them in eagerly): every batch bucket
    at every attention bucket up to WARM_DECODE_LEN is captured, none failed, and a load of several
    batch sizes and prompt lengths afterwards captures no decode graph (each capture would stall the
    running requests)."""
    import time

    from chattts_triton.runtime.engine import BATCH_STEP, WARM_DECODE_LEN, bucket_sizes

    arch = infer_arch(tiny_assets)
    model = torch.jit.script(load_gpt(tiny_assets, arch).cuda())
    eng = _engine(model, arch, True, slots=40)
    try:
        t0 = time.monotonic()
        eng.warm_graphs()
        decode = {k: v for k, v in eng.graphs.graphs.items() if k[0] == "code"}
        print(f"warm_graphs: {len(eng.graphs.graphs)} graphs in {time.monotonic() - t0:.1f} s")
        assert set(decode) == {("code", bb, lb) for bb in bucket_sizes(BATCH_STEP, 40) for lb in (128, 256, 384, 512)}
        assert WARM_DECODE_LEN == 512 and all(v is not None for v in decode.values())
        done: queue.Queue = queue.Queue()
        waves = [1, 3, 20]  # requests submitted together, one wave after another
        for w, n in enumerate(waves):
            for i in range(n):
                prompt = torch.arange(1, 8 + 37 * i % 300)  # up to ≈ 300 + 150 positions: attention buckets to 512
                eng.submit(GenRequest(prompt, SamplingParams(0.3, 0.7, 20, 1.05, 150, 150, seed=100 * w + i), done.put))
            results = [done.get(timeout=600).wait() for _ in range(n)]
            assert [r.finish_reason for r in results] == ["max_tokens"] * n
        assert {k for k in eng.graphs.graphs if k[0] == "code"} == set(decode)
    finally:
        eng.stop()


def test_stream_codec_captures_nothing_after_start_up_on_gpu(tiny_repo):
    """chattts_stream's codec graphs are all captured by warm_codec: 20 streams at once, frames piling
    up behind the codec calls included (windows capped at the warmed length), add no codec graph."""
    import time

    from chattts_triton.config import STREAM
    from chattts_triton.triton.backend import ModelContext, stream_service
    from tests.test_streaming import Recorder, contract

    svc = stream_service(ModelContext.from_repo(tiny_repo, STREAM, kind="GPU", stream_first_chunk_frames=4,
                                                stream_chunk_frames=8,
                                                stream_slots=32, stream_max_pending=32))
    try:
        warmed = set(svc.voc.graphs.graphs)
        assert warmed and all(v is not None for v in svc.voc.graphs.graphs.values())
        recs = [Recorder(contract(n=60 + 7 * i, seed=i)) for i in range(20)]
        t0 = time.monotonic()
        svc.execute([r.call for r in recs])
        assert all(r.ended.wait(300) for r in recs) and all(r.error is None and r.final == 1 for r in recs)
        print(f"20 streams in {time.monotonic() - t0:.2f} s; counters {svc.counters}")
        assert set(svc.voc.graphs.graphs) == warmed, set(svc.voc.graphs.graphs) - warmed
    finally:
        svc.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_sampled_steps_are_timed_on_the_gpu_clock(tiny_assets, overlap):
    """One decode step in GPU_TIMING_EVERY is timed with CUDA events: its span on the GPU's clock is
    positive and no longer than the host's time per step (without overlap the launch-to-sync time, with it
    the whole step's wall time, as the sync waits for the step before) on average (within the jitter of 2 ms
    over 10+ samples); the graphed ones also on the events their graph records itself, a span inside the
    host-recorded one (with overlap only those whose next step replayed another graph)."""
    from chattts_triton.runtime.engine import GPU_TIMING_EVERY

    arch = infer_arch(tiny_assets)
    model = torch.jit.script(load_gpt(tiny_assets, arch).cuda())
    eng = _engine(model, arch, True, slots=8, overlap=overlap)
    try:
        done: queue.Queue = queue.Queue()

        def wave():
            for i in range(4):
                eng.submit(GenRequest(torch.arange(1, 12), SamplingParams(0.3, 0.7, 20, 1.05, 120, 120, seed=i),
                                      done.put))
            assert [done.get(timeout=300).wait().finish_reason for _ in range(4)] == ["max_tokens"] * 4

        wave()  # graph captures happen here: a sampled step holding one would dwarf the others
        eng.restart_step_gaps()
        s0 = eng.stats()
        t0 = time.perf_counter()
        wave()
        wall = time.perf_counter() - t0
        s1 = eng.stats()
        s = {k: s1[k] - s0[k] for k in ("engine_steps", "engine_step_gpu_samples", "engine_step_gpu_seconds",
                                        "engine_step_device_seconds", "engine_step_seconds",
                                        "engine_step_graph_samples",
                                        "engine_step_graph_seconds", "engine_step_gaps", "engine_step_gap_seconds")}
        # every step's gap on the GPU's clock but the wave's first (after an idle engine's admission): inside the
        # wave's wall time, and the worst of this wave at least their mean
        assert s["engine_step_gaps"] == s["engine_steps"] - 1
        assert 0 < s["engine_step_gap_seconds"] <= wall
        assert s1["engine_step_gap_max_seconds"] >= s["engine_step_gap_seconds"] / s["engine_step_gaps"]
        assert abs(s["engine_step_gpu_samples"] - s["engine_steps"] / GPU_TIMING_EVERY) <= 1
        assert s["engine_step_gpu_samples"] >= 10
        gpu_ms = 1000 * s["engine_step_gpu_seconds"] / s["engine_step_gpu_samples"]
        device_ms = 1000 * s["engine_step_device_seconds" if not overlap else "engine_step_seconds"] / s["engine_steps"]
        # every step of the timed wave ran from a captured graph: without overlap each sample has its graph's own
        # span; with it, only a step whose successor replayed another graph (the same graph's next replay, launched
        # before the step is read, re-records its events), so at a steady batch few or none
        if overlap:
            assert s["engine_step_graph_samples"] <= s["engine_step_gpu_samples"]
        else:
            assert s["engine_step_graph_samples"] == s["engine_step_gpu_samples"]
        graph_ms = 1000 * s["engine_step_graph_seconds"] / max(1, s["engine_step_graph_samples"])
        print(f"step: device {device_ms:.3f} ms, GPU clock {gpu_ms:.3f} ms, graph {graph_ms:.3f} ms "
              f"({s['engine_step_graph_samples']} of {s['engine_step_gpu_samples']} samples)")
        assert 0 < gpu_ms <= device_ms + 2.0
        if s["engine_step_graph_samples"]:
            assert 0 < graph_ms <= gpu_ms
    finally:
        eng.stop()


@pytest.mark.parametrize("dtype,kv_heads,kv", [(torch.float32, 12, None), (torch.bfloat16, 12, None),
                                               (torch.float16, 12, None), (torch.float32, 4, None),
                                               (torch.bfloat16, 12, torch.float8_e4m3fn)])
def test_decode_kernel_reads_each_rows_own_keys_as_the_reference_does(dtype, kv_heads, kv):
    """The Triton decode attention against `attention.reference` on the page pool as the model passes it
    (one layer; block table rows from an offset, pages in shuffled order), lengths 1..context incl. block and
    page edges, grouped heads (12 query heads on 4 key/value heads), and CUDA graph replays that read the
    lengths and block tables of their time; from a cache of the queries' dtype and from an fp8 one
    (kv_cache_dtype fp8, its own keys a loop)."""
    from chattts_triton.config import KV_PAGE_TOKENS as page
    from chattts_triton.model.attention import (
        block_keys,
        decode_attention,
        kernel_available,
        launch_layout,
        reference,
        run_kernel,
    )

    assert kernel_available(torch.device("cuda"), 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    layers, rows, width, heads, d = 3, 40, 19, 12, 64
    context = width * page  # 304 positions a row
    pages = rows * width + 1
    cache = torch.randn(2, layers, pages, page, kv_heads, d, device="cuda", generator=g).to(kv or dtype)
    all_tables = (torch.randperm(pages - 1, device="cuda", generator=g) + 1).view(rows, width)
    b, start = 33, 5
    tables = all_tables.narrow(0, start, b)
    keys, values = cache[0, 1], cache[1, 1]
    q = torch.randn(b, heads, d, device="cuda", generator=g).to(dtype)
    lengths = torch.randint(1, context + 1, (b,), device="cuda", generator=g)
    blk = block_keys(keys.dtype)
    lengths[:8] = torch.tensor([1, blk, blk + 1, context, 2 * blk, context - 1, page, page + 1])
    want = reference(q, keys, values, tables, lengths).float()
    got = decode_attention(q, keys, values, tables, lengths)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # half precision: the output's rounding
    assert got.dtype == dtype and (got.float() - want).abs().max().item() <= tol
    assert launch_layout(b, heads) > 1  # these rows split their keys; the layout of many rows too:
    for splits in (1, 2):
        whole = run_kernel(q, keys, values, tables, lengths, splits=splits)
        assert (whole.float() - want).abs().max().item() <= tol, splits
    # past row 0's one key: never read (fp8: the bytes of e4m3's largest value, 448, since a cast makes NaN of 1e4,
    # which the replays below, reading every key, would compare as NaN)
    poison = keys.view(torch.uint8) if kv else keys
    poison[tables[0, 1:]] = 0x7E if kv else 1e4
    poison[tables[0, 0], 1:] = 0x7E if kv else 1e4
    assert torch.equal(decode_attention(q, keys, values, tables, lengths)[0], got[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, keys, values, tables, lengths)
    lengths.fill_(context)  # a replay reads the lengths of its time
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - reference(q, keys, values, tables, lengths).float()).abs().max().item() <= tol
    tables.copy_(all_tables.narrow(0, 0, b).clone())  # ... and the block tables of its time
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - reference(q, keys, values, tables, lengths).float()).abs().max().item() <= tol


def test_suspended_requests_resume_exactly_with_captured_graphs_on_gpu(tiny_assets):
    """The CPU suspension scenario with captured graphs: a pool of the smallest size, requests suspended
    to the host and resumed, each equal to alone."""
    from tests.engine_util import assert_pool_whole, check_same_as_alone, drive, scenario_specs

    arch = infer_arch(tiny_assets)
    model = torch.jit.script(load_gpt(tiny_assets, arch).cuda())
    specs = scenario_specs()
    alone = [drive(_engine(model, arch, True, start=False), [s])[0] for s in specs]
    longest = max(len(s["ids"]) + s["params"].max_new_tokens for s in specs)
    eng = _engine(model, arch, True, start=False, max_context=longest, cache_tokens=longest)
    batched = drive(eng, specs, join=[0, 0, 0, 0, 0, 3, 3, 9, 14, 2])
    check_same_as_alone(alone, batched, hidden_atol=1e-4)
    print(f"suspended {eng.counters.preemptions}, resumed {eng.counters.resumes}")
    assert eng.counters.preemptions >= 3 and eng.counters.resumes == eng.counters.preemptions
    assert_pool_whole(eng)


HALF_BOUNDS = {torch.bfloat16: 6e-2, torch.float16: 1e-2}  # hidden states' relative error, 2x the CPU prefill bounds


@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, None), (torch.float16, None),
                                      (torch.bfloat16, torch.float8_e4m3fn)])
def test_half_precision_engine_stays_finite_and_near_upstream_over_a_long_utterance(full_assets, dtype, kv):
    """The served path (compiled step, CUDA graphs, decode kernel) in bf16 and fp16 (cards before Ampere
    have no bf16), and bf16 with an fp8 cache (kv_cache_dtype fp8, held to bf16's bound), over a 1900-frame
    utterance: every hidden state finite, and near upstream fp32 fed the same tokens (teacher-forced); prints the
    error by stretch and the engine's frames/s."""
    import time

    from tests.engine_util import upstream_gpt

    arch, emb, g = upstream_gpt(full_assets)
    emb, g = emb.cuda(), g.cuda()
    model = load_gpt(full_assets, arch).to(dtype).cuda()
    n = 1900
    eng = _engine(model, arch, True, dtype, max_context=2048, max_new_tokens=n, compile_step=True, cache_dtype=kv)
    try:
        eng.warm_up()
        assert eng.k_cache.dtype == (kv or dtype)
        ids = torch.randint(0, 21000, (60,), generator=torch.Generator().manual_seed(4))
        t0 = time.perf_counter()
        r = eng.generate(GenRequest(ids, SamplingParams(0.3, 0.7, 20, 1.05, n, n, seed=3), None))
        took = time.perf_counter() - t0
    finally:
        eng.stop()
    h = r.hiddens.float().cuda()
    assert r.tokens.shape == (n, 4) and torch.isfinite(h).all()
    with torch.no_grad():
        codes = r.tokens[:-1].cuda()  # what the engine fed after the prompt
        x = torch.cat([emb.emb_text(ids.cuda()), sum(emb.emb_code[i](codes[:, i]) for i in range(4))]).unsqueeze(0)
        ref = g.gpt(inputs_embeds=x, use_cache=False).last_hidden_state[0, len(ids) - 1 :].float()
    assert ref.shape == h.shape
    errs = [((h[a:a + 100] - ref[a:a + 100]).norm() / ref[a:a + 100].norm()).item() for a in range(0, n, 100)]
    print(f"{dtype}, cache {kv or dtype}: {n / took:.0f} frames/s alone; relative error of the hidden states per "
          "100 frames: "
          f"{' '.join(f'{e:.1e}' for e in errs)}; max |h| {h.abs().max().item():.1f}")
    assert max(errs) <= HALF_BOUNDS[dtype], errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_equal_the_reference_on_the_served_shapes_plainly_as_dependents_and_from_a_graph(dtype):
    """`rowops.row_matvec` on the GPU, each of the layer's four products on the served shapes: equal to
    `rowops.reference` to a sum's order (fp32) or a few roundings (bf16), launched plainly and as
    programmatic dependents; a chain of the four, the first reading the previous layer's result, captured in a CUDA
    graph with dependent launches gives the eager chain's numbers, for inputs written after the capture."""
    from chattts_triton.config import Arch
    from chattts_triton.model import rowops

    assert rowops.kernel_available(torch.device("cuda"))
    d = Arch().gpt
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    qkv_n = (d.heads + 2 * d.kv_heads) * d.head_dim
    w = {"qkv": rand(qkv_n, d.hidden, scale=d.hidden ** -0.5), "o": rand(d.hidden, d.hidden, scale=d.hidden ** -0.5),
         "gate_up": rand(2 * d.intermediate, d.hidden, scale=d.hidden ** -0.5),
         "down": rand(d.hidden, d.intermediate, scale=d.intermediate ** -0.5)}
    n1, n2 = rand(d.hidden).abs() + 0.5, rand(d.hidden).abs() + 0.5
    eps = d.rms_eps
    # relative to the largest value; bf16: a few of its steps, as the roundings of four products compound
    tol = 1e-4 if dtype == torch.float32 else 2 ** -4

    def chain(x, attn, run):
        qkv = run(x, w["qkv"], n1, None, eps, False)
        h = run(attn, w["o"], None, x, 0.0, False)
        act = run(h, w["gate_up"], n2, None, eps, True)
        return qkv, run(act, w["down"], None, h, 0.0, False)

    x, attn = rand(d.hidden), rand(d.hidden)
    want = chain(x, attn, rowops.reference)
    for pdl in (False, True):
        got = chain(x, attn, lambda *a, pdl=pdl: rowops.run_kernel(*a, pdl=pdl))
        for a, b in zip(got, want, strict=True):
            assert a.dtype == dtype and a.shape == b.shape
            assert (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item(), pdl
    xs, ats = x.clone(), attn.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(xs, ats, lambda *a: rowops.run_kernel(*a, pdl=True))
    x2, a2 = rand(d.hidden), rand(d.hidden)
    xs.copy_(x2)
    ats.copy_(a2)
    graph.replay()
    torch.cuda.synchronize()
    eager = chain(x2, a2, lambda *a: rowops.run_kernel(*a, pdl=True))
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))
