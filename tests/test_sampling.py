"""Sampling (chattts_triton/model/sampling.py): upstream's filters and penalty, the counter-based draw."""

from __future__ import annotations

import torch

from chattts_triton.model import sampling


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


def test_one_sort_for_top_p_and_top_k_equals_the_two_warpers_row_by_row():
    """`process_logits` filters with `top_p_top_k_filter` (one sort): for every row it equals transformers'
    TopPLogitsWarper then TopKLogitsWarper with that row's settings, either one off (top_p 1, top_k 0), with tied
    logits (the k-th value a tie) and with -inf already in a row."""
    from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(3)
    settings = [(p, k) for p in (0.1, 0.7, 0.95, 1.0) for k in (0, 1, 3, 20, 700)]
    r = len(settings)
    for logits in (torch.randn(r, 626, generator=g) * 3, torch.randint(-4, 5, (r, 626), generator=g).float()):
        logits[::3, 625] = float("-inf")
        top_p = torch.tensor([p for p, _ in settings])
        top_k = torch.tensor([k for _, k in settings])
        got = sampling.top_p_top_k_filter(logits, top_p, top_k)
        for i, (p, k) in enumerate(settings):
            want = logits[i : i + 1]
            if p < 1.0:
                want = TopPLogitsWarper(p, min_tokens_to_keep=3)(None, want)
            if k > 0:
                want = TopKLogitsWarper(k, min_tokens_to_keep=3)(None, want)
            assert torch.equal(got[i : i + 1], want), (p, k)


def test_counter_based_draw_is_deterministic_and_uniform():
    seed = torch.tensor([1, 1, 2, (1 << 40) + 1])
    u1 = sampling.uniform(seed, torch.tensor([0, 1, 0, 0]), torch.zeros(4, dtype=torch.long),
                          torch.zeros(4, dtype=torch.long))
    u2 = sampling.uniform(seed, torch.tensor([0, 1, 0, 0]), torch.zeros(4, dtype=torch.long),
                          torch.zeros(4, dtype=torch.long))
    assert torch.equal(u1, u2) and len(set(u1.tolist())) == 4
    many = sampling.uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long),
                            torch.zeros(20000, dtype=torch.long), torch.zeros(20000, dtype=torch.long))
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
                                 torch.full((r,), 20), torch.zeros(r, 16, dtype=torch.long),
                                 torch.zeros(r, dtype=torch.long),
                                 torch.zeros(r, dtype=torch.bool), torch.full((r,), 625))
    probs = lg.softmax(-1)
    assert 0 < probs[0, 536] < 1e-40  # the trap: a positive probability before the favourite
    z = torch.zeros(r, dtype=torch.long)
    u = sampling.uniform(z, z, torch.arange(r), z)  # seed 0, step 0, rows 0..3, attempt 0
    assert sampling.sample(lg, u).tolist() == [544] * r
