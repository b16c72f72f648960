"""Spoken-form normalisation (chattts_triton.model.spoken): the hand-written tables of tests/spoken_cases.py through the
library function and through the server's Normalizer, control tokens, mixed text, failures, cost."""

from __future__ import annotations

import logging
import random
import re

import pytest

from chattts_triton.model import spoken as sp
from chattts_triton.model.text import Normalizer, detect_language
from tests.spoken_cases import EN_CASES, ZH_CASES


def same_speech(a: str, b: str) -> bool:
    """Whether a voice says the same: in English case, hyphens between number words, commas between words, and
    "o" for zero ("six o five": the letter is said "oh") are not heard; Chinese is compared as written."""
    def canon(s: str) -> str:
        s = s.lower().replace("-", " ").replace(",", " ")
        s = re.sub(r"\bo\b", "oh", s)
        return re.sub(r"\s+", " ", s).strip()

    return canon(a) == canon(b)


def heard_as_expected(got: str, accepted) -> bool:
    return any(same_speech(got, e) for e in accepted)


@pytest.fixture(scope="module")
def served_normalizer():
    return Normalizer(spoken=sp.default())  # what chattts_preprocess runs


@pytest.fixture(scope="module")
def plain_normalizer():
    return Normalizer()  # upstream's step alone (tests/test_text.py)


def test_the_tables_are_large_enough_and_cover_every_category():
    assert len(ZH_CASES) >= 60 and len(EN_CASES) >= 60
    zh, en = " ".join(w for w, _ in ZH_CASES), " ".join(w for w, _ in EN_CASES)
    for mark in ("%", "¥", "$", "€", "£", "元", "美元", "/", "-", "~", ":", "第", "km", "kg", "℃", "GB", "[uv_break]"):
        assert mark in zh, mark
    for mark in ("%", "¥", "$", "€", "£", "/", "-", ":", "1st", "km", "kg", "°C", "GB", "[uv_break]"):
        assert mark in en, mark


@pytest.mark.parametrize("written,accepted", ZH_CASES, ids=[w for w, _ in ZH_CASES])
def test_chinese_is_read_as_a_native_speaker_reads_it(written, accepted):
    got = sp.spoken_form(written)
    assert detect_language(written) == "zh"
    assert heard_as_expected(got, accepted), f"{written!r} -> {got!r}, expected one of {accepted}"


@pytest.mark.parametrize("written,accepted", EN_CASES, ids=[w for w, _ in EN_CASES])
def test_english_is_read_as_a_native_speaker_reads_it(written, accepted):
    got = sp.spoken_form(written)
    assert detect_language(written) == "en"
    assert heard_as_expected(got, accepted), f"{written!r} -> {got!r}, expected one of {accepted}"


def test_the_served_normalizer_voices_the_tables_and_removes_nothing(served_normalizer, plain_normalizer):
    """Through the whole text path the server runs (spoken form, then upstream's punctuation, homophones and
    removal): each text comes out as upstream's step makes of the hand-written spoken form, with nothing removed
    but apostrophes (upstream removes them from every English text: "o'clock")."""
    bad = []
    for written, accepted in ZH_CASES + EN_CASES:
        result = served_normalizer.normalize(written)
        if not any(same_speech(result.text, plain_normalizer(e)) for e in accepted) or set(result.removed) - {"'"}:
            bad.append((written, result))
    assert not bad, bad[:5]


def test_the_issue_sentences(served_normalizer):
    assert (served_normalizer("我有3个苹果，价格是12.5元，增长了45%。")
            == "我有三个苹果，价格是十二点五元，增长了百分之四十五。")
    en = served_normalizer("Meet me at 10:30 on 2026-12-02, it costs $12.50.")
    assert same_speech(en, "Meet me at ten thirty on the second of december twenty twenty six, it costs twelve dollars "
                           "and fifty cents.") or same_speech(en,
                                                              "Meet me at ten thirty on december second twenty twenty "
                                                                  "six, it costs twelve dollars and fifty cents.")


def test_control_tokens_pass_untouched_next_to_numbers():
    text = "[oral_2][laugh_0]第1名[uv_break]得了100分[lbreak][break_6]3/4"
    assert sp.spoken_form(text) == "[oral_2][laugh_0]第一名[uv_break]得了一百分[lbreak][break_6]四分之三"


def test_each_window_is_read_in_its_own_language():
    # a Chinese text with English numbers and an English text with a Chinese amount
    assert sp.spoken_form("我买了iPhone 15，花了$999。") == "我买了iPhone 十五，花了九百九十九美元。"
    assert same_speech(sp.spoken_form("The ticket is 100元 and the bus leaves at 7:45 today."),
                       "The ticket is 一百元 and the bus leaves at seven forty five today.")


