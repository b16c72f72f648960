"""The length-aware splitter (chattts_triton.model.split) on long Chinese, English and mixed paragraphs."""

from __future__ import annotations

import re

import pytest

from chattts_triton.config import LIMITS, SAMPLE_RATE, SAMPLES_PER_CODE
from chattts_triton.model.split import (
    _NUMBER,
    _TOKEN,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MIN_FRAMES,
    FRAMES_PER_SYLLABLE,
    estimate_frames,
    split_for_synthesis,
)
from chattts_triton.model.text import split_text

ZH_PARAGRAPH = (
    "四川美食确实以辣闻名，但也有不辣的选择。比如甜水面、赖汤圆、蛋烘糕、叶儿粑等，这些小吃口味温和，甜而不腻，也很受欢迎。"
    "成都是一座来了就不想走的城市，街头巷尾都是茶馆，人们喝着盖碗茶，摆着龙门阵，日子过得悠闲自在。"
    "2026年12月2日，我们在宽窄巷子吃了一碗担担面，价格是12.5元，比去年上涨了8%，但味道还是一样好。"
    "[uv_break]如果你有机会来成都，一定要去看看大熊猫，它们每天要吃掉大约12.5公斤的竹子，睡上十几个小时，憨态可掬，让人忍俊不禁。"
) * 3
EN_PARAGRAPH = (
    "The history of the printing press is a story of patience, failure and luck. In 1440, a goldsmith in Mainz "
    "began to "
    "experiment with movable type, and within 50 years more than 20,000,000 books had been printed across Europe. "
    "Meet me at 10:30 on 2026-12-02, it costs $12.50, and bring the 3rd volume of the catalogue with you; the library "
    "closes at 6:00 pm sharp [uv_break] and the librarian, who has worked there since March 3, 2001, does not wait for "
    "anyone, not even for the director of the museum who donated 1,500 manuscripts last year. "
) * 3
MIXED_PARAGRAPH = (
    "我今天用了 ChatTTS 和 Triton 部署了一个语音服务，it handles 64 requests at once and answers in about 150 ms. "
    "价格是每小时$2.50，比我们原来的方案便宜了45%，而且 the first chunk arrives before you finish reading "
    "this sentence. "
    "[laugh_0]下周一上午9:30我们开会讨论 the next steps，包括 streaming, batching and a gateway for OpenAI clients。"
) * 3


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _spans(pattern, text):
    return [m.span() for m in pattern.finditer(text)]


@pytest.mark.parametrize("text", [ZH_PARAGRAPH, EN_PARAGRAPH, MIXED_PARAGRAPH], ids=["zh", "en", "mixed"])
@pytest.mark.parametrize("max_frames", [DEFAULT_MAX_FRAMES, 600, 300])
def test_long_paragraphs_are_cut_into_pieces_that_fit_losing_nothing(text, max_frames):
    pieces = split_for_synthesis(text, max_frames=max_frames)
    assert len(pieces) > 1
    assert all(p and p == p.strip() for p in pieces)
    assert _squash("".join(pieces)) == _squash(text)  # nothing dropped, nothing reordered
    assert max(estimate_frames(p) for p in pieces) <= max_frames
    # no cut inside a control token or a number with its unit, sign or currency
    for pattern in (_TOKEN, _NUMBER):
        whole = [text[s:e] for s, e in _spans(pattern, text)]
        inside = [p[s:e] for p in pieces for s, e in _spans(pattern, p)]
        assert sorted(map(_squash, whole)) == sorted(map(_squash, inside)), pattern.pattern


def test_every_piece_stays_under_max_new_tokens_with_margin():
    # the default budget is half of what one request may generate, under the ~30 s where ChatTTS drops words
    assert DEFAULT_MAX_FRAMES * 2 == LIMITS.max_new_tokens
    assert DEFAULT_MAX_FRAMES * SAMPLES_PER_CODE / SAMPLE_RATE < 22
    for text in (ZH_PARAGRAPH, EN_PARAGRAPH, MIXED_PARAGRAPH):
        assert all(estimate_frames(p) <= DEFAULT_MAX_FRAMES for p in split_for_synthesis(text))


