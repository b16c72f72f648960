"""The GPU memory plan (chattts_triton.memory): what each engine takes on a card, and what a repository written
before it keeps."""

from __future__ import annotations

import pytest
import torch

from chattts_triton import memory as m
from chattts_triton.config import FULL_ARCH, GPT, KV_PAGE_TOKENS, MANIFEST, TINY_ARCH
from chattts_triton.triton import repo_config as rc

H200 = 143771 << 20  # what an H200 reports, bytes


def planned_total(plans, vocoders=1) -> int:
    """What the whole deployment takes on the GPU by the plan: engines, vocoders, every process's context."""
    return (sum(p.bytes for p in plans.values()) + vocoders * m.VOCODER_BYTES
            + (len(plans) + vocoders) * m.PROCESS_CONTEXT_BYTES)


@pytest.mark.parametrize("gib,gpt,stream", [(None, 1024, 128), (15, 128, 40), (22, 280, 88)])
def test_a_card_gets_the_slots_its_memory_holds_and_the_plan_stays_inside_the_budget(gib, gpt, stream):
    budget = m.budget(H200, gib)
    plans = m.plan(budget, FULL_ARCH, "bf16", 3072, 2048)
    assert (plans["gpt"].slots, plans["stream"].slots) == (gpt, stream)
    assert planned_total(plans) <= budget
    for p in plans.values():
        assert p.cache_tokens % KV_PAGE_TOKENS == 0 and p.cache_tokens >= 3072  # one request at the full context
        assert p.cache_tokens <= p.slots * m.AVG_TOKENS_PER_SLOT or p.cache_tokens == 3072


def test_the_default_on_an_h200_takes_a_fraction_of_the_whole_context_slots():
    plans = m.plan(m.budget(H200), FULL_ARCH, "bf16", 3072, 2048)
    whole = plans["gpt"].slots * 3072 * m.kv_bytes_per_token(FULL_ARCH, 2)  # as many slots at the whole context
    assert plans["gpt"].bytes < 0.45 * whole


def test_pinned_sizes_are_kept_and_fp32_halves_what_fits():
    plans = m.plan(m.budget(H200, 40), FULL_ARCH, "bf16", 3072, 2048, slots={"gpt": 100}, cache_tokens={"stream": 8192})
    assert plans["gpt"].slots == 100 and plans["stream"].cache_tokens == 8192
    half, full = (m.plan(m.budget(H200, 15), FULL_ARCH, d, 3072, 2048)["gpt"].slots for d in ("bf16", "fp32"))
    assert full < half


def test_a_budget_too_small_is_refused_naming_it():
    with pytest.raises(m.MemoryPlanError, match="6.0 GiB cannot hold 8 gpt slots"):
        m.plan(m.budget(H200, 6 / m.GPU_MEMORY_UTILIZATION), FULL_ARCH, "bf16", 3072, 2048)
    with pytest.raises(m.MemoryPlanError, match="positive"):
        m.budget(H200, 0)


def test_gpu_memory_gb_never_plans_past_the_card():
    assert m.budget(16 << 30, 80) == m.budget(16 << 30)


def test_on_the_cpu_an_engine_keeps_its_configured_slots_at_the_full_context():
    from chattts_triton.runtime.device import engine_plan

    p = engine_plan(torch.device("cpu"), TINY_ARCH, "fp32", "gpt", None, None, 256, 64, None, 1)
    assert (p.slots, p.cache_tokens) == (m.CPU_SLOTS["gpt"], m.CPU_SLOTS["gpt"] * 256)
    assert engine_plan(torch.device("cpu"), TINY_ARCH, "fp32", "stream", 3, 500, 256, 64, None, 1).cache_tokens == 500


def test_a_repository_configured_before_the_plan_loses_only_the_old_default_queue():
    old = {"gpus": [0], "max_queue_size": 256, "gpt_slots": None, "gpt_context": 3072}
    assert rc.Deployment.from_manifest({"deployment": old}).max_queue_size is None
    chosen = rc.Deployment.from_manifest({"deployment": {**old, "max_queue_size": 300}})
    assert chosen.max_queue_size == 300
    current = rc.Deployment.from_manifest({"deployment": {**old, "gpt_cache_tokens": None}})
    assert current.max_queue_size == 256  # written by this version: the user's choice


def test_configure_flags_take_auto_and_refuse_nonsense(tiny_repo, tmp_path):
    import json
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--gpu-memory-gb", "15", "--gpt-slots", "64"]) == 0
    dep = json.loads((repo / MANIFEST).read_text())["deployment"]
    assert dep["gpu_memory_gb"] == 15 and dep["gpt_slots"] == 64
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--gpt-slots", "auto"]) == 0
    dep = json.loads((repo / MANIFEST).read_text())["deployment"]
    assert dep["gpt_slots"] is None and dep["gpu_memory_gb"] == 15
    cfg = (repo / GPT / "config.pbtxt").read_text()
    assert 'key: "gpt_slots"' in cfg and 'string_value: "auto"' in cfg
    for bad in (["--gpt-slots", "0"], ["--gpu-memory-gb", "-1"], ["--max-queue-size", "x"]):
        with pytest.raises(SystemExit):
            rc.main(["--repo", str(repo), "--gpus", "0", *bad])


def test_an_fp8_cache_takes_one_byte_a_value_and_fits_more_slots_in_a_budget():
    """kv_cache_dtype fp8: one byte a key or value, against the engine's precision's two: the same slots plan less
    memory, by one byte a value for every position, and a budget sized from the card fits more slots."""
    assert m.kv_dtype_bytes("bf16", "fp8") == 1 and m.kv_dtype_bytes("bf16") == 2 and m.kv_dtype_bytes("fp32") == 4
    budget = m.budget(H200, 15)
    half, fp8 = (m.plan(budget, FULL_ARCH, "bf16", 3072, 2048, slots={"gpt": 128, "stream": 40}, kv_cache_dtype=kv)
                 for kv in ("auto", "fp8"))
    assert fp8["gpt"].slots == half["gpt"].slots == 128
    assert fp8["gpt"].cache_tokens >= half["gpt"].cache_tokens
    assert planned_total(fp8) <= budget and fp8["gpt"].bytes < half["gpt"].bytes
    # at 15 GiB the slots' average bounds bf16's cache: each position costs half as much
    per_position = (half["gpt"].bytes - fp8["gpt"].bytes) / (half["gpt"].cache_tokens + KV_PAGE_TOKENS)
    assert per_position == m.kv_bytes_per_token(FULL_ARCH, 1)
    auto_slots = m.plan(m.budget(H200, 15), FULL_ARCH, "bf16", 3072, 2048)["gpt"].slots
    assert m.plan(m.budget(H200, 15), FULL_ARCH, "bf16", 3072, 2048, kv_cache_dtype="fp8")["gpt"].slots > auto_slots