def test_text_without_digits_is_returned_as_is_without_the_grammars(monkeypatch):
    spoken = sp.SpokenForm()
    monkeypatch.setattr(spoken, "_wetext", None)  # would raise if used
    for text in ("四川美食确实以辣闻名，但也有不辣的选择。",
                 "Hello world, 100 percent plain.".replace("100", "one hundred"), ""):
        assert spoken(text, detect_language(text)) == text


def test_a_grammar_failure_keeps_the_rest_and_never_fails_the_request(caplog):
    spoken = sp.SpokenForm()
    with caplog.at_level(logging.WARNING, logger="chattts_triton.model.spoken"):
        got = spoken("Dial +44 or 555 now", "en")  # the English grammar asserts on "+44" (no number after it)
    assert got == "Dial +44 or five hundred and fifty five now"
    assert "left as written" in caplog.text


def test_a_number_num2words_refuses_is_left_to_the_grammar():
    got = sp.spoken_form("It weighs 1" + "0" * 14 + " tons.")
    assert not re.search(r"\d", got)


def test_random_text_never_raises_and_is_deterministic():
    pool = (list("0123456789０１２ .,:;-/%$€£¥℃°+~") + list("年月日个第元点分之")
            + ["km", "kg", "GB", "am", "pm", "st", "th"]
            + ["March", "in", "the", "你好", "Hello", "[uv_break]", "1,234", "2026-12-02", "10:30", "$12.50", "3/4"])
    rng = random.Random(0)
    spoken = sp.default()
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 25)))
        out = sp.spoken_form(text, spoken=spoken)
        assert isinstance(out, str) and out == sp.spoken_form(text, spoken=spoken)
        assert re.findall(r"\[uv_break\]", out) == re.findall(r"\[uv_break\]", text)


def test_windows_take_one_neighbour_and_skip_english_words_before_numbers():
    text = "Meet me at 10:30 on March 3, 2021 在第2天"
    units = [m.span() for m in sp._UNIT.finditer(text)]
    windows = [text[units[lo][0]:units[hi][1]] for lo, hi in sp._windows(text, units, tight=True)]
    assert windows == ["10:30 on", "March 3, 2021 在", "第2天"]
    loose = [text[units[lo][0]:units[hi][1]] for lo, hi in sp._windows(text, units, tight=False)]
    assert loose == ["at 10:30 on", "March 3, 2021 在", "第2天"]


def test_the_grammars_read_only_the_windows_around_numbers():
    """What keeps the cost under the 2 ms target (~50 µs a character fed to a grammar, docs/text-normalization.md):
    of the issue sentences, only the windows around their numbers reach the grammars (money is worded before)."""
    spoken = sp.SpokenForm()
    fed = []
    for lang in ("zh", "en"):
        grammar = spoken._wetext[lang]
        spoken._wetext[lang] = lambda t, grammar=grammar: fed.append(t) or grammar(t)
    spoken("Meet me at 10:30 on 2026-12-02, it costs $12.50.", "en")
    assert fed == ["10:30 on", "2026-12-02, it"]
    fed.clear()
    spoken("我有3个苹果，价格是12.5元，增长了45%。", "zh")
    assert fed == ["有3个", "是12.5元", "了45%。"]


def test_digit_dense_text_goes_to_the_grammars_in_bounded_windows():
    """A grammar call holds the GIL: 2000 characters of numbers are read in windows of at most ~100 characters
    (a few ms each), not in one 0.7 s call that would stall a stream model's engine thread."""
    spoken = sp.SpokenForm()
    seen = []
    for lang in ("zh", "en"):
        grammar = spoken._wetext[lang]
        spoken._wetext[lang] = lambda t, grammar=grammar: seen.append(t) or grammar(t)
    for text in ("1 " * 1000, "1," * 1000, "第1" * 1000, "12.5% " * 333):
        seen.clear()
        out = spoken(text[:2000], detect_language(text))
        assert len(seen) > 10 and max(map(len, seen)) <= max(sp.MAX_WINDOW_CHARS, 3 * 32 + 2)
        assert not re.search(r"\d", out)


def phones_in(text: str):
    """(what was taken as a phone number, its country code, its groups) for each phone number of `text`."""
    return [(text[s:e], p.country, p.groups) for m in sp._PHONE.finditer(text)
            for s, e, p in sorted(sp._phone_spans(m))]


