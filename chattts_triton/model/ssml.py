"""A subset of SSML 1.1 as ChatTTS can say it: a `<speak>` document → segments of plain text (ChatTTS control tokens
allowed), each with the voice and speed it is spoken in. docs/ssml.md is the user's reference; this is the rule.

- Parsed by defusedxml: no document type declaration (so no entity of any kind, internal or external), no external
  reference; the predefined entities (`&amp;` ...) and character references are plain XML and are read.
- Elements and attributes outside `ELEMENTS` are refused naming them (`SSMLError`, an InputError: a 400 on the
  gateway, INVALID_ARGUMENT over gRPC), as are bad values, elements nested deeper than `MAX_DEPTH`, a break longer
  than `MAX_BREAK_MS` and breaks longer than `MAX_TOTAL_BREAK_MS` in all.
- `break`: silence of its length where the audio is joined from pieces (the gateway, `render(breaks="silence")`); a
  ChatTTS pause token where one text is one generation (gRPC, `breaks="tokens"`): `[uv_break]` up to
  `TOKEN_BREAK_SPLIT_MS`, `[lbreak]` beyond, none for a zero break. ChatTTS decides how long a token pauses.
- `prosody rate`: a factor of the request's speed; the product is a `[speed_N]` of the prompt (`speed_token`, the
  same table the gateway's OpenAI `speed` uses). One generation has one speed: a segment per rate.
- `voice name`: the voice of a segment (a name of the voice registry or a seed number; the server resolves it).
- `sub alias`: the alias is said. `say-as`: the content in words through the spoken-form normaliser
  (`spoken.SpokenForm`), in the language of the innermost `xml:lang`, else the one upstream's rule detects in the
  enclosing sentence or paragraph (or the document).
- `p`, `s`: each ends as a sentence: a full stop ("." or "。", by its last character) where it has none.
- `lang` / `xml:lang`: zh or en (ChatTTS speaks these two); it decides the language of `say-as`. ChatTTS itself
  reads Chinese and English by their characters.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import TYPE_CHECKING

from .text import InputError, detect_language

if TYPE_CHECKING:
    from .spoken import SpokenForm

SSML_NS = "http://www.w3.org/2001/10/synthesis"
XML_NS = "http://www.w3.org/XML/1998/namespace"
XSI_NS = "http://www.w3.org/2001/XMLSchema-instance"
MAX_DEPTH = 32  # elements inside elements; real documents nest three or four deep
MAX_BREAK_MS = 10_000
MAX_TOTAL_BREAK_MS = 60_000  # silence a document may ask for in all
# break strength -> milliseconds (Azure's table: documents written for it pause as long here)
BREAK_STRENGTH_MS = {"none": 0, "x-weak": 250, "weak": 500, "medium": 750, "strong": 1000, "x-strong": 1250}
DEFAULT_BREAK = "medium"  # <break/> without attributes
TOKEN_BREAK_SPLIT_MS = 500  # breaks=tokens: up to this [uv_break], beyond [lbreak]
SHORT_BREAK_TOKEN, LONG_BREAK_TOKEN = "[uv_break]", "[lbreak]"
# rate words -> factor of the request's speed (ChatTTS has ten speeds: nearby factors share one)
RATE_WORDS = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.5, "x-fast": 2.0}
MIN_RATE, MAX_RATE = 0.25, 4.0
LANGUAGES = {"zh": "zh", "cmn": "zh", "en": "en"}  # BCP 47 primary subtag -> the normaliser's language

# element -> the attributes it takes ("xml:lang" is the XML namespace's lang, "xsi:schemaLocation" is ignored)
ELEMENTS: dict[str, frozenset[str]] = {
    "speak": frozenset({"version", "xml:lang", "xsi:schemaLocation"}),
    "p": frozenset({"xml:lang"}),
    "s": frozenset({"xml:lang"}),
    "lang": frozenset({"xml:lang"}),
    "voice": frozenset({"name"}),
    "prosody": frozenset({"rate"}),
    "break": frozenset({"time", "strength"}),
    "sub": frozenset({"alias"}),
    "say-as": frozenset({"interpret-as", "format"}),
}
REQUIRED = {"lang": "xml:lang", "voice": "name", "sub": "alias", "say-as": "interpret-as"}
TEXT_ONLY = ("sub", "say-as", "break")  # no element inside (break: nothing at all)
SAY_AS = ("characters", "spell-out", "cardinal", "number", "ordinal", "digits", "date", "time", "telephone")
DATE_FORMATS = ("mdy", "dmy", "ymd", "md", "dm", "ym", "my", "y", "m", "d")
TIME_FORMATS = ("hms24", "hms12")

# a document: <speak ...>, or markup before it (an XML declaration; a DTD, which is refused)
_START = re.compile(r"\A\s*(?:<\?xml[\s?]|<!DOCTYPE[\s\[>]|<speak[\s>/])")
_SPACE = re.compile(r"\s+")
_TIME = re.compile(r"\A(\d+(?:\.\d+)?)\s*(ms|s)\Z")
_PERCENT = re.compile(r"\A([+-]?)(\d+(?:\.\d+)?)%\Z")
_NUMBER = re.compile(r"\A\d+(?:\.\d+)?\Z")
_LANG_TAG = re.compile(r"\A([A-Za-z]{2,3})(?:-[A-Za-z0-9]{1,8})*\Z")
_CJK = re.compile(r"[\u4e00-\u9fff]")
_SPEAKABLE = re.compile(r"[^\W_]")  # a letter or a digit
_SPACE_BEFORE_MARK = re.compile(r" ([.,!?;:。，！？；：、])")  # "four ." where a say-as's words met a full stop
_SENTENCE_END = re.compile(r"[.!?。！？…]['\"’”」』)）]*\Z")
_TRAILING_TOKENS = re.compile(r"(?:\s*\[[^\[\]]*\])*\s*\Z")
_CARDINAL = re.compile(r"\A([+-]?)(\d{1,3}(?:,\d{3})+|\d{1,15})(?:\.(\d{1,15}))?\Z")
_ORDINAL = re.compile(r"\A(\d{1,15})(?:st|nd|rd|th|\.)?\Z", re.IGNORECASE)
_DIGITS_OK = re.compile(r"\A[\d\s\-.]+\Z")
_CLOCK = re.compile(r"\A(\d{1,2})[:：.h点](\d{2})(?:[:：.](\d{2}))?\s*([ap]\.?\s?m\.?)?\Z", re.IGNORECASE)
_PHONE = re.compile(r"\A(\+)?[\d\s().\-]+\Z")
_PHONE_GROUP = re.compile(r"\d+")
_DATE_PART = re.compile(r"\d+|[A-Za-z]+")
_MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december")
DIGIT_WORDS = {"zh": dict(zip("0123456789", "零一二三四五六七八九", strict=True)),
               "en": dict(zip("0123456789", "zero one two three four five six seven eight nine".split(), strict=True))}


class SSMLError(InputError):
    """SSML that cannot be served; the message names the element, attribute or value at fault."""


# --- speed ---------------------------------------------------------------------------------------------------
# speed factor (1.0 normal) -> ChatTTS [speed_N] (0-9, upstream's default 5): N grows with the logarithm of the factor,
# N = 5 + 2.5 log2(factor), rounded and held to 0-9 (0.25 -> 0, 0.5 -> 3, 1 -> 5, 2 -> 8, 4 -> 9). The gateway's
# OpenAI `speed` and SSML's `prosody rate` both go through it.
SPEED_UPPER_BOUNDS = tuple(2 ** ((n - 4.5) / 2.5) for n in range(9))  # factor < bound[N] -> [speed_N]
SPEED_TOKEN = re.compile(r"\[speed_(\d)\]")
DEFAULT_SPEED = 5  # a prompt without [speed_N]: the model's own pace, upstream's default prompt [speed_5]


def speed_token(speed: float) -> str:
    n = next((i for i, bound in enumerate(SPEED_UPPER_BOUNDS) if speed < bound), len(SPEED_UPPER_BOUNDS))
    return f"[speed_{n}]"


def speed_factor(n: int) -> float:
    """The factor [speed_N] stands for (speed_token's inverse at the middle of each step)."""
    return 2 ** ((n - DEFAULT_SPEED) / 2.5)


def with_rate(prompt: str, rate: float) -> str:
    """`prompt` with its [speed_N] (or [speed_5] where it has none) scaled by `rate`."""
    if rate == 1.0:
        return prompt
    m = SPEED_TOKEN.search(prompt)
    token = speed_token(speed_factor(int(m.group(1)) if m else DEFAULT_SPEED) * rate)
    return prompt[:m.start()] + token + prompt[m.end():] if m else token + prompt


# --- the parsed document -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Context:
    """What an enclosing element decided for the text inside it."""

    voice: str | None = None
    rate: float = 1.0
    lang: str | None = None  # the innermost xml:lang ("zh" / "en")
    detected: str = "zh"  # upstream's detection on the enclosing s, p or speak: say-as's language without xml:lang

    @property
    def say_as_lang(self) -> str:
        return self.lang or self.detected


@dataclass(frozen=True)
class Text:
    text: str
    ctx: Context


@dataclass(frozen=True)
class SayAs:
    kind: str  # one of SAY_AS, aliases resolved: characters, cardinal, ordinal, digits, date, time, telephone
    value: tuple  # what the content was parsed into (per kind, see _say_as)
    ctx: Context


@dataclass(frozen=True)
class Pause:
    ms: int


@dataclass(frozen=True)
class SentenceEnd:
    """The start or end of a p or s: what came before ends as a sentence."""


Item = Text | SayAs | Pause | SentenceEnd


@dataclass(frozen=True)
class Document:
    items: tuple[Item, ...]

    @property
    def needs_spoken(self) -> bool:
        """Whether rendering runs the spoken-form grammars (a say-as other than characters and digits)."""
        return any(isinstance(i, SayAs) and i.kind not in ("characters", "digits") for i in self.items)


@dataclass(frozen=True)
class Segment:
    """Text spoken in one voice at one rate; `pause_after_ms`: the silence a break asks for after it (None: none
    asked, the gateway's usual pause between pieces)."""

    text: str
    voice: str | None = None
    rate: float = 1.0
    pause_after_ms: int | None = None


@dataclass(frozen=True)
class Speech:
    segments: tuple[Segment, ...]
    lead_ms: int = 0  # silence before the first segment (breaks before any text)


def is_ssml(text: str) -> bool:
    """Whether a TEXT / input is an SSML document: it starts with `<speak`, an XML declaration or a document type
    declaration (refused by `parse`, not read as plain text)."""
    return isinstance(text, str) and bool(_START.match(text))


# --- parsing -------------------------------------------------------------------------------------------------
def parse(text: str) -> Document:
    """An SSML document → its items, every element, attribute and value checked (SSMLError naming what is wrong)."""
    import defusedxml
    import defusedxml.ElementTree as ET

    try:
        root = ET.fromstring(text, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except defusedxml.DTDForbidden:
        raise SSMLError("SSML must not have a document type declaration (<!DOCTYPE ...>): entities are not "
                        "expanded here") from None
    except defusedxml.EntitiesForbidden as e:
        raise SSMLError(f"SSML must not declare entities (entity {e.name!r})") from None
    except defusedxml.ExternalReferenceForbidden:
        raise SSMLError("SSML must not reference external resources") from None
    except ET.ParseError as e:
        raise SSMLError(f"SSML is not well-formed XML: {e}") from None
    if _name(root) != "speak":
        raise SSMLError(f"SSML's root element must be <speak>, got <{_name(root)}>")
    _check_depth(root)  # before anything recursive walks the tree
    walker = _Walker(root)
    walker.element(root, Context())
    return Document(tuple(walker.items))


def _check_depth(root) -> None:
    stack = [(root, 1)]
    while stack:
        el, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SSMLError(f"SSML nests elements deeper than {MAX_DEPTH}")
        stack.extend((child, depth + 1) for child in el)


def _name(el) -> str:
    tag = el.tag
    if not isinstance(tag, str):
        raise SSMLError("SSML holds a node that is not an element")  # ElementTree drops comments and PIs
    if tag.startswith("{"):
        ns, local = tag[1:].split("}", 1)
        if ns != SSML_NS:
            raise SSMLError(f"SSML element <{local}> of namespace {ns!r} is not supported; supported: "
                            f"{', '.join(sorted(ELEMENTS))} (namespace {SSML_NS} or none)")
        return local
    return tag


def _attributes(el, name: str) -> dict[str, str]:
    out = {}
    for key, value in el.attrib.items():
        if key.startswith("{"):
            ns, local = key[1:].split("}", 1)
            prefix = {XML_NS: "xml", XSI_NS: "xsi"}.get(ns)
            attr = f"{prefix}:{local}" if prefix else f"{{{ns}}}{local}"
        else:
            attr = key
        if attr not in ELEMENTS[name]:
            allowed = ", ".join(sorted(ELEMENTS[name])) or "none"
            raise SSMLError(f"SSML <{name}> attribute {attr!r} is not supported; supported: {allowed}")
        out[attr] = value
    missing = REQUIRED.get(name)
    if missing and missing not in out:
        raise SSMLError(f"SSML <{name}> needs the attribute {missing!r}")
    return out


class _Walker:
    def __init__(self, root):
        self.root = root
        self.items: list[Item] = []
        self.total_break_ms = 0

    def element(self, el, ctx: Context) -> None:
        name = _name(el)
        if name not in ELEMENTS:
            raise SSMLError(f"SSML element <{name}> is not supported; supported: {', '.join(sorted(ELEMENTS))}")
        if name == "speak" and el is not self.root:
            raise SSMLError("SSML <speak> may only be the root element")
        attrs = _attributes(el, name)
        if name in TEXT_ONLY:
            if len(el):
                raise SSMLError(f"SSML <{name}> may not contain elements, found <{_name(el[0])}>")
            if name == "break" and (el.text or "").strip():
                raise SSMLError("SSML <break> must be empty")
        ctx = self.context(name, attrs, el, ctx)
        if name == "break":
            self.pause(attrs)
        elif name == "sub":
            self.text(attrs["alias"], ctx)
        elif name == "say-as":
            self.items.append(_say_as(attrs, el.text or "", ctx))
        else:
            block = name in ("p", "s")
            if block:
                self.items.append(SentenceEnd())
            self.text(el.text, ctx)
            for child in el:
                self.element(child, ctx)
                self.text(child.tail, ctx)
            if block:
                self.items.append(SentenceEnd())

    def context(self, name: str, attrs: dict[str, str], el, ctx: Context) -> Context:
        if "xml:lang" in attrs:
            ctx = replace(ctx, lang=_language(attrs["xml:lang"], name))
        if name in ("speak", "p", "s"):
            ctx = replace(ctx, detected=detect_language("".join(el.itertext())))
        if name == "voice":
            ctx = replace(ctx, voice=_voice(attrs["name"]))
        if name == "prosody" and "rate" in attrs:
            ctx = replace(ctx, rate=ctx.rate * _rate(attrs["rate"]))
        return ctx

    def text(self, text: str | None, ctx: Context) -> None:
        if text:
            self.items.append(Text(_SPACE.sub(" ", text), ctx))

    def pause(self, attrs: dict[str, str]) -> None:
        if "time" in attrs:  # SSML: time wins over strength
            ms = _break_time(attrs["time"])
        else:
            strength = attrs.get("strength", DEFAULT_BREAK)
            if strength not in BREAK_STRENGTH_MS:
                raise SSMLError(f"SSML <break strength={strength!r}>: use one of {', '.join(BREAK_STRENGTH_MS)}")
            ms = BREAK_STRENGTH_MS[strength]
        self.total_break_ms += ms
        if self.total_break_ms > MAX_TOTAL_BREAK_MS:
            raise SSMLError(f"SSML breaks add up to more than {MAX_TOTAL_BREAK_MS // 1000} s of silence")
        self.items.append(Pause(ms))


def _break_time(value: str) -> int:
    m = _TIME.match(value.strip())
    if not m:
        raise SSMLError(f"SSML <break time={value!r}>: give a duration like '500ms' or '1.5s'")
    ms = float(m.group(1)) * (1000 if m.group(2) == "s" else 1)
    if ms > MAX_BREAK_MS:
        raise SSMLError(f"SSML <break time={value!r}> is longer than {MAX_BREAK_MS // 1000} s")
    return int(round(ms))


def _rate(value: str) -> float:
    v = value.strip()
    if v in RATE_WORDS:
        rate = RATE_WORDS[v]
    elif _PERCENT.match(v):
        sign, number = _PERCENT.match(v).groups()
        # "150%" is 1.5 times the enclosing rate; "+20%" / "-20%" a change by that much
        rate = 1 + float(number) / 100 * (-1 if sign == "-" else 1) if sign else float(number) / 100
    elif _NUMBER.match(v):
        rate = float(v)  # a multiple of the enclosing rate (as Azure takes it)
    else:
        raise SSMLError(f"SSML <prosody rate={value!r}>: use {', '.join(RATE_WORDS)}, a percentage ('80%', '+20%') or "
                        f"a multiple ('1.5')")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise SSMLError(f"SSML <prosody rate={value!r}> must be within {MIN_RATE:g}-{MAX_RATE:g} times the normal rate")
    return rate


def _language(tag: str, element: str) -> str:
    m = _LANG_TAG.match(tag.strip())
    lang = LANGUAGES.get(m.group(1).lower()) if m else None
    if lang is None:
        raise SSMLError(f"SSML <{element} xml:lang={tag!r}>: ChatTTS speaks Chinese and English (zh-CN, en-US, ...)")
    return lang


def _voice(name: str) -> str:
    name = name.strip()
    if not name or len(name) > 64 or _SPACE.search(name):
        raise SSMLError(f"SSML <voice name={name!r}>: a voice name is 1-64 characters without spaces")
    return name


# --- say-as --------------------------------------------------------------------------------------------------
def _say_as(attrs: dict[str, str], content: str, ctx: Context) -> SayAs:
    kind = attrs["interpret-as"]
    fmt = attrs.get("format")
    if kind not in SAY_AS:
        raise SSMLError(f"SSML <say-as interpret-as={kind!r}> is not supported; supported: {', '.join(SAY_AS)}")
    kind = {"spell-out": "characters", "number": "cardinal"}.get(kind, kind)
    if fmt is not None and kind not in ("date", "time"):
        raise SSMLError(f"SSML <say-as interpret-as={kind!r}> takes no format")
    text = _SPACE.sub(" ", content).strip()
    where = f"SSML <say-as interpret-as={attrs['interpret-as']!r}>"
    if not text:
        raise SSMLError(f"{where} is empty")
    if kind == "characters":
        value: tuple = (text,)
    elif kind == "digits":
        if not _DIGITS_OK.match(text):
            raise SSMLError(f"{where}: {text!r} is not digits")
        value = tuple(c for c in text if c.isdigit())
    elif kind == "cardinal":
        m = _CARDINAL.match(text.replace(" ", ""))
        if not m:
            raise SSMLError(f"{where}: {text!r} is not a number (digits, optionally signed, grouped by commas, "
                            f"with a decimal point; at most 15 digits)")
        value = (m.group(1), m.group(2).replace(",", ""), m.group(3) or "")
    elif kind == "ordinal":
        m = _ORDINAL.match(text)
        if not m or int(m.group(1)) == 0:
            raise SSMLError(f"{where}: {text!r} is not a positive whole number")
        value = (int(m.group(1)),)
    elif kind == "date":
        value = _date(text, fmt, where)
    elif kind == "time":
        value = _time(text, fmt, where)
    else:
        value = _phone(text, where)
    return SayAs(kind, value, ctx)


def _date(text: str, fmt: str | None, where: str) -> tuple[int | None, int | None, int | None]:
    parts = _DATE_PART.findall(text)
    if fmt is None:  # ISO order when the year comes first: 2024-03-05, 2024-03, 2024
        if not parts or not (parts[0].isdigit() and len(parts[0]) == 4) or len(parts) > 3:
            raise SSMLError(f"{where}: {text!r} needs a format ({', '.join(DATE_FORMATS)}) unless it is year first "
                            f"(2024-03-05)")
        fmt = "ymd"[:len(parts)]
    if fmt not in DATE_FORMATS:
        raise SSMLError(f"{where} format={fmt!r}: use one of {', '.join(DATE_FORMATS)}")
    if len(parts) != len(fmt):
        raise SSMLError(f"{where} format={fmt!r}: {text!r} does not have {len(fmt)} part(s)")
    found: dict[str, int] = {}
    for key, part in zip(fmt, parts, strict=True):
        if key == "m" and not part.isdigit():
            months = [i for i, name in enumerate(_MONTHS, 1) if name.startswith(part.lower()) and len(part) >= 3]
            if len(months) != 1:
                raise SSMLError(f"{where}: {part!r} is not a month")
            found[key] = months[0]
        elif not part.isdigit() or len(part) > 4:
            raise SSMLError(f"{where}: {part!r} is not a number of the date")
        else:
            found[key] = int(part)
    y, m, d = found.get("y"), found.get("m"), found.get("d")
    if m is not None and not 1 <= m <= 12 or d is not None and not 1 <= d <= 31 or y is not None and y == 0:
        raise SSMLError(f"{where}: {text!r} is no date")
    try:
        datetime.date(y or 2000, m or 1, d or 1)  # 2000: a leap year, so 02-29 without a year is a date
    except ValueError:
        raise SSMLError(f"{where}: {text!r} is no date") from None
    return y, m, d


def _time(text: str, fmt: str | None, where: str) -> tuple[int, int, int | None, str | None]:
    if fmt is not None and fmt not in TIME_FORMATS:
        raise SSMLError(f"{where} format={fmt!r}: use one of {', '.join(TIME_FORMATS)}")
    m = _CLOCK.match(text)
    if not m:
        raise SSMLError(f"{where}: {text!r} is not a time like 14:30, 14:30:15 or 2:30 pm")
    h, mi, s = int(m.group(1)), int(m.group(2)), m.group(3)
    half = m.group(4) and ("am" if m.group(4).lower().startswith("a") else "pm")
    if fmt == "hms12" and not half:
        raise SSMLError(f"{where} format='hms12': {text!r} needs am or pm")
    if fmt == "hms24" and half:
        raise SSMLError(f"{where} format='hms24': {text!r} has am or pm")
    if (not 1 <= h <= 12 if half else not 0 <= h <= 23) or mi > 59 or (s is not None and int(s) > 59):
        raise SSMLError(f"{where}: {text!r} is no time of day")
    return h, mi, int(s) if s is not None else None, half


def _phone(text: str, where: str):
    from .spoken import Phone

    m = _PHONE.match(text)
    groups = tuple(_PHONE_GROUP.findall(text))
    if not m or not groups or sum(map(len, groups)) > 20:
        raise SSMLError(f"{where}: {text!r} is not a phone number (digits, '+', spaces, dashes, dots, parentheses)")
    plus = bool(m.group(1))
    country = groups[0] if plus and len(groups) > 1 and len(groups[0]) <= 3 else ""
    return (Phone(plus, country, groups[1:] if country else groups),)


def _digits(digits, lang: str) -> str:
    return (" " if lang == "en" else "").join(DIGIT_WORDS[lang][d] for d in digits)


def _characters(text: str, lang: str) -> str:
    parts = [DIGIT_WORDS[lang][c] if c.isdigit() and c in DIGIT_WORDS[lang] else c.upper() for c in text
             if c.isalnum()]
    out = ""
    for part in parts:  # letters apart; Chinese characters and Chinese digit words together
        out += part if not out or (lang == "zh" and _CJK.match(part) and _CJK.match(out[-1])) else " " + part
    return out


def say(item: SayAs, spoken: SpokenForm | None) -> str:
    """A say-as element's content in words."""
    lang = item.ctx.say_as_lang
    if item.kind == "characters":
        return _characters(item.value[0], lang)
    if item.kind == "digits":
        return _digits(item.value, lang)
    if spoken is None:
        raise RuntimeError("say-as needs the spoken-form normaliser (Document.needs_spoken)")
    if item.kind == "cardinal":
        sign, integer, fraction = item.value
        return spoken(f"{sign}{int(integer):,}" + (f".{fraction}" if fraction else ""), lang)
    if item.kind == "ordinal":
        n = item.value[0]
        suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
        return spoken(f"{n}{suffix}" if lang == "en" else f"第{n}", lang)
    if item.kind == "date":
        return _say_date(*item.value, lang, spoken)
    if item.kind == "time":
        h, mi, s, half = item.value
        clock = f"{h}:{mi:02d}" + (f":{s:02d}" if s is not None else "")
        if lang == "zh":
            return spoken(({"am": "上午", "pm": "下午"}.get(half, "")) + clock, lang)
        return spoken(clock + (f" {half}" if half else ""), lang)
    return spoken.telephone(item.value[0], lang)


def _say_date(y: int | None, m: int | None, d: int | None, lang: str, spoken: SpokenForm) -> str:
    if lang == "zh":
        return spoken("".join(f"{v}{unit}" for v, unit in ((y, "年"), (m, "月"), (d, "日")) if v is not None), lang)
    month = _MONTHS[m - 1].capitalize() if m is not None else None
    if month and d is not None:  # the grammar reads "March 5, 2024" as "the fifth of march, twenty twenty four"
        return spoken(f"{month} {d}" + (f", {y}" if y is not None else ""), lang)
    if month:
        return month + (f" {spoken.year(y)}" if y is not None else "")
    if d is not None:
        return say(SayAs("ordinal", (d,), Context(lang="en")), spoken)
    return spoken.year(y)


# --- rendering -----------------------------------------------------------------------------------------------
@dataclass
class _Open:
    parts: list[str] = field(default_factory=list)
    voice: str | None = None
    rate: float = 1.0

    @property
    def text(self) -> str:
        return _SPACE_BEFORE_MARK.sub(r"\1", _SPACE.sub(" ", "".join(self.parts))).strip()


def render(doc: Document, spoken: SpokenForm | None = None, breaks: str = "silence") -> Speech:  # noqa: C901  its two closures (silence, close) count in: the body is one pass over the items
    """The document as segments: a new one where the voice or the rate changes and, with breaks="silence", at each
    break (its silence after the segment before it); with breaks="tokens" a break is a pause token in the text.
    `spoken`: the normaliser say-as needs (required when `doc.needs_spoken`)."""
    if breaks not in ("silence", "tokens"):
        raise ValueError(f"breaks must be 'silence' or 'tokens', got {breaks!r}")
    segments: list[Segment] = []
    lead = 0
    cur = _Open()

    def silence(ms: int) -> None:  # after the last segment, or before the first
        nonlocal lead
        if segments:
            segments[-1] = replace(segments[-1], pause_after_ms=(segments[-1].pause_after_ms or 0) + ms)
        else:
            lead += ms

    def close(pause: int | None = None, final: bool = False) -> None:
        nonlocal cur
        text = cur.text
        if text and _only_tokens(text):  # control tokens alone go with the text after them (at the end: before)
            if final and segments:
                segments[-1] = replace(segments[-1], text=f"{segments[-1].text} {text}")
                text = ""
            elif not final:
                if pause is not None:
                    silence(pause)
                return
        if text:
            segments.append(Segment(text, cur.voice, cur.rate, pause))
        elif pause is not None:
            silence(pause)
        cur = _Open(voice=cur.voice, rate=cur.rate)

    for item in doc.items:
        if isinstance(item, Pause):
            if breaks == "silence":
                if item.ms:
                    close(item.ms)
            elif item.ms:
                cur.parts.append(f" {SHORT_BREAK_TOKEN if item.ms <= TOKEN_BREAK_SPLIT_MS else LONG_BREAK_TOKEN} ")
            continue
        if isinstance(item, SentenceEnd):
            _end_sentence(cur)
            continue
        switch = (item.ctx.voice, item.ctx.rate) != (cur.voice, cur.rate)
        if switch and isinstance(item, Text) and not _SPEAKABLE.search(item.text):
            cur.parts.append(item.text)  # punctuation and spaces stay with the text before them
            continue
        if switch:
            close()
            cur.voice, cur.rate = item.ctx.voice, item.ctx.rate
        if isinstance(item, Text):
            cur.parts.append(item.text)
        else:  # English words apart from their neighbours; Chinese ones joined to them
            words = say(item, spoken)
            cur.parts.append(f" {words} " if item.ctx.say_as_lang == "en" else words)
    close(final=True)
    return Speech(tuple(segments), lead)


def _only_tokens(text: str) -> bool:
    return not _TRAILING_TOKENS.sub("", text).strip()


def _end_sentence(cur: _Open) -> None:
    text = "".join(cur.parts)
    body = _TRAILING_TOKENS.sub("", text)
    if not body.strip():
        return
    tail = text[len(body):]
    body = body.rstrip()
    if not _SENTENCE_END.search(body):
        body += "。" if _CJK.match(body[-1]) else "."
    cur.parts = [body, tail, " "]


def single(speech: Speech) -> Segment:
    """The one segment of a document spoken as one text (gRPC: one TEXT, one speaker, one prompt)."""
    segments = speech.segments
    if not segments:
        raise SSMLError("SSML has nothing to speak")
    if len(segments) == 1:
        return segments[0]
    for a, b in pairwise(segments):  # segments are cut where the voice or the rate changes
        if a.voice != b.voice:
            raise SSMLError(f"SSML switches voice ({a.voice or 'the request’s'} to {b.voice or 'the request’s'}): one "
                            f"request speaks in one voice; send each voice's part as a request of its own (the "
                            f"speech gateway does so)")
        if a.rate != b.rate:
            raise SSMLError(f"SSML switches <prosody rate> ({a.rate:g} to {b.rate:g} times): one request speaks at one "
                            f"speed; send each part as a request of its own (the speech gateway does so)")
    raise AssertionError("render cuts segments only where the voice or the rate changes")
