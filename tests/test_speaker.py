"""chattts_triton.model.speaker equals upstream `ChatTTS.model.speaker.Speaker`; malformed strings are rejected."""

from __future__ import annotations

import lzma

import numpy as np
import pybase16384 as b14
import pytest
import torch

from chattts_triton.config import NUM_AUDIO_TOKENS, NUM_VQ, TINY_ARCH
from chattts_triton.model import speaker as spk
from chattts_triton.model.speaker import SpeakerError
from chattts_triton.model.text import InputError, TextTokenizer, build_code_prompt

pytest.importorskip("ChatTTS")
from ChatTTS.config import Config
from ChatTTS.model.speaker import Speaker as UpSpeaker

SEEDS = [0, 1, 42, 2**31 - 1, 2**63 - 1, 2**64 - 1, -1, -(2**63)]
FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def _raw_speaker(values: np.ndarray) -> str:
    """A speaker string with arbitrary content, built with upstream's own encoder."""
    return UpSpeaker._encode(torch.from_numpy(np.asarray(values, np.float16)))


@pytest.fixture(scope="module")
def up():
    return UpSpeaker(768, Config().spk_stat)


@pytest.fixture(scope="module")
def tok(tiny_assets):
    return TextTokenizer(tiny_assets / "tokenizer")


# --- parity ---------------------------------------------------------------------------------------
def test_spk_stat_matches_upstream(up):
    std, mean = spk.spk_stat()
    assert std.dtype == torch.float16 and std.shape == (768,)
    assert torch.equal(std, up.std) and torch.equal(mean, up.mean)


@pytest.mark.parametrize("seed", SEEDS)
def test_sample_random_matches_upstream(up, seed):
    state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        expected = up.sample_random()
    finally:
        torch.set_rng_state(state)
    before = torch.get_rng_state()
    assert spk.sample_random_speaker(seed) == expected
    assert torch.equal(torch.get_rng_state(), before)  # global RNG untouched


@pytest.mark.parametrize("seed", [0, 7])
def test_decode_encode_match_upstream(up, seed):
    s = spk.sample_random_speaker(seed)
    ours = spk.decode_speaker(s)
    assert ours.dtype == np.float16
    np.testing.assert_array_equal(ours, UpSpeaker._decode(s))
    vec = torch.randn(768, generator=torch.Generator().manual_seed(seed))
    assert spk.encode_speaker(vec) == UpSpeaker._encode(vec)
    assert spk.encode_speaker(vec.numpy()) == UpSpeaker._encode(vec)


@pytest.mark.parametrize("emb_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [0, 3, 11])
def test_embedding_matches_speaker_apply(up, tok, seed, emb_dtype):
    s = spk.sample_random_speaker(seed)
    cp = build_code_prompt(tok, "你好 hello", spk_emb=True, txt_smp="[spk_emb]参考")
    input_ids = torch.from_numpy(cp.input_ids())[None]
    emb = torch.randn(1, cp.length, 768, generator=torch.Generator().manual_seed(seed)).to(emb_dtype)
    out = up.apply(emb.clone(), s, input_ids, tok.spk_emb_id, torch.device("cpu"))
    ours = spk.speaker_embedding(s, dtype=emb_dtype)
    assert len(cp.spk_emb_positions) == 2
    for p in range(cp.length):
        expected = ours if p in cp.spk_emb_positions else emb[0, p]
        assert torch.equal(out[0, p], expected), p


@pytest.mark.parametrize("n_codes", [1, 6, 7, 100, 700])
def test_prompt_codec_matches_upstream(n_codes):
    codes = torch.from_numpy(np.random.default_rng(n_codes).integers(0, 625, (NUM_VQ, n_codes)))
    s = spk.encode_prompt(codes)
    assert s == UpSpeaker.encode_prompt(codes)
    assert spk.encode_prompt(codes.numpy()) == s
    ours = spk.decode_prompt(s)
    assert ours.dtype == np.int64 and ours.shape == (NUM_VQ, n_codes)
    np.testing.assert_array_equal(ours, UpSpeaker.decode_prompt(s).numpy())


def test_tiny_hidden_uses_spk_stat_prefix():
    # Only for tiny test weights: upstream cannot sample below 768.
    h = TINY_ARCH.gpt.hidden
    s = spk.sample_random_speaker(5, hidden=h)
    std, mean = spk.spk_stat()
    expected = torch.randn(h, generator=torch.Generator().manual_seed(5), dtype=torch.float16) * std[:h] + mean[:h]
    np.testing.assert_array_equal(spk.decode_speaker(s, hidden=h), expected.numpy())
    assert spk.speaker_embedding(s, hidden=h).shape == (h,)
    with pytest.raises(SpeakerError, match="has 768 values; this model needs 64"):
        spk.decode_speaker(spk.sample_random_speaker(5), hidden=h)


def test_whitespace_around_speaker_is_tolerated():
    s = spk.sample_random_speaker(2)
    np.testing.assert_array_equal(spk.decode_speaker(f"  {s}\n"), spk.decode_speaker(s))


# --- malformed input ------------------------------------------------------------------------------
def _good() -> str:
    return spk.sample_random_speaker(9)


@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda: 123, "must be a string"),
        (lambda: "", "empty"),
        (lambda: " \n", "empty"),
        (lambda: "not base16384", "not base16384: character 0 is U\\+006E"),
        (lambda: _good()[:10] + "x" + _good()[11:], "not base16384: character 10"),
        (lambda: "㴆" + _good(), "not base16384: character 0 is U\\+3D06"),
        (lambda: "㴆", "not valid base16384"),
        (lambda: "一" * 5000, "too long"),
        (lambda: _good()[:-3], "base16384|truncated|corrupt"),
        (lambda: _good()[:300], "truncated|corrupt"),
        (lambda: b14.encode_to_string(b"\x00" * 7 * 20), "has 0 values"),  # end marker, then ignored junk
        (lambda: b14.encode_to_string(b"\xff" * 140), "corrupt"),
        (lambda: _raw_speaker(np.ones(100)), "has 100 values; this model needs 768"),
        (lambda: _raw_speaker(np.ones(769)), "more than 1536 bytes"),
        (lambda: _raw_speaker(np.ones(1000)), "more than 1536 bytes"),
        (lambda: b14.encode_to_string(lzma.compress(b"\x00" * 1535, format=lzma.FORMAT_RAW, filters=FILTERS)),
         "1535 bytes"),
        (lambda: b14.encode_to_string(lzma.compress(b"\x00" * 10**7, format=lzma.FORMAT_RAW, filters=FILTERS)),
         "more than 1536 bytes"),
        (lambda: _raw_speaker(np.r_[np.ones(767), np.nan]), "NaN or infinite"),
        (lambda: _raw_speaker(np.r_[np.ones(767), np.inf]), "NaN or infinite"),
    ],
)
def test_decode_speaker_rejects(make, pattern):
    with pytest.raises(SpeakerError, match=pattern):
        spk.decode_speaker(make())