@pytest.mark.parametrize("text,country,groups", [
    ("555-123-4567", "", ("555", "123", "4567")),
    ("555.123.4567", "", ("555", "123", "4567")),
    ("(555) 123-4567", "", ("555", "123", "4567")),
    ("+1 (555) 123-4567", "1", ("555", "123", "4567")),
    ("+1 555 123 4567", "1", ("555", "123", "4567")),
    ("1-800-555-0199", "", ("1", "800", "555", "0199")),
    ("+44 20 7946 0958", "44", ("20", "7946", "0958")),
    ("+44 (0)20 7946 0958", "44", ("20", "7946", "0958")),
    ("+8613812345678", "", ("8613812345678",)),
    ("020 7946 0958", "", ("020", "7946", "0958")),
    ("0161 496 0000", "", ("0161", "496", "0000")),
    ("138 1234 5678", "", ("138", "1234", "5678")),
    ("010-12345678", "", ("010", "12345678")),
])
def test_phone_shapes_are_phone_numbers_without_a_phone_word(text, country, groups):
    assert phones_in(f"It is {text}.") == [(text, country, groups)]


@pytest.mark.parametrize("text", [
    "Call 555-0199", "call me at 555 0199", "Call 5550199", "Tel: 5550199", "my number is 1234567", "电话87654321",
    "请拨打2345 6789", "号码是2345-6789"])
def test_short_or_ungrouped_numbers_are_phone_numbers_after_a_phone_word(text):
    found = phones_in(text)
    assert len(found) == 1 and "".join(found[0][2]) == re.sub(r"\D", "", text), found
    assert phones_in(re.sub(r"^\D+", "Add ", text)) == []  # the same digits after another word


@pytest.mark.parametrize("text", [
    "Wait 3-5 days", "From 1999-2000", "2020-2025年", "on 2026-12-02", "on 12-02-2026", "at 10:30", "at 12:30:45",
    "pi is 3.14159", "in 2019 2020 2021", "It sold 1234567 copies", "1 000 000 people", "1.000.000 people",
    "ISBN 978-3-16-148410-0", "ISBN 0-306-40615-2", "It costs $555-1234", "IP 192.168.1.1", "手机销量12000000部",
    # even after a phone word: a range, a date, a time, a decimal, thousands, an amount
    "Call 3-5 times", "Call me on 2026-12-02", "Call me at 10:30", "Tel: 555.0199", "call 1 000 000 people",
    "电话费12.5元", "拨款1000000元"])
def test_ranges_dates_times_decimals_counts_and_isbns_are_not_phone_numbers(text):
    assert phones_in(text) == []


def test_a_phone_number_ends_where_its_groups_stop_matching():
    # a count after it, a different separator, a one-digit group: not part of the number
    assert phones_in("Call 555-0199 2 times.") == [("555-0199", "", ("555", "0199"))]
    assert phones_in("Dial +1 555 123 4567 3 times.") == [("+1 555 123 4567", "1", ("555", "123", "4567"))]


def test_north_american_numbers_go_to_the_english_grammar_in_the_form_it_reads():
    """The English grammar's telephone rule reads "+1 555-123-4567" (and says "eight hundred" for 1-800); other
    shapes are read with num2words' digit words and never reach it."""
    spoken = sp.SpokenForm()
    fed = []
    grammar = spoken._wetext["en"]
    spoken._wetext["en"] = lambda t: fed.append(t) or grammar(t)
    assert same_speech(spoken("Call +1 555 123 4567 now.", "en"),
                       "Call plus one, five five five, one two three, four five six seven now.")
    assert same_speech(spoken("Call 1 800 555 0199 now.", "en"),
                       "Call one, eight hundred, five five five, zero one nine nine now.")
    assert fed == ["+1 555-123-4567", "1-800-555-0199"]
    fed.clear()
    assert same_speech(spoken("Call 555-0199.", "en"), "Call five five five, zero one nine nine.")
    assert fed == []


def test_a_phone_number_is_read_in_the_language_around_it():
    assert sp.spoken_form("我的号码是+1 555 123 4567") == "我的号码是加一，五五五，幺二三，四五六七"
    assert same_speech(sp.spoken_form("My number in China is 138 1234 5678, call me."),
                       "My number in China is one three eight, one two three four, five six seven eight, call me.")
    assert sp.spoken_form("请拨打０１０-１２３４５６７８") == "请拨打零幺零，幺二三四五六七八"  # full-width digits


def test_the_chinese_phone_digits_are_the_grammars_own():
    """Read from the Chinese grammar's readings of a mobile number (1 is 幺) and a landline (1 is 一, for a country
    code) when the grammars load."""
    spoken = sp.default()
    assert "".join(spoken._phone_digits["zh"][d] for d in "0123456789") == "零幺二三四五六七八九"
    assert "".join(spoken._country_digits["zh"][d] for d in "0123456789") == "零一二三四五六七八九"
