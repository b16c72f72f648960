"""Decode attention over each row's own keys (`chattts_triton.model.attention`): the PyTorch reference here,
the Triton kernel in tests/test_gpu.py."""

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chattts_triton.model.attention import decode_attention, kernel_available, reference
from chattts_triton.runtime.engine import Engine, EngineError
from tests.engine_util import (
    assert_served_without_a_new_decode_graph,
    check_same_as_alone,
    drive,
    make_engine,
    scenario_specs,
)


def paged(dense: torch.Tensor, g: torch.Generator, page: int = 8, spare: int = 3):
    """Rows' keys [B, C, KVH, D] laid out in a page pool in shuffled order (and `spare` pages no row holds,
    filled with noise): (pool [pages, page, KVH, D], tables [B, C / page])."""
    b, c = dense.shape[:2]
    n = b * c // page
    order = torch.randperm(n + spare, generator=g)
    pool = torch.randn((n + spare, page) + tuple(dense.shape[2:]), generator=g)
    pool[order[:n]] = dense.reshape((n, page) + tuple(dense.shape[2:]))
    return pool, order[:n].view(b, c // page)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_reference_equals_sdpa_with_the_causal_mask_of_each_row(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    b, c, d = 6, 40, 16
    q = torch.randn(b, heads, d, generator=g)
    keys, values = torch.randn(b, c, kv_heads, d, generator=g), torch.randn(b, c, kv_heads, d, generator=g)
    lengths = torch.tensor([1, 40, 17, 2, 33, 39])
    mask = torch.where(torch.arange(c).view(1, 1, 1, c) < lengths.view(b, 1, 1, 1), 0.0, float("-inf"))
    rep = heads // kv_heads
    dense = F.scaled_dot_product_attention(q.unsqueeze(2), keys.repeat_interleave(rep, 2).transpose(1, 2),
                                           values.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=mask)[:, :, 0]
    kpool, tables = paged(keys, torch.Generator().manual_seed(1))
    vpool, tables_v = paged(values, torch.Generator().manual_seed(1))
    assert torch.equal(tables, tables_v)
    got = reference(q, kpool, vpool, tables, lengths)
    assert (got - dense).abs().max() <= 1e-5
    assert torch.equal(decode_attention(q, kpool, vpool, tables, lengths), got)  # no kernel on a CPU
    # keys past a row's length do not matter
    kpool2 = kpool.clone()
    kpool2[tables[0]] = 1e4
    kpool2[tables[0, 0], 0] = kpool[tables[0, 0], 0]  # row 0 attends one key
    assert torch.equal(reference(q, kpool2, vpool, tables, lengths)[0], got[0])


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_the_operator_stays_opaque_to_torch_compile_so_the_kernel_launches_with_real_strides(monkeypatch):
    """Under torch.compile (inductor) with dynamic shapes, a step calling `decode_attention` launches
    `chattts_triton::decode_attention` at run time (inductor does not trace into it: as a traced user
    kernel it got symbolic strides and ran 2.7× slower on the H200), on the cache's own memory as the
    model passes it, for each batch size. The kernel is stood in for by the reference on a CPU."""
    import chattts_triton.model.attention as attention

    calls = []

    def counting(q, keys, values, tables, lengths):
        calls.append((tuple(q.shape), keys.data_ptr()))
        return reference(q, keys, values, tables, lengths).contiguous()

    monkeypatch.setattr(attention, "kernel_available", lambda device, head_dim: True)  # as on a GPU
    monkeypatch.setattr(attention, "run_kernel", counting)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 30, 8, 2, 16, generator=g)  # [layer, page, place, kv head, dim]
    all_tables = torch.randperm(30, generator=g)[:25].view(5, 5)

    def step(q, cache, tables, lengths):
        keys = cache.select(0, 1)
        return attention.decode_attention(q * 2, keys, keys * 0.5, tables, lengths) + 1

    compiled = torch.compile(step, dynamic=True, backend="inductor")
    for b in (3, 4, 5):
        q = torch.randn(b, 4, 16, generator=g)
        lengths = torch.randint(1, 41, (b,), generator=g)
        tables = all_tables[:b]
        keys = cache.select(0, 1)
        want = reference(q * 2, keys, keys * 0.5, tables, lengths) + 1
        n = len(calls)
        got = compiled(q, cache, tables, lengths)
        assert len(calls) == n + 1 and calls[-1][0] == (b, 4, 16)  # launched by the compiled code, per call
        assert calls[-1][1] == cache[1].data_ptr()  # the cache itself, not a copy of its pages
        assert (got - want).abs().max() <= 1e-5