def test_speaker_embedding_rejects_unnormalizable():
    with pytest.raises(SpeakerError, match="zero or overflowing norm"):
        spk.speaker_embedding(_raw_speaker(np.zeros(768)))
    with pytest.raises(SpeakerError, match="zero or overflowing norm"):
        spk.speaker_embedding(_raw_speaker(np.full(768, 60000.0)))
    assert issubclass(SpeakerError, InputError) and issubclass(SpeakerError, ValueError)


def test_concatenated_streams_decode_like_upstream():
    # upstream lzma.decompress concatenates streams and ignores trailing garbage after the first one
    half = np.arange(384, dtype=np.float16)
    def c(a):
        return lzma.compress(a.tobytes(), format=lzma.FORMAT_RAW, filters=FILTERS)
    for blob in (c(half) + c(half + 1), c(np.r_[half, half]) + b"\x07garbage"):
        s = b14.encode_to_string(blob)
        np.testing.assert_array_equal(spk.decode_speaker(s), UpSpeaker._decode(s))


@pytest.mark.parametrize("seed,pattern", [("1", "integer"), (1.5, "integer"), (True, "integer"),
                                          (2**64, "out of range")])
def test_sample_random_rejects_bad_seed(seed, pattern):
    with pytest.raises(SpeakerError, match=pattern):
        spk.sample_random_speaker(seed)


def test_sample_random_rejects_bad_hidden():
    with pytest.raises(SpeakerError, match="hidden size"):
        spk.sample_random_speaker(0, hidden=769)


def _prompt(header, codes_bytes: bytes) -> str:
    raw = np.array(header, dtype="<u2").tobytes()
    return b14.encode_to_string(raw + lzma.compress(codes_bytes, format=lzma.FORMAT_RAW, filters=FILTERS))


@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda: None, "must be a string"),
        (lambda: "", "empty"),
        (lambda: "garbage!", "not base16384"),
        (lambda: b14.encode_to_string(b"\x04\x00"), "too short"),
        (lambda: _prompt((3, 10), np.zeros(30, "<u2").tobytes()), "shape \\[3, 10\\]"),
        (lambda: _prompt((NUM_VQ, 0), b""), "shape \\[4, 0\\]"),
        (lambda: _prompt((NUM_VQ, spk.MAX_PROMPT_CODES + 1), b""), "expected \\[4, 1\\.\\."),
        (lambda: _prompt((NUM_VQ, 10), np.zeros(4 * 9, "<u2").tobytes()), "holds 72 bytes"),
        (lambda: _prompt((NUM_VQ, 10), np.zeros(4 * 11, "<u2").tobytes()), "more than 80 bytes"),
        (lambda: _prompt((NUM_VQ, 2), np.full(8, NUM_AUDIO_TOKENS, "<u2").tobytes()), "contains code 626"),
        (lambda: b14.encode_to_string(np.array((NUM_VQ, 2), "<u2").tobytes() + b"junkjunk"), "corrupt"),
        (lambda: spk.encode_prompt(np.zeros((NUM_VQ, 50), np.int64))[:-4], "base16384|truncated|corrupt"),
    ],
)
def test_decode_prompt_rejects(make, pattern):
    with pytest.raises(SpeakerError, match=pattern):
        spk.decode_prompt(make())


@pytest.mark.parametrize(
    "codes,pattern",
    [
        (np.zeros((3, 5), np.int64), "shape"),
        (np.zeros((NUM_VQ,), np.int64), "shape"),
        (np.zeros((NUM_VQ, 0), np.int64), "shape"),
        (np.full((NUM_VQ, 2), -1), "integers in"),
        (np.full((NUM_VQ, 2), 626), "integers in"),
        (np.zeros((NUM_VQ, 2), np.float32), "integers in"),
    ],
)
def test_encode_prompt_rejects(codes, pattern):
    with pytest.raises(SpeakerError, match=pattern):
        spk.encode_prompt(codes)