def test_sentences_are_cut_where_upstream_cuts_them_when_they_fit():
    text = ("四川美食确实以辣闻名，但也有不辣的选择。比如甜水面、赖汤圆、蛋烘糕、叶儿粑等。"
            "The weather is nice today. Let us go out.")
    assert split_for_synthesis(text) == [p.strip() for p in split_text(text, drop_empty=True)]
    assert split_for_synthesis("第一行的句子足够长了\n第二行的句子也足够长") == [
        "第一行的句子足够长了", "第二行的句子也足够长"]


def test_a_sentence_over_the_budget_is_cut_at_clauses_first():
    sentence = ("这些小吃口味温和，甜而不腻，也很受欢迎，成都人几乎每天都吃，"
                "游客们也总是排着长队，只为尝一口地道的味道。")
    pieces = split_for_synthesis(sentence, max_frames=300)
    assert len(pieces) > 1 and all(p.endswith(("，", "。")) for p in pieces)


def test_text_without_punctuation_is_cut_between_words_or_characters():
    zh = "我们今天去公园散步看到了很多美丽的花朵和绿色的树木还有很多小朋友在草地上快乐地玩耍" * 4
    pieces = split_for_synthesis(zh, max_frames=200)
    assert len(pieces) > 3 and "".join(pieces) == zh and max(map(estimate_frames, pieces)) <= 200
    en = " ".join(["word"] * 300)
    pieces = split_for_synthesis(en, max_frames=200)
    assert " ".join(pieces) == en and max(map(estimate_frames, pieces)) <= 200


def test_very_short_sentences_join_a_neighbour():
    assert split_for_synthesis("好。我知道了，明天见。OK.") == ["好。我知道了，明天见。OK."]
    long_enough = "The first sentence is long enough to stand alone. The second one is here as well."
    assert split_for_synthesis(long_enough) == ["The first sentence is long enough to stand alone.",
                                                "The second one is here as well."]
    assert split_for_synthesis("Hi. " + long_enough)[0].startswith("Hi. The first")
    assert len(split_for_synthesis("好。好。好。", min_frames=0)) == 3


def test_a_number_longer_than_the_budget_stays_whole():
    number = "1" * 40
    pieces = split_for_synthesis(f"它的编号是{number}，请记下来。", max_frames=60)
    assert any(number in p for p in pieces)


def test_estimate_counts_syllables_pauses_and_tokens():
    assert estimate_frames("你好") == 2 * FRAMES_PER_SYLLABLE
    assert estimate_frames("你好。") > estimate_frames("你好")
    assert estimate_frames("hello world") == 3 * FRAMES_PER_SYLLABLE
    assert estimate_frames("GPU") == 3 * FRAMES_PER_SYLLABLE  # spelled
    assert estimate_frames("45%") > estimate_frames("45") > estimate_frames("4")
    assert estimate_frames("你好[uv_break]") > estimate_frames("你好") == estimate_frames("你好[speed_5]")


@pytest.mark.parametrize("kwargs,match", [(dict(max_frames=0), "max_frames"),
                                          (dict(max_frames=LIMITS.max_new_tokens + 1), "max_frames"),
                                          (dict(min_frames=-1), "min_frames")])
def test_bad_budgets_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        split_for_synthesis("你好", **kwargs)


def test_empty_and_blank_text_gives_no_pieces():
    assert split_for_synthesis("") == [] and split_for_synthesis(" \n\n ") == []
    assert DEFAULT_MIN_FRAMES < DEFAULT_MAX_FRAMES
    with pytest.raises(ValueError, match="str"):
        split_for_synthesis(None)