_INTERPRETED_KERNEL = """
import json, torch
from unittest import mock
from chattts_triton.model import attention as A
g = torch.Generator().manual_seed(0)
b, h, kvh, d, page, width = 5, 4, 2, 16, 16, 10
keys, values = torch.randn(60, page, kvh, d, generator=g), torch.randn(60, page, kvh, d, generator=g)
keys, values = keys.to(getattr(torch, CACHE)), values.to(getattr(torch, CACHE))
tables = torch.randperm(59, generator=g)[: b * width].view(b, width) + 1
lengths = torch.tensor([1, page, page + 1, 100, width * page])
q = torch.randn(b, h, d, generator=g)
want = A.reference(q, keys, values, tables, lengths)
out = {}
with mock.patch.object(A, "kernel_available", lambda *a: True):  # the interpreter runs it on the CPU's tensors
    for splits in (1, 2, A.SPLITS):
        got = A.run_kernel(q, keys, values, tables, lengths, splits=splits)
        out[splits] = [(got - want).abs().max().item(), list(got.shape)]
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("cache", ["float32", "float8_e4m3fn"])
def test_the_kernel_in_triton_s_interpreter_equals_the_reference_whole_and_split(cache):
    """The Triton kernel itself (not its stand-in), run by Triton's CPU interpreter: one program per row and
    head, and a row's keys split over 2 and `SPLITS` programs merged by the second kernel, on grouped heads,
    rows of 1 key, of a page, a page and one, and the table's full width (splits past a short row find no key);
    from an fp32 cache and from an fp8 one (kv_cache_dtype fp8: the kernel converts e4m3 as it loads)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", f"CACHE = {cache!r}\n" + _INTERPRETED_KERNEL], capture_output=True,
                         text=True, env=env, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"1", "2"} < set(got)  # and SPLITS
    for splits, (err, shape) in got.items():
        assert shape == [5, 4, 16], splits
        assert err <= 1e-5, (splits, err)


def test_the_kernel_is_for_gpus_with_power_of_two_heads():
    assert not kernel_available(torch.device("cpu"), 64)
    assert not kernel_available(torch.device("cuda"), 48)


@pytest.mark.parametrize("graphs", ["eager", "buckets"])
def test_decode_steps_through_each_rows_own_keys_equal_the_masked_dense_steps(tiny, graphs):
    """The engine's decode steps with `decode_kernel` (reference on a CPU: rows at many positions,
    padding rows, compaction, a refine-text row, streaming) give what the masked SDPA steps give."""
    arch, _, _, ours = tiny
    runs = []
    for kernel in (False, True):
        eng = make_engine(ours, arch, max_slots=8, start=False, cuda_graphs=graphs == "buckets", decode_kernel=kernel)
        assert ours.decode_kernel is kernel
        try:
            runs.append(drive(eng, scenario_specs(), join=[0, 0, 3, 3, 3, 9, 9, 20, 20, 31]))
        finally:
            eng.stop()
            ours.decode_kernel = False
    check_same_as_alone(*runs)


def test_with_the_decode_kernel_one_graph_per_batch_bucket_serves_every_attention_length(tiny):
    """Rows read their own keys whatever the step's attention length: warm_graphs captures one decode
    graph per batch bucket, and a request attending past WARM_DECODE_LEN (a new length bucket for the
    dense step) captures nothing more and gets the tokens of a plain engine (graphs standing in eagerly)."""
    from chattts_triton.runtime.engine import (
        BATCH_STEP,
        LEN_STEP,
        WARM_DECODE_LEN,
        CudaGraphs,
        GenRequest,
        SamplingParams,
        bucket_sizes,
    )

    arch, _, _, ours = tiny
    g = torch.Generator().manual_seed(3)
    reqs = [GenRequest(torch.randint(0, 21000, (90,), generator=g),
                       SamplingParams(0.3, 0.7, 20, 1.05, 460, 460, seed=1), None),
            GenRequest(torch.randint(0, 21000, (7,), generator=g),
                       SamplingParams(0.3, 0.7, 20, 1.05, 40, 40, seed=2), None)]
    assert 90 + 460 > WARM_DECODE_LEN
    plain = make_engine(ours, arch, max_slots=40, max_context=640, max_new_tokens=500, cuda_graphs=False,
                        decode_kernel=False)
    try:
        want = [plain.generate(r) for r in reqs]
    finally:
        plain.stop()
    eng = make_engine(ours, arch, max_slots=40, max_context=640, max_new_tokens=500, decode_kernel=True)
    try:
        eng.graphs = CudaGraphs(eng, capture=False)
        # decode graphs only: prefill and first-token buckets are warm_graphs' own tests' (test_engine.py), and
        # their eager stand-ins of up to 40 prompts took minutes of this test on a CPU
        eng.prefill_graphs = False
        assert eng.graphs.buckets(3, 5) == eng.graphs.buckets(3, 600) == (4, LEN_STEP)
        eng.warm_graphs()
        decode = {k for k in eng.graphs.graphs if k[0] == "code"}
        assert decode == {("code", bb, LEN_STEP) for bb in bucket_sizes(BATCH_STEP, 40)}
        assert_served_without_a_new_decode_graph(eng, reqs, want, decode)
    finally:
        eng.stop()
        ours.decode_kernel = False


def test_torchscript_keeps_the_dense_attention_and_refuses_the_flag(tiny):
    arch, _, _, ours = tiny
    ours.decode_kernel = True
    try:
        scripted = torch.jit.script(ours)  # the flag's branch is not compiled into the export
    finally:
        ours.decode_kernel = False
    with pytest.raises(EngineError, match="TorchScript"):
        make_engine(scripted, arch, start=False, decode_kernel=True)
    eng = make_engine(scripted, arch, start=False)  # auto: nothing to set on a ScriptModule
    assert isinstance(eng, Engine)
    eng.stop()


@pytest.fixture(scope="module")
def tiny(tiny_assets):
    from chattts_triton.model.gpt import load_gpt
    from tests.engine_util import upstream_gpt

    arch, emb, g = upstream_gpt(tiny_assets)
    return arch, emb, g, load_gpt(tiny_assets, arch)
