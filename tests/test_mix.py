"""Voice mixes (chattts_triton/model/mix.py): the grammar with its errors, and the rule that keeps a mix in the
speaker distribution. Resolving mixes in the registry and storing them: tests/test_voices.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chattts_triton.config import FULL_ARCH
from chattts_triton.model import mix as M
from chattts_triton.model import speaker as spk

HIDDEN = FULL_ARCH.gpt.hidden


@pytest.mark.parametrize("expr, terms", [
    ("2222*0.7+nova*0.3", [("2222", 0.7), ("nova", 0.3)]),
    ("2222(2)+nova(1)", [("2222", 2 / 3), ("nova", 1 / 3)]),  # Kokoro's form
    (" a + b ", [("a", 0.5), ("b", 0.5)]),  # a term without a weight weighs 1
    ("a * 3 + b ( 1 )", [("a", 0.75), ("b", 0.25)]),
    ("a*.5+b*1e-1+c*5E-1", [("a", 0.5 / 1.1), ("b", 0.1 / 1.1), ("c", 0.5 / 1.1)]),
    ("a*2", [("a", 1.0)]),
    ("a.b-c_d*1+a.b-c_d*1", [("a.b-c_d", 0.5), ("a.b-c_d", 0.5)]),
])
def test_parse_normalises_the_weights(expr, terms):
    got = M.parse(expr)
    assert [n for n, _ in got] == [n for n, _ in terms]
    assert all(math.isclose(w, v) for (_, w), (_, v) in zip(got, terms, strict=True))
    assert math.isclose(math.fsum(w for _, w in got), 1.0)


@pytest.mark.parametrize("expr, words", [
    ("a*-0.3+b*1", "weight '-0.3' is not a number"),
    ("a*nan+b", "weight 'nan'"),
    ("a(NaN)+b", "weight 'NaN'"),
    ("a*inf", "weight 'inf'"),
    ("a*0+b", "weight '0'"),
    ("a*1e400", "weight '1e400'"),
    ("a*1001", "(0, 1000]"),
    ("a*0x10", "weight '0x10'"),
    ("a+", "term 2 of the voice mix 'a+' is empty"),
    ("+a", "term 1"),
    ("a++b", "term 2"),
    ("a* ", "is not NAME, NAME*WEIGHT or NAME(WEIGHT)"),
    ("a(1", "is not NAME"),
    ("a(1)(2)", "is not NAME"),
    ("a b*1", "is not NAME"),
    ("-a*1", "is not NAME"),
    ("x" * 65 + "*1", "is not NAME"),
    ("+".join(["a"] * 1000), "1000 terms, more than 16"),
    ("+".join(["a"] * 17), "17 terms"),
    ("a*1" + " " * 3000, "more than 2048"),
])
def test_bad_mixes_are_refused_naming_the_term(expr, words):
    assert M.is_mix(expr)
    with pytest.raises(M.MixError) as e:
        M.parse(expr)
    assert words in str(e.value)


def test_names_are_no_mixes():
    assert not any(M.is_mix(n) for n in ("nova", "2222", "a.b-c_d", ""))
    assert M.is_mix("a(1)") and M.is_mix("a*1") and M.is_mix("a+b")
    assert M.canonical(M.parse("a(2)+b(1)")) == "a*0.666667+b*0.333333"


def z_norm(emb: np.ndarray, hidden: int = HIDDEN) -> float:
    std, mean = spk.spk_stat()
    mean, std = mean[:hidden].double().numpy(), std[:hidden].double().numpy()
    return float(np.linalg.norm((emb.astype(np.float64) - mean) / std))


def seed_embedding(seed: int, hidden: int = HIDDEN) -> np.ndarray:
    return spk.decode_speaker(spk.sample_random_speaker(seed, hidden), hidden)


def test_a_mix_of_seed_speakers_stays_in_the_speaker_distribution():
    """|z| of a seed speaker is √hidden within a few percent; a plain average falls far inside that shell, the mix
    is on it, in the direction of the weighted average."""
    seeds = [2222, 5099, 6653, 1111]
    embs = [seed_embedding(s) for s in seeds]
    norms = [z_norm(e) for e in embs]
    assert all(abs(n / math.sqrt(HIDDEN) - 1) < 0.05 for n in norms)
    for weights in ([0.7, 0.3], [0.5, 0.5], [0.25] * 4, [0.9, 0.05, 0.03, 0.02]):
        k = len(weights)
        mixed = M.mix(embs[:k], weights, HIDDEN)
        assert mixed.dtype == np.float16 and mixed.shape == (HIDDEN,)
        average = sum(w * e.astype(np.float64) for w, e in zip(weights, embs[:k], strict=True))
        target = sum(w * n for w, n in zip(weights, norms[:k], strict=True))
        assert math.isclose(z_norm(mixed), target, rel_tol=2e-3)
        if max(weights) < 0.9:
            assert z_norm(average) < 0.8 * target  # what the rescaling is for
        std, mean = spk.spk_stat()
        s, m = std.double().numpy(), mean.double().numpy()
        cos = np.dot((mixed - m) / s, (average - m) / s) / (z_norm(mixed) * z_norm(average))
        assert cos > 0.9999  # the same direction as the average


def test_a_voice_mixed_with_itself_is_itself_and_one_term_is_that_term():
    emb = seed_embedding(2222)
    assert np.array_equal(M.mix([emb, emb], [0.5, 0.5], HIDDEN), emb)
    assert np.array_equal(M.mix([emb], [1.0], HIDDEN), emb)


def test_mixes_of_tiny_models_use_the_first_entries_of_spk_stat():
    embs = [seed_embedding(s, 32) for s in (1, 2)]
    mixed = M.mix(embs, [0.5, 0.5], 32)
    assert mixed.shape == (32,) and math.isclose(z_norm(mixed, 32), (z_norm(embs[0], 32) + z_norm(embs[1], 32)) / 2,
                                                 rel_tol=5e-3)


def test_a_mix_that_cancels_out_is_refused():
    std, mean = spk.spk_stat()
    s, m = std.double().numpy(), mean.double().numpy()
    z = (seed_embedding(7).astype(np.float64) - m) / s
    opposite = (m - s * z).astype(np.float16)
    with pytest.raises(M.MixError, match="cancels out"):
        M.mix([seed_embedding(7), opposite], [0.5, 0.5], HIDDEN)
    with pytest.raises(M.MixError, match="one weight per speaker"):
        M.mix([seed_embedding(7)], [0.5, 0.5], HIDDEN)
