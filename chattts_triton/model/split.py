"""Long text -> pieces ChatTTS speaks whole: `split_for_synthesis(text, max_frames=DEFAULT_MAX_FRAMES)`.

ChatTTS drops words once an utterance passes ~30 s of audio, and a request ends at MAX_NEW_TOKENS code frames
(2048 ≈ 43.7 s) whatever is left to say. A text is therefore sent as pieces whose estimated length stays under a
frame budget:

1. it is cut at sentence ends (。！？!?… a newline, a "." before a space), as upstream's `Chat.infer` split;
2. a sentence over the budget is cut at clause punctuation (，、,;；:：—), clauses packed greedily up to the budget;
   a clause still over it between words (English) or characters (Chinese);
3. a piece under `min_frames` (a very short sentence such as "好。" or "OK.") joins a neighbour when the two fit.

A cut never falls inside a control token ([uv_break]) or inside a number with what belongs to its spoken form
("12.5%", "10:30", "2026-12-02", "March 3, 2021", "5 km", "$ 12"): the server reads each piece on its own. A single
such unit longer than the budget (a 500-digit number) stays whole.

The estimate (`estimate_frames`) counts syllables: a CJK character is one, an English word its vowel groups, an
acronym one per letter, a digit two (its words are longer than it: "45" is "forty five", "四十五"); at
FRAMES_PER_SYLLABLE (≈ 3.9 syllables a second, the slow end of read Mandarin and English), plus pauses for
punctuation and break tokens. It was not calibrated on ChatTTS's real weights (not available here): the default
budget is half of MAX_NEW_TOKENS, so an estimate 40 % short still ends under the ~30 s where words start to drop.

No model, tokenizer or normaliser is needed: the client and the gateway call this on raw text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..config import LIMITS, SAMPLE_RATE, SAMPLES_PER_CODE

FRAMES_PER_SECOND = SAMPLE_RATE / SAMPLES_PER_CODE  # 46.875 code frames a second
FRAMES_PER_SYLLABLE = 12  # ≈ 3.9 syllables a second
DEFAULT_MAX_FRAMES = LIMITS.max_new_tokens // 2  # 1024 frames ≈ 21.8 s
DEFAULT_MIN_FRAMES = 64  # ≈ 1.4 s: four syllables and a full stop

CLAUSE_PAUSE_FRAMES = 12  # ≈ 0.25 s at a comma
SENTENCE_PAUSE_FRAMES = 19  # ≈ 0.4 s at a full stop
TOKEN_FRAMES = {"uv_break": 14, "lbreak": 14, "laugh": 24, "break": 14}  # control tokens that take time to say

_TOKEN = re.compile(r"\[[^\[\]]*\]")
# a number and what belongs to its spoken form: sign or currency before it, its inner punctuation ("1,234.5",
# "10:30", "2026-12-02", "3-5", "March 3, 2021") and a unit, percent or degree after it
_NUMBER = re.compile(r"(?:[$€£¥￥+\-−]\s?)?\d+(?:(?:[.:/\-~～–—]|,\s?)\d+)*"
                     r"(?:\s?(?:[A-Za-z]{1,3}(?![A-Za-z])|[%‰℃]|°[CF]?))?")
_SENTENCE_END = re.compile(r"\n|[。！？!?…]+[」』”’)）\]】\"']*|\.(?=\s|$)")
_CLAUSE_END = re.compile(r"[，,、;；:：—]+")
_SPACE = re.compile(r"\s+")
_CJK = re.compile(r"[\u4e00-\u9fff]")
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
_VOWELS = re.compile(r"[aeiouy]+")
_DIGITS = re.compile(r"\d")
_SYMBOLS = re.compile(r"[%‰℃$€£¥￥°]")
_CLAUSE_MARKS = re.compile(r"[，,、;；:：—]")
_SENTENCE_MARKS = re.compile(r"[。！？!?….]")

Span = tuple[int, int]


def _syllables(word: str) -> int:
    if word.isupper() and len(word) <= 5:  # an acronym: one syllable a letter ("W" has three)
        return sum(3 if c == "W" else 1 for c in word)
    w = word.lower()
    n = len(_VOWELS.findall(w))
    if n > 1 and w.endswith("e") and not w.endswith(("le", "ee")):  # a silent final e
        n -= 1
    return max(1, n)


def estimate_frames(text: str) -> int:
    """Code frames ChatTTS is expected to need to say `text` (raw text: digits and symbols counted as their words)."""
    frames = 0
    for m in _TOKEN.finditer(text):
        name = m.group()[1:-1]
        frames += TOKEN_FRAMES.get(name, TOKEN_FRAMES.get(name.rsplit("_", 1)[0], 0))
    body = _TOKEN.sub(" ", text)
    syllables = len(_CJK.findall(body)) + sum(_syllables(w) for w in _WORD.findall(body))
    syllables += 2 * len(_DIGITS.findall(body)) + 2 * len(_SYMBOLS.findall(body))
    frames += syllables * FRAMES_PER_SYLLABLE
    frames += CLAUSE_PAUSE_FRAMES * len(_CLAUSE_MARKS.findall(body))
    frames += SENTENCE_PAUSE_FRAMES * len(_SENTENCE_MARKS.findall(body))
    return frames


def _blocked(text: str) -> list[bool]:
    """blocked[p]: no cut between text[p-1] and text[p] (inside a control token or a number's spoken form)."""
    blocked = [False] * (len(text) + 1)
    for pattern in (_TOKEN, _NUMBER):
        for m in pattern.finditer(text):
            for p in range(m.start() + 1, m.end()):
                blocked[p] = True
    return blocked


def _cut(text: str, span: Span, ends: Sequence[int], blocked: list[bool]) -> list[Span]:
    """`span` cut at each allowed position of `ends` inside it."""
    out, start = [], span[0]
    for p in ends:
        if span[0] < p < span[1] and not blocked[p]:
            out.append((start, p))
            start = p
    out.append((start, span[1]))
    return out


def _pack(text: str, parts: list[Span], max_frames: int) -> list[Span]:
    """Consecutive parts joined greedily while the join fits `max_frames`."""
    out: list[Span] = []
    for s, e in parts:
        if out and estimate_frames(text[out[-1][0]:e]) <= max_frames:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _fit(text: str, span: Span, max_frames: int, blocked: list[bool]) -> list[Span]:
    """A sentence over the budget: clauses packed, a clause over the budget cut between words or characters."""
    clauses = _cut(text, span, [m.end() for m in _CLAUSE_END.finditer(text, *span)], blocked)
    parts: list[Span] = []
    for clause in clauses:
        if estimate_frames(text[clause[0]:clause[1]]) <= max_frames:
            parts.append(clause)
            continue
        # between words (after the spaces) and on either side of each CJK character
        ends = sorted({m.end() for m in _SPACE.finditer(text, *clause)}
                      | {p for m in _CJK.finditer(text, *clause) for p in (m.start(), m.end())})
        parts += _pack(text, _cut(text, clause, ends, blocked), max_frames)
    return _pack(text, parts, max_frames)


def _merge_short(text: str, pieces: list[Span], min_frames: int, max_frames: int) -> list[Span]:
    """A piece under `min_frames` joins the previous piece, else the next, when the join fits `max_frames`."""
    out: list[Span] = []
    for s, e in pieces:
        if out and (estimate_frames(text[s:e]) < min_frames
                    or estimate_frames(text[out[-1][0]:out[-1][1]]) < min_frames) \
                and estimate_frames(text[out[-1][0]:e]) <= max_frames:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def split_for_synthesis(text: str, max_frames: int = DEFAULT_MAX_FRAMES, min_frames: int | None = None) -> list[str]:
    """`text` as the pieces to synthesise one request each, in order, stripped, none empty.

    max_frames: the frame budget of a piece (`estimate_frames`), 1 .. MAX_NEW_TOKENS (default half of it, ≈ 21.8 s);
    min_frames: pieces estimated shorter join a neighbour when the join fits (default DEFAULT_MIN_FRAMES, at most
    max_frames; 0: never). Raises ValueError on a bad budget or a non-str text.
    """
    return [text[s:e] for s, e in split_spans(text, max_frames, min_frames)]


def split_spans(text: str, max_frames: int = DEFAULT_MAX_FRAMES, min_frames: int | None = None) -> list[Span]:
    """The pieces of `split_for_synthesis` as (start, end) offsets into `text`, whitespace trimmed: what lies between
    two pieces is whitespace only, so a caller that cuts text as it arrives knows exactly what it has consumed."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if not 1 <= max_frames <= LIMITS.max_new_tokens:
        raise ValueError(f"max_frames must be in [1, {LIMITS.max_new_tokens}], got {max_frames}")
    min_frames = min(DEFAULT_MIN_FRAMES if min_frames is None else min_frames, max_frames)
    if min_frames < 0:
        raise ValueError(f"min_frames must be ≥ 0, got {min_frames}")
    blocked = _blocked(text)
    pieces: list[Span] = []
    for sentence in _cut(text, (0, len(text)), [m.end() for m in _SENTENCE_END.finditer(text)], blocked):
        if not text[sentence[0]:sentence[1]].strip():
            continue
        if estimate_frames(text[sentence[0]:sentence[1]]) <= max_frames:
            pieces.append(sentence)
        else:
            pieces += _fit(text, sentence, max_frames, blocked)
    pieces = _merge_short(text, pieces, min_frames, max_frames)
    return [t for t in (_trim(text, span) for span in pieces) if t[1] > t[0]]


def _trim(text: str, span: Span) -> Span:
    s, e = span
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return s, e
