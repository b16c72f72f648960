"""Spoken form of written Chinese and English: digits, money, dates, times, units ... as a person reads them.

ChatTTS's own text path (`text.Normalizer`, upstream's with no language normalisers) deletes every digit and
symbol. Upstream tells users to register WeTextProcessing (Chinese) and NeMo (English) in its Normalizer; this
module is that step, run before the upstream part exactly where upstream runs its registered normalisers.

- The grammars are WeTextProcessing's, run by `wetext` (the same grammars compiled to FSTs, read by kaldifst: no
  pynini, no grammar compile at start-up, ~50 MB installed; docs/text-normalization.md has the measurements that
  ruled out WeTextProcessing itself, NeMo and cn2an/num2words alone).
- English numbers the English grammar misreads (money with cents, numbers of four digits and more, years, decades,
  "m") are worded by `num2words` before the grammar sees them; two Chinese readings are corrected after it
  ("第两" -> "第二", "月两日" -> "月二日"). Each workaround is there for a case of tests/spoken_cases.py.
- Phone numbers are found first (`_PHONE` and `phone_shape`: a rule on their shape and the words before them,
  docs/text-normalization.md) and read digit by digit, group by group: in English the North American shape goes to
  the English grammar's telephone rule in the form that rule reads ("+1 555-123-4567"), any other with num2words'
  digit words; in Chinese with the Chinese grammar's own telephone digits (1 as 幺).
- Only windows of the text around digits go through the grammars (a digit-bearing word or character with one
  neighbour each side): their cost is linear in the characters fed, ~50 µs each on this project's CPU.
- A window's language is its own: Chinese if it holds a CJK character, English if it holds a Latin letter,
  else the text's (upstream's rule, `text.detect_language`), so mixed Chinese/English text is read in both.
- Control tokens never reach this module: `text.Normalizer` splits them off first (upstream's `_split_tags`).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import NamedTuple

log = logging.getLogger(__name__)

_CJK = re.compile(r"[\u4e00-\u9fff]")
_LATIN = re.compile(r"[A-Za-z]")
_DIGIT = re.compile(r"[0-9\uff10-\uff19]")
# a window is made of units: one CJK character, or a run of other non-space characters (cut at 32)
_UNIT = re.compile(r"[\u4e00-\u9fff]|[^\s\u4e00-\u9fff]{1,32}")
_FULLWIDTH_DIGITS = str.maketrans("０１２３４５６７８９", "0123456789")
# a grammar call holds the GIL (kaldifst does not release it) for ~50 µs a character: windows of digit-dense text
# stop growing at this many characters, so 2000 characters of numbers stall the process's other threads (a stream
# model's engine) for a few milliseconds at a time, not for the 0.7 s they take in all
MAX_WINDOW_CHARS = 96
_THOUSANDS = re.compile(r"(?<![\d,.])\d{1,3}(?:,\d{3})+(?!,?\d)")

# --- phone numbers --------------------------------------------------------------------------------------------
# a candidate: an optional "+", then up to eight groups of digits (an area code may be in parentheses) joined by one
# space, dash or dot; not inside a word, a number, an amount or a time, and not followed by more of a number or a
# Latin letter (a unit). `phone_shape` decides whether (part of) it is a phone number.
_PHONE = re.compile(r"(?<![A-Za-z0-9_+\-$€£¥￥])(?<![0-9][.,:/])\+?(?:(?:\([0-9]{1,5}\)[ .-]?|[0-9]{1,15}[ .-])){0,7}"
                    r"[0-9]{1,15}(?![A-Za-z0-9%°℃]|[ .,:/-][0-9])")
_PHONE_PART = re.compile(r"\(([0-9]+)\)|([0-9]+)")
# words within the three before a number that make it a phone number whatever its shape
_PHONE_WORDS_EN = frozenset("call calling phone telephone tel mobile cell fax dial dialing dialling hotline helpline "
                            "whatsapp contact reach number".split())
_PHONE_WORDS_ZH = re.compile("电话|手机号|致电|拨打|请拨|热线|号码|传真|座机|来电|呼叫|联系方式")
_CHUNK = re.compile(r"\S+")
_LAST_UNIT = re.compile(r"(?:[\u4e00-\u9fff]|[^\s\u4e00-\u9fff]{1,32})\s*\Z")

# --- English: what num2words words before the grammar runs ------------------------------------------------------
# currency symbol -> (major singular, major plural, minor singular, minor plural); no minor unit: decimal reading
_CURRENCY = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "US$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", None, None),
    "￥": ("yen", "yen", None, None),
}
_SCALES = ("thousand", "million", "billion", "trillion")  # "$1.5 million": one point five million dollars
_MONEY = re.compile(r"(?<![\w.])(US\$|[$€£¥￥])\s?(\d+)(?:\.(\d+))?(?:\s?(" + "|".join(_SCALES) + r")\b)?")
_DECADE = re.compile(r"(?<![\w.,:/\-])(\d{3}0)s\b")
# four to fifteen digits on their own (not a group of a phone number "555 123 4567"; longer runs are read digit by
# digit by the grammar)
_BIG = re.compile(r"(?<![\w.,:/\-+])(?<!\d\s)(\d{4,15})(?:\.(\d+))?(?!\w|[.,:/\-]\d|\s\d)")
_METRE = re.compile(r"(?<=\d)\s?m\b(?![\w'/-])")  # the English grammar reads "m" as minutes
_MONTHS = ("january february march april may june july august september october november december "
           "jan feb mar apr jun jul aug sep sept oct nov dec").split()
# a four-digit number after one of these, or after a day of the month ("3,"), is a year; elsewhere a count
_YEAR_BEFORE = frozenset(("in since by from to until till through of year circa around before after during "
                          "early late mid").split() + _MONTHS)
_ERA_AFTER = re.compile(r"\s*(?:BC|AD|BCE|CE)\b")
_LAST_WORD = re.compile(r"(\S+)\s*$")
_WORD = re.compile(r"[A-Za-z][A-Za-z'.,]*")

# --- Chinese: readings the grammar gets wrong ---------------------------------------------------------------------
_ZH_ERRATA = (("第两", "第二"), ("月两日", "月二日"), ("月两号", "月二号"))


class Phone(NamedTuple):
    """A phone number as written: "+" or not, its country code (after a "+"), the groups of the rest."""

    plus: bool
    country: str
    groups: tuple[str, ...]


def phone_shape(text: str, start: int, end: int) -> Phone | None:
    """`text[start:end]` (a `_PHONE` candidate or a run of its space-separated chunks) as a phone number, or None.

    Its groups after the country code are joined by one kind of separator (after an area code in parentheses, any)
    and the last has two digits or more. Then a phone number is: a "+" and a country code before six or more digits
    ("+1 555 123 4567", "+86 13812345678"); an area code in parentheses before seven or more digits in all
    ("(555) 123-4567"); three groups or more, none over four digits, the last of four, ten to fifteen digits in all
    ("555-123-4567", "1-800-555-0199", "020 7946 0958", "138 1234 5678"), the first of three digits at most or
    starting with 0 (not "2019 2020 2021"); a trunk "0" area code and its seven or eight digits ("010-12345678"); or,
    after a phone word ("call", "tel", "number", 电话, 拨打 ... within the three words or eight characters before),
    seven to fifteen digits in one run or grouped any way but as thousands, a decimal or a date ("Call 555-0199",
    "电话：87654321"). Ranges ("3-5", "2020-2025"), dates, times, decimals, amounts, ISBNs (last group one digit) and
    counts are not."""
    written = text[start:end]
    parts = list(_PHONE_PART.finditer(written))
    plus = written.startswith("+")
    country = parts[0].group(2) if plus and len(parts) > 1 and parts[0].group(2) and len(parts[0].group()) <= 3 else ""
    if country:
        parts = parts[2:] if parts[1].group() == "(0)" else parts[1:]  # +44 (0)20 ...: the trunk 0 is not dialled
    groups = tuple(p.group(1) or p.group(2) for p in parts)
    separators = {written[a.end():b.start()] for a, b in pairwise(parts) if a.group(2)}
    if not groups or len(separators) > 1 or len(groups[-1]) < 2:
        return None
    lengths = [len(g) for g in groups]
    digits = sum(lengths)
    if plus:
        ok = 6 <= digits <= 14 if country else 7 <= digits <= 15
    elif parts[0].group(1) and len(parts) > 1:
        ok = 7 <= digits <= 15
    elif len(groups) >= 3 and lengths[-1] == 4 and max(lengths) <= 4 and (lengths[0] <= 3 or groups[0][0] == "0"):
        ok = 10 <= digits <= 15
    elif len(groups) == 2 and groups[0].startswith("0") and lengths[0] in (3, 4) and lengths[1] in (7, 8):
        ok = True
    else:
        thousands = len(groups) > 1 and lengths[0] <= 3 and set(lengths[1:]) == {3}
        decimal = len(groups) == 2 and separators == {"."}
        date = (len(groups) == 3 and (lengths[0] == 4 and max(lengths[1:]) <= 2 or lengths[2] == 4
                                      and max(lengths[:2]) <= 2))
        ok = 7 <= digits <= 15 and not (thousands or decimal or date) and _phone_context(text, start)
    return Phone(plus, country, groups) if ok else None


def _phone_context(text: str, start: int) -> bool:
    before = text[max(0, start - 40):start]
    if _PHONE_WORDS_ZH.search(before[-8:]):
        return True
    return any(w.lower() in _PHONE_WORDS_EN for w in re.findall(r"[A-Za-z]+", before)[-3:])


def _phone_spans(m: re.Match) -> Iterator[tuple[int, int, Phone]]:
    """The phone numbers in a `_PHONE` candidate: the longest run of its space-separated chunks that is one (the
    leftmost of equals), then the same on what is left either side ("Call 555-0199 2 times": "555-0199")."""
    chunks = [c.span() for c in _CHUNK.finditer(m.string, m.start(), m.end())]
    todo = [(0, len(chunks))]
    while todo:
        lo, hi = todo.pop()
        found = next(((i, i + n, p) for n in range(hi - lo, 0, -1) for i in range(lo, hi - n + 1)
                      if (p := phone_shape(m.string, chunks[i][0], chunks[i + n - 1][1]))), None)
        if found:
            i, j, phone = found
            yield chunks[i][0], chunks[j - 1][1], phone
            todo += [(lo, i), (j, hi)]


def _language_around(text: str, start: int, end: int, lang: str) -> str:
    """The language of a window spanning text[start:end] (its unit before and after; the text's if neither tells)."""
    before = _LAST_UNIT.search(text, max(0, start - 40), start)
    after = _UNIT.search(text, end, end + 40)
    around = (before.group() if before else "") + (after.group() if after else "")
    return "zh" if _CJK.search(around) else "en" if _LATIN.search(around) else lang


def _windows(text: str, units: list[tuple[int, int]], tight: bool) -> list[tuple[int, int]]:
    """(first, last) unit index of each window: every unit holding a digit with the unit after it (a unit, "am",
    "%") and the one before it, overlapping windows merged. `tight`: not the unit before when that is an English word
    other than a month (the grammars need "第", "电话", "March" or "$" before a number; "at" or "on" would only cost
    time; the English rewrite needs "in" before a year). A window stops growing at MAX_WINDOW_CHARS."""
    windows: list[list[int]] = []
    for i, (s, e) in enumerate(units):
        if not _DIGIT.search(text, s, e):
            continue
        lo, hi = i, min(len(units) - 1, i + 1)
        if i > 0:
            before = text[units[i - 1][0]:units[i - 1][1]]
            if not tight or not _WORD.fullmatch(before) or before.rstrip(".,").lower() in _MONTHS:
                lo = i - 1
        if windows and lo <= windows[-1][1]:
            if units[hi][1] - units[windows[-1][0]][0] <= MAX_WINDOW_CHARS:
                windows[-1][1] = hi
                continue
            lo = windows[-1][1] + 1  # a new window: the grammar call holds the GIL, bounded per window
        windows.append([lo, hi])
    return [(lo, hi) for lo, hi in windows]


def _or_as_written(words: Callable[[re.Match], str], m: re.Match) -> str:
    try:
        return words(m)
    except Exception:
        log.warning("num2words could not word %r; left to the grammar", m.group(), exc_info=True)
        return m.group()


def _words(spelled: str) -> str:
    """num2words' "one thousand, two hundred and thirty-four" as it is said: no commas, no hyphens (the upstream
    step would turn a hyphen into a comma, a pause inside the number)."""
    return spelled.replace(",", "").replace("-", " ")


class SpokenForm:
    """`SpokenForm()(text, lang)`: `text` (no control tokens) with its numbers and symbols in words. `lang` ("zh" or
    "en") is the text's language, used for windows that hold neither CJK characters nor Latin letters."""

    def __init__(self):
        from num2words import num2words
        from wetext import Normalizer as WeText

        self._num2words = num2words
        self._wetext = {lang: WeText(lang=lang, operator="tn").normalize for lang in ("zh", "en")}
        self._lock = threading.Lock()  # kaldifst's normalizers are not documented thread-safe
        # a phone number's digits: num2words' in English ("zero" as the English grammar's telephone rule says), the
        # Chinese grammar's own in Chinese: its reading of an 11-digit mobile number (1 as 幺) for the number, of a
        # "xxx-xxxxxxxx" landline (1 as 一) for a country code ("+1": 加一)
        self._phone_digits = {"en": {str(d): num2words(d, lang="en") for d in range(10)}}
        self._country_digits = {"en": self._phone_digits["en"]}
        for digits, written in ((self._phone_digits, "10234567890"), (self._country_digits, "012-34567890")):
            spoken = self._wetext["zh"](written)
            written = written.replace("-", "")
            if len(spoken) != len(written) or not re.fullmatch(r"[\u4e00-\u9fff]+", spoken):
                raise RuntimeError(f"the Chinese grammar reads {written!r} as {spoken!r}, not digit by digit")
            digits["zh"] = dict(zip(written, spoken, strict=True))

    def __call__(self, text: str, lang: str) -> str:
        if not _DIGIT.search(text):
            return text
        text = _PHONE.sub(lambda m: self._phones(m, lang), text.translate(_FULLWIDTH_DIGITS))
        if not _DIGIT.search(text):
            return text
        text = _each_window(text, lang, self._rewrite, tight=False)  # English numbers may leave no digit behind
        return _each_window(text, lang, self._grammar, tight=True) if _DIGIT.search(text) else text

    def _rewrite(self, window: str, lang: str) -> str:
        window = _THOUSANDS.sub(lambda m: m.group().replace(",", ""), window)
        return self._english_numbers(window) if lang == "en" else window

    def _grammar(self, window: str, lang: str) -> str:
        try:
            with self._lock:
                spoken = self._wetext[lang](window)
        except Exception as e:  # noqa: BLE001  a grammar failure must not fail the request
            return self._grammar_failed(window, lang, e)
        if lang == "zh":
            for wrong, right in _ZH_ERRATA:
                spoken = spoken.replace(wrong, right)
        return spoken

    def _grammar_failed(self, window: str, lang: str, error: Exception) -> str:
        """Each digit-bearing unit of a window the grammar failed on, on its own ("+1 555 123 4567" fails as a whole,
        not as "555"); a single unit it fails on stays as written (its digits are then removed, counted, logged)."""
        units = list(_UNIT.finditer(window))
        if len(units) == 1:
            log.warning("text normalisation failed on %r (%s: %r); left as written", window, lang, error)
            return window
        parts, pos = [], 0
        for m in units:
            parts += [window[pos:m.start()], self._grammar(m.group(), lang) if _DIGIT.search(m.group()) else m.group()]
            pos = m.end()
        return "".join(parts) + window[pos:]

    # -- phone numbers ------------------------------------------------------------------------------------------
    def telephone(self, phone: Phone, lang: str) -> str:
        """`phone` read as a phone number whatever its shape (SSML `say-as interpret-as="telephone"`)."""
        return self._phone(phone, lang)

    def _phones(self, m: re.Match, lang: str) -> str:
        """A `_PHONE` candidate with the phone numbers in it spoken, each in the language of its window."""
        out, pos = [], m.start()
        for start, end, phone in sorted(_phone_spans(m)):
            out += [m.string[pos:start], self._phone(phone, _language_around(m.string, start, end, lang))]
            pos = end
        return "".join(out) + m.string[pos:m.end()] if out else m.group()

    def _phone(self, phone: Phone, lang: str) -> str:
        if lang == "en":
            spoken = self._north_american(phone)
            if spoken:
                return spoken
        join = " ".join if lang == "en" else "".join
        digits = self._phone_digits[lang]
        groups = [join(digits[d] for d in g) for g in phone.groups]
        if phone.country:
            groups.insert(0, join(self._country_digits[lang][d] for d in phone.country))
        if phone.plus:
            groups[0] = ("plus " if lang == "en" else "加") + groups[0]
        return (", " if lang == "en" else "，").join(groups)

    def _north_american(self, phone: Phone) -> str | None:
        """The English grammar's reading of a number of the North American shape (area code, three digits, four
        digits), which its telephone rule reads when written "+1 555-123-4567" or "1-800-555-0199" ("eight hundred");
        None for any other shape."""
        groups = phone.groups
        trunk = not phone.plus and len(groups) == 4 and groups[0] == "1"
        if [len(g) for g in groups[trunk:]] != [3, 3, 4] or (phone.plus and not phone.country):
            return None
        written = (f"+{phone.country} " if phone.plus else "1-" if trunk else "") + "-".join(groups[trunk:])
        try:
            with self._lock:
                spoken = self._wetext["en"](written)
        except Exception:  # the digit words below read it as well
            log.debug("the English grammar failed on %r", written, exc_info=True)
            return None
        return None if _DIGIT.search(spoken) else spoken

    # -- English numbers through num2words ------------------------------------------------------------------------
    def _cardinal(self, integer: str, fraction: str | None = None) -> str:
        words = self._num2words(int(integer), lang="en")
        if fraction:
            words += " point " + " ".join(self._num2words(int(d), lang="en") for d in fraction)
        return _words(words)

    def year(self, year: int) -> str:
        """An English year in words as it is said ("twenty twenty four"; SSML `say-as interpret-as="date"`)."""
        return self._year(year)

    def _year(self, year: int) -> str:
        return _words(self._num2words(year, lang="en", to="year"))

    def _english_numbers(self, text: str) -> str:
        for pattern, words in ((_MONEY, self._money), (_DECADE, self._decade), (_BIG, self._big)):
            text = pattern.sub(lambda m, words=words: _or_as_written(words, m), text)
        return _METRE.sub(" meters", text)

    def _money(self, m: re.Match) -> str:
        symbol, integer, fraction, scale = m.groups()
        one, many, minor_one, minor_many = _CURRENCY[symbol]
        if scale:
            return f"{self._cardinal(integer, fraction)} {scale} {many}"
        major = int(integer)
        if fraction is not None and (minor_one is None or len(fraction) > 2):  # no minor unit, or not one: a decimal
            return f"{self._cardinal(integer, fraction)} {many}"
        minor = int(fraction.ljust(2, "0")) if fraction else 0
        major_words = f"{self._cardinal(integer)} {one if major == 1 else many}"
        if not minor:
            return major_words
        minor_words = f"{self._cardinal(str(minor))} {minor_one if minor == 1 else minor_many}"
        return minor_words if major == 0 else f"{major_words} and {minor_words}"

    def _decade(self, m: re.Match) -> str:
        words = self._year(int(m.group(1))).split()
        last = words[-1]
        words[-1] = last[:-1] + "ies" if last.endswith("y") else last + "s"
        return " ".join(words)

    def _big(self, m: re.Match) -> str:
        integer, fraction = m.groups()
        if fraction is None and len(integer) == 4 and 1000 <= int(integer) <= 2999 and self._year_context(m):
            return self._year(int(integer))
        return self._cardinal(integer, fraction)

    @staticmethod
    def _year_context(m: re.Match) -> bool:
        before = _LAST_WORD.search(m.string, 0, m.start())
        if before:
            word = before.group(1)
            if re.fullmatch(r"\d{1,2}(?:st|nd|rd|th)?,", word):  # "March 3, 2021"
                return True
            if word.strip(".,;:()").lower() in _YEAR_BEFORE:
                return True
        return bool(_ERA_AFTER.match(m.string, m.end()))


def _each_window(text: str, lang: str, fn: Callable[[str, str], str], tight: bool) -> str:
    """`text` with each window replaced by fn(window, the window's language)."""
    units = [m.span() for m in _UNIT.finditer(text)]
    out: list[str] = []
    pos = 0
    for lo, hi in _windows(text, units, tight):
        start, end = units[lo][0], units[hi][1]
        window = text[start:end]
        out += [text[pos:start], fn(window, "zh" if _CJK.search(window) else "en" if _LATIN.search(window) else lang)]
        pos = end
    out.append(text[pos:])
    return "".join(out)


_default: SpokenForm | None = None
_default_lock = threading.Lock()


def default() -> SpokenForm:
    """The process's SpokenForm (the grammars are loaded once: ~0.3 s, ~45 MB)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = SpokenForm()
        return _default


def spoken_form(text: str, lang: str | None = None, spoken: Callable[[str, str], str] | None = None) -> str:
    """`text` with numbers and symbols in words; control tokens ([uv_break] ...) are kept as they are.
    `lang`: "zh" or "en" (None: upstream's detection on the whole text)."""
    from .text import TAG_RE, detect_language

    spoken = spoken or default()
    lang = lang or detect_language(text)
    out, pos = [], 0
    for m in TAG_RE.finditer(text):
        out += [spoken(text[pos:m.start()], lang), m.group()]
        pos = m.end()
    out.append(spoken(text[pos:], lang))
    return "".join(out)
