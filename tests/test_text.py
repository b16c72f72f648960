"""chattts_triton.model.text equals upstream ChatTTS 0.2.5 on the text path; input validation errors.

Upstream pieces used: `ChatTTS.Chat().normalizer` (the Normalizer exactly as Chat builds it; plain, and with the
spoken-form step registered as upstream's docs register WeTextProcessing / NeMo: `normalizer.register(lang, fn)`),
`Chat.infer`'s split (read from the unstarted `_infer` generator: nothing runs, nothing is mocked),
`ChatTTS.model.tokenizer.Tokenizer` and `ChatTTS.model.speaker.Speaker` (static prompt decorators).
The synthetic tokenizer is the same file in assets-tiny and assets-full (same writer, same vocab size).
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from chattts_triton.config import LIMITS, NUM_VQ, SPECIAL_TOKENS
from chattts_triton.model import speaker as spk
from chattts_triton.model.text import (
    HOMOPHONES_PATH,
    InputError,
    Normalizer,
    TextTokenizer,
    build_code_prompt,
    build_refine_prompt,
    refined_text,
    split_text,
    validate_prompt,
    validate_text,
)
from tests.spoken_cases import EN_CASES, ZH_CASES

ChatTTS = pytest.importorskip("ChatTTS")
from ChatTTS.model.speaker import Speaker as UpSpeaker  # noqa: E402  after the importorskip above
from ChatTTS.model.tokenizer import Tokenizer as UpTokenizer  # noqa: E402  after the importorskip above

UPSTREAM_RES = Path(ChatTTS.__file__).parent / "res"
# upstream's numba helpers warn about reflected lists on first compile
pytestmark = pytest.mark.filterwarnings(r"ignore:\s*Encountered the use of a type that is scheduled for deprecation")

# --- corpus ---------------------------------------------------------------------------------------
HANDWRITTEN = [
    "",
    " ",
    "你好",
    "四川美食确实以辣闻名，但也有不辣的选择。比如甜水面、赖汤圆、蛋烘糕、叶儿粑等，这些小吃口味温和，甜而不腻。",
    "Hello world. This is ChatTTS, a text-to-speech model! Isn't it great? (yes)",
    "我今天用了 ChatTTS 和 Triton, it's 100% awesome!",
    "Chat T T S 是一款强大的对话式文本转语音模型。[uv_break]它有中英混读和多说话人的能力。[laugh]",
    "[oral_2][laugh_0][break_6]hello [uv_break] world [lbreak]",
    "text with [uv_break] and [Stts][spk_emb][empty_spk] tags",
    "价格是 3.14 元, 数字 12345 and 67890.",
    "全角字符：ＡＢＣ１２３！？（括号）【方括号】《书名》「引号」『双引号』－",
    "half width: a:b;c!d(e)f<g>h-i \"quoted\" 'single' #hash $dollar %pct &amp *star +plus /slash =eq ?q @at \\bs ^c "
    "`bt {b} |p ~t",
    "emoji 😀🎉👍🏽 and 中文 🇨🇳 flags",
    "為於與滿満鍑粡瀹滆摲渹 are homophone keys 為了",
    "tabs\tand\nnewlines\r\nhere",
    "unclosed [tag here 中文😀",
    "stray ] bracket 中文😀",
    "nested [a[b]c] 😀",
    "[😀] tag with emoji inside, 中文",
    "[中文] chinese tag 😀",
    "[uv_break]",
    "[uv_break]😀",
    "😀",
    "。。。...",
    "A. B. C.D. 你好。世界。",
    "café naïve résumé Ünïcödé",
    "ｆｕｌｌ　ｗｉｄｔｈ　ｓｐａｃｅ",
    "mixed 中文 and english words in a sentence 混合",
    "zero\u200bwidth\ufeffbom",
    "a]b]c",
    "[a]]",
    "x[a]y[bc",
    "[ab[cd]",
]

_POOL = (
    list("abcdefghijkXYZ    0123456789")
    + list("你好世界中文语音合成模型為於與滿満鍑粡瀹")
    + list("，。、！？；：（）【】《》「」『』－“”‘’…")
    + list(",.!?;:()<>-\"'#$%&*+/=@\\^`{|}~_")
    + ["[", "]", "[uv_break]", "[laugh_0]", "[speed_5]", "[spk_emb]", "[Stts]", "[foo]", "[a b]"]
    + ["😀", "🎉", "é", "ü", "Ａ", "１", "\t", "\n", "\u3000", "\u200b"]
)


def _fuzz(n: int, seed: int = 0):
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 40))) for _ in range(n)]


CORPUS = HANDWRITTEN + _fuzz(300)
NORM_OPTIONS = [
    (True, True, None),
    (False, True, None),
    (True, False, None),
    (False, False, None),
    (True, True, "zh"),
    (True, True, "en"),
]


# --- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def up_chat():
    return ChatTTS.Chat(logging.getLogger("upstream"))  # nothing loaded: normalizer + infer's split only


@pytest.fixture(scope="module")
def tok_dir(tiny_assets) -> Path:
    return Path(tiny_assets) / "tokenizer"


@pytest.fixture(scope="module")
def up_tok(tok_dir):
    return UpTokenizer(str(tok_dir))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return TextTokenizer(tok_dir)


@pytest.fixture(scope="module")
def normalizer():
    return Normalizer()


# --- normalizer -----------------------------------------------------------------------------------
def test_vendored_homophones_equal_upstream():
    with gzip.open(HOMOPHONES_PATH, "rb") as f:
        ours = f.read()
    assert ours == (UPSTREAM_RES / "homophones_map.json").read_bytes()


@pytest.mark.parametrize("opts", NORM_OPTIONS, ids=lambda o: f"norm={o[0]},homo={o[1]},lang={o[2]}")
def test_normalizer_matches_upstream(up_chat, normalizer, opts):
    logging.getLogger("upstream").setLevel(logging.ERROR)
    mismatches = [(t, up_chat.normalizer(t, *opts), normalizer(t, *opts)) for t in CORPUS]
    mismatches = [m for m in mismatches if m[1] != m[2]]
    assert not mismatches, mismatches[:5]


SPOKEN_CORPUS = CORPUS + [w for w, _ in ZH_CASES + EN_CASES] + [
    "我有3个苹果，价格是12.5元，增长了45%。", "Meet me at 10:30 on 2026-12-02, it costs $12.50.",
    "[oral_2]第1名[uv_break]得了100分[lbreak]", "12:30 [uv_break] 3/4 😀 %",
]


@pytest.mark.parametrize("opts", NORM_OPTIONS, ids=lambda o: f"norm={o[0]},homo={o[1]},lang={o[2]}")
def test_normalizer_with_the_spoken_form_matches_upstream_with_it_registered(opts):
    """Ours runs the spoken-form step where upstream runs a registered language normaliser (on the text between
    control tokens, before the half/full-width map), so both agree on text with digits and symbols too. Upstream
    raises IndexError on "" once a normaliser is registered (`texts[0]` of no texts); ours returns ""."""
    from chattts_triton.model.spoken import default

    logging.getLogger("upstream-spoken").setLevel(logging.ERROR)
    up = ChatTTS.Chat(logging.getLogger("upstream-spoken")).normalizer
    spoken = default()
    for lang in ("zh", "en"):
        assert up.register(lang, lambda t, lang=lang: spoken(t, lang))
    ours = Normalizer(spoken=spoken)
    texts = [t for t in SPOKEN_CORPUS if t]
    mismatches = [(t, up(t, *opts), ours(t, *opts)) for t in texts]
    mismatches = [m for m in mismatches if m[1] != m[2]]
    assert not mismatches, mismatches[:5]
    if opts[0]:  # the registered normaliser runs only with do_text_normalization
        with pytest.raises(IndexError):
            up("", *opts)
    assert ours("", *opts) == up("", False, *opts[1:]) == ""


def test_normalize_counts_what_it_removes(normalizer):
    result = normalizer.normalize("😀 hello 😀 [uv_break] % world #")
    assert result.removed == {"😀": 2, "%": 1, "#": 1}
    assert result.text == normalizer("😀 hello 😀 [uv_break] % world #")
    assert normalizer.normalize("你好，世界。").removed == {}


def test_normalizer_corpus_exercises_every_branch(normalizer):
    # guard against a corpus that silently stops covering the interesting paths
    outs = {t: normalizer(t) for t in CORPUS}
    assert any(normalizer.invalid_characters(t) for t in CORPUS)  # rejection path
    assert any("[" in t and normalizer.invalid_characters(t) for t in CORPUS)  # tag split/combine
    assert outs["為於與滿満鍑粡瀹滆摲渹 are homophone keys 為了"] != "為於與滿満鍑粡瀹滆摲渹 are homophone keys 為了"
    assert "，" in normalizer("你好,世界")  # zh half->full width


def test_normalizer_surrogate_raises_like_upstream(up_chat, normalizer):
    bad = "你好\ud800"
    with pytest.raises(UnicodeEncodeError):
        up_chat.normalizer(bad)
    with pytest.raises(InputError, match="surrogate"):
        normalizer(bad)
    assert normalizer(bad, True, False) == up_chat.normalizer(bad, True, False)


def test_normalizer_rejects_unknown_language(normalizer):
    with pytest.raises(InputError, match="language"):
        normalizer("hello", lang="fr")


# --- split ----------------------------------------------------------------------------------------
SPLIT_CASES = [
    "one sentence",
    "第一句。第二句。第三句",
    "First. Second.Third. ",
    "a\nb\n\nc",
    "\n",
    "。",
    "",
    "Mixed 中文。 and English. done",
    "x. y。z\r\nw",
]


@pytest.mark.parametrize("text", SPLIT_CASES)
def test_split_text_matches_upstream_infer(up_chat, text):
    got = up_chat.infer(text, stream=True, skip_refine_text=True)
    upstream = got if isinstance(got, list) else got.gi_frame.f_locals["text"]
    assert split_text(text) == upstream
    assert split_text(text, drop_empty=True) == [p for p in upstream if p.strip()]


# --- tokenizer ------------------------------------------------------------------------------------
def _up_ids(up_tok, text: str):
    ids, attn, mask = up_tok.encode([text], NUM_VQ)
    return ids[0, :, 0].tolist()


def test_tokenizer_attributes_match_upstream(tok, up_tok):
    assert (len(tok), tok.vocab_size) == (up_tok.len, up_tok.len)
    assert tok.spk_emb_id == up_tok.spk_emb_ids
    assert tok.break_0_id == up_tok.break_0_ids
    assert tok.eos_id == up_tok.eos_token
    assert all(tok.token_id(t) == up_tok._tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)


def test_encode_matches_upstream(tok, up_tok, normalizer):
    texts = CORPUS + [normalizer(t) for t in CORPUS[:120]]
    bad = [(t, _up_ids(up_tok, t), tok.encode(t)) for t in texts]
    bad = [b for b in bad if b[1] != b[2]]
    assert not bad, bad[:5]


def test_decode_matches_upstream(tok, up_tok):
    rng = np.random.default_rng(0)
    seqs = [tok.encode(t) for t in CORPUS[:150]]
    seqs += [rng.integers(0, tok.vocab_size, rng.integers(0, 30)).tolist() for _ in range(100)]
    seqs += [rng.integers(tok.vocab_size - len(SPECIAL_TOKENS), tok.vocab_size, 8).tolist() for _ in range(20)]
    up = up_tok.decode([torch.tensor(s, dtype=torch.long) for s in seqs])
    bad = [(s, u, tok.decode(s)) for s, u in zip(seqs, up, strict=True) if u != tok.decode(s)]
    assert not bad, bad[:5]


def test_decode_clean_up_flag_matches_upstream(tok_dir, tmp_path):
    # Real tokenizer configs may ask transformers to clean up spaces on decode; follow the flag.
    shutil.copytree(tok_dir, tmp_path / "tok")
    cfg_path = tmp_path / "tok" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["clean_up_tokenization_spaces"] = True
    cfg_path.write_text(json.dumps(cfg))
    up, ours = UpTokenizer(str(tmp_path / "tok")), TextTokenizer(tmp_path / "tok")
    texts = ["don't . stop , it 's ok ! really ? we 're , you 've", "a ' b"]
    for t in texts:
        ids = ours.encode(t)
        assert ours.decode(ids) == up.decode([torch.tensor(ids)])[0]
    assert ours.decode(ours.encode(texts[0])) != TextTokenizer(tok_dir).decode(ours.encode(texts[0]))


def test_decode_rejects_out_of_vocab(tok):
    with pytest.raises(InputError, match="outside the vocabulary"):
        tok.decode([5, tok.vocab_size])


def test_tokenizer_asset_errors(tmp_path):
    from chattts_triton.model.assets import AssetError

    with pytest.raises(AssetError, match="missing"):
        TextTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(AssetError, match="corrupt"):
        TextTokenizer(tmp_path)


def test_tokenizer_missing_special_tokens(tok_dir, tmp_path):
    from chattts_triton.model.assets import AssetError

    d = json.loads((tok_dir / "tokenizer.json").read_text())
    d["added_tokens"] = [a for a in d["added_tokens"] if a["content"] != "[spk_emb]"]
    d["model"]["vocab"].pop("[spk_emb]")
    (tmp_path / "tokenizer.json").write_text(json.dumps(d))
    with pytest.raises(AssetError, match=r"\[spk_emb\]"):
        TextTokenizer(tmp_path / "tokenizer.json")


# --- prompts --------------------------------------------------------------------------------------
PROMPT_TEXTS = [
    "你好，世界。",
    "hello world [uv_break] with tags",
    "  text with [Stts] and [spk_emb] and [empty_spk] inside  ",
    "",
]


def _spk_smp(n: int):
    if n == 0:
        return None
    codes = np.random.default_rng(n).integers(0, 625, (NUM_VQ, n))
    return spk.encode_prompt(codes)


@pytest.mark.parametrize("text", PROMPT_TEXTS)
@pytest.mark.parametrize("prompt", ["[speed_5]", "", "[speed_2][oral_1]"])
@pytest.mark.parametrize(
    "spk_emb,txt_smp,n_smp",
    [(False, None, 0), (True, None, 0), (False, "参考 reference [spk_emb]", 7), (True, "参考 [spk_emb] x", 33)],
)
def test_code_prompt_matches_upstream(tok, up_tok, text, prompt, spk_emb, txt_smp, n_smp):
    spk_emb_str = spk.sample_random_speaker(1) if spk_emb else None
    spk_smp = _spk_smp(n_smp)
    decorated = UpSpeaker.decorate_code_prompts([text], prompt, txt_smp, spk_emb_str)
    up_prompt = UpSpeaker.decode_prompt(spk_smp) if spk_smp is not None else None
    ids, attn, mask = up_tok.encode(decorated, NUM_VQ, prompt=up_prompt)

    codes = spk.decode_prompt(spk_smp) if spk_smp is not None else None
    cp = build_code_prompt(tok, text, prompt, spk_emb=spk_emb, txt_smp=txt_smp, spk_smp_codes=codes)
    assert cp.text_ids.dtype == np.int64 and cp.audio_codes.shape == (n_smp, NUM_VQ)
    np.testing.assert_array_equal(cp.input_ids(), ids[0].numpy())
    np.testing.assert_array_equal(cp.text_mask(), mask[0].numpy())
    assert bool(attn.all())
    # where upstream Speaker.apply writes the speaker embedding
    expected = (ids[0, :, 0] == up_tok.spk_emb_ids).nonzero().flatten().tolist() if spk_emb else []
    assert cp.spk_emb_positions.tolist() == expected
    if spk_emb and txt_smp:
        assert len(expected) == 2  # upstream does not strip [spk_emb] from txt_smp


def test_code_prompt_limit_and_bad_codes(tok):
    with pytest.raises(InputError, match="limit of 5"):
        build_code_prompt(tok, "hello world, a longer text", max_tokens=5)
    with pytest.raises(InputError, match="shape"):
        build_code_prompt(tok, "x", spk_smp_codes=np.zeros((3, 4), np.int64))
    with pytest.raises(InputError, match=r"\[0, 626\)"):
        build_code_prompt(tok, "x", spk_smp_codes=np.full((NUM_VQ, 2), 626))
    with pytest.raises(InputError, match="integers"):
        build_code_prompt(tok, "x", spk_smp_codes=np.zeros((NUM_VQ, 2), np.float32))


@pytest.mark.parametrize("prompt", ["", "[oral_2][laugh_0][break_6]"])
@pytest.mark.parametrize("text", PROMPT_TEXTS[:3])
def test_refine_prompt_matches_upstream(tok, up_tok, text, prompt):
    ids, _, _ = up_tok.encode(UpSpeaker.decorate_text_prompts([text], prompt), NUM_VQ)
    np.testing.assert_array_equal(build_refine_prompt(tok, text, prompt), ids[0, :, 0].numpy())


def test_refined_text_matches_upstream(tok, up_tok):
    # Chat._infer: `i[i.less(break_0_ids)]` per sequence, then Tokenizer.decode
    rng = np.random.default_rng(1)
    for _ in range(30):
        ids = torch.from_numpy(rng.integers(0, tok.vocab_size, 25))
        ids[::5] = torch.from_numpy(rng.integers(tok.vocab_size - len(SPECIAL_TOKENS), tok.vocab_size, 5))
        expected = up_tok.decode([ids[ids.less(up_tok.break_0_ids)]])[0]
        assert refined_text(tok, ids.tolist()) == expected


# --- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "你好，世界。",
        "hello [uv_break] world [laugh_2][speed_9][break_7][oral_0][lbreak]",
        "tab\tnewline\ncr\r\n ok",
        "emoji 😀 and full-width ［x］【y】",
        "a" * LIMITS.max_text_chars,
    ],
)
def test_validate_text_accepts(text):
    assert validate_text(text) == text
    assert validate_text(text.encode("utf-8")) == text


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("", "empty"),
        (" \t\n\u3000", "only whitespace"),
        ("a" * (LIMITS.max_text_chars + 1), "more than the limit"),
        (b"\xff\xfe bad", "not valid UTF-8"),
        (("a" * (4 * LIMITS.max_text_chars + 1)).encode(), "longer than"),
        ("nul\x00byte", "control character U\\+0000"),
        ("bell\x07", "control character U\\+0007"),
        ("esc\x1b[0m", "control character U\\+001B"),
        ("del\x7f", "control character U\\+007F"),
        ("c1\x85", "control character U\\+0085"),
        ("lone \ud800 surrogate", "unpaired surrogate"),
        ("unknown [foo] token", "unknown token '\\[foo\\]'"),
        ("case [UV_BREAK]", "unknown token"),
        ("spaces [ uv_break ]", "unknown token"),
        ("out of range [laugh_3]", "unknown token"),
        ("empty [] brackets", "unknown token"),
        ("reserved [spk_emb]", "reserved token \\[spk_emb\\]"),
        ("reserved [Ebreak]", "reserved token"),
        ("reserved [Stts] x", "reserved token"),
        ("open [uv_break", "unmatched '\\['"),
        ("close uv_break]", "unmatched '\\]'"),
        ("double [[uv_break]]", "unmatched '\\['"),
        (123, "must be a string"),
        (None, "must be a string"),
    ],
)
def test_validate_text_rejects(text, pattern):
    with pytest.raises(InputError, match=pattern):
        validate_text(text)


def test_validate_text_options():
    assert validate_text("", allow_empty=True) == ""
    with pytest.raises(InputError, match="SPEAKER_TEXT has 6 characters, more than the limit of 5"):
        validate_text("abcdef", max_chars=5, what="SPEAKER_TEXT")
    assert issubclass(InputError, ValueError)


@pytest.mark.parametrize("prompt", ["", "[speed_5]", "[oral_2][laugh_0][break_6]", "[uv_break]", b"[speed_0]"])
def test_validate_prompt_accepts(prompt):
    expected = prompt.decode() if isinstance(prompt, bytes) else prompt
    assert validate_prompt(prompt) == expected


@pytest.mark.parametrize(
    "prompt,pattern",
    [
        ("speed_5", "control tokens back to back"),
        ("[speed_5] ", "found ' ' at character 9"),
        (" [speed_5]", "found ' ' at character 0"),
        ("[speed_5]text", "found 't'"),
        ("[speed_10]", "unknown token"),
        ("[speed_5][foo]", "unknown token '\\[foo\\]' at character 9"),
        ("[Ptts]", "reserved token"),
        ("[speed_5", "found '\\['"),
        ("[speed_5]\x00", "control character"),
        ("[speed_5]" * 40, "more than the limit"),
        (b"\xc3(", "not valid UTF-8"),
        (5, "must be a string"),
    ],
)
def test_validate_prompt_rejects(prompt, pattern):
    with pytest.raises(InputError, match=pattern):
        validate_prompt(prompt)
