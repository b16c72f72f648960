"""A pronunciation lexicon: words → what to say instead (a homophone, a respelling), applied to a text before it is
normalised. docs/ssml.md#pronunciation-lexicon is the user's reference; this is the rule.

- Matching is exact: an entry matches its word as written, case included. An entry with `ignore_case` matches the word
  in any case of the letters A-Z ("nvidia" also matches "NVIDIA" and "Nvidia"); an exact entry of the same spelling
  wins.
- A word that starts (ends) with a letter or digit of a script written with spaces (Latin, ...) matches only where the
  character before (after) it is not one: "AWS" is not found in "LAWS". Chinese words match anywhere ("重庆" in
  "重庆市"): Chinese has no spaces to tell words apart.
- Longest match first, left to right, never overlapping: with "银行" and "银行行长", "银行行长" is one match.
- Control tokens ([uv_break] ...) are never matched into; a replacement may hold them.

Matching runs on pyahocorasick's automaton: linear in the text's length whatever the number of entries.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .text import TAG_RE, InputError, validate_text

FORMAT = 1  # lexicon.json "format"
MAX_ENTRIES = 20_000
MAX_WORD_CHARS = 64
MAX_SAY_CHARS = 256
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
# scripts written without spaces between words: a word of theirs has no boundary to respect
_UNSPACED = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")
_BAD_WORD = re.compile(r"[\[\]\s]|[\x00-\x1f\x7f-\x9f]")
_HIDDEN = frozenset({"Cf", "Cs", "Co", "Zl", "Zp"})  # format (bidi, zero-width), surrogate, private, separators


class LexiconError(InputError):
    """An entry or a lexicon document that cannot be used; the message names it, `field` the entry's field at fault
    (word, say or ignore_case; None for a document)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Entry:
    word: str
    say: str
    ignore_case: bool = False

    def to_json(self) -> dict:
        return {"say": self.say, **({"ignore_case": True} if self.ignore_case else {})}


def check_entry(word, say, ignore_case=False) -> Entry:
    """An Entry, or LexiconError saying what is wrong with it (its `field`: word, say or ignore_case)."""
    if not isinstance(word, str) or not word or len(word) > MAX_WORD_CHARS:
        raise LexiconError(f"lexicon word {word!r} must be 1-{MAX_WORD_CHARS} characters", "word")
    bad = _BAD_WORD.search(word)
    if bad:
        raise LexiconError(f"lexicon word {word!r} holds {bad.group()!r}: a word has no spaces, control characters "
                           f"or square brackets", "word")
    hidden = next((c for c in word if unicodedata.category(c) in _HIDDEN), None)
    if hidden is not None:  # an entry nobody can see or type, or one that cannot be stored (a lone surrogate)
        raise LexiconError(f"lexicon word {word!r} holds U+{ord(hidden):04X}: a word has no invisible, format or "
                           f"surrogate characters", "word")
    if not isinstance(ignore_case, bool):
        raise LexiconError(f"lexicon word {word!r}: ignore_case must be true or false", "ignore_case")
    try:
        say = validate_text(say, max_chars=MAX_SAY_CHARS, what=f"the replacement of {word!r}")
    except InputError as e:
        raise LexiconError(f"lexicon: {e}", "say") from None
    return Entry(word, say.strip(), ignore_case)


def entry_of(word, doc) -> Entry:
    """The entry a lexicon document holds for `word` (`{"say": "...", "ignore_case": true}`, as Entry.to_json
    writes it); LexiconError naming it."""
    if not isinstance(doc, Mapping) or not set(doc) <= {"say", "ignore_case"} or "say" not in doc:
        raise LexiconError(f"lexicon word {word!r}: an entry is {{\"say\": \"...\"}} with an optional "
                           f"\"ignore_case\": true")
    return check_entry(word, doc["say"], doc.get("ignore_case", False))


def fold_case(word: str) -> str:
    """The key an ignore_case entry matches by: its word with A-Z lowered (two such entries may not share one)."""
    return word.translate(_ASCII_LOWER)


def listing_order(word: str) -> tuple[str, str]:
    """The order entries are listed and written in."""
    return word.casefold(), word


def _wordish(ch: str) -> bool:
    return ch.isalnum() and not _UNSPACED.match(ch)


class Lexicon:
    """The entries of one version of a lexicon, ready to apply."""

    def __init__(self, entries: Iterable[Entry] = ()):
        self.exact: dict[str, Entry] = {}
        self.folded: dict[str, Entry] = {}  # ignore_case entries by their ASCII-lowered word
        for e in entries:
            table, key = (self.folded, e.word.translate(_ASCII_LOWER)) if e.ignore_case else (self.exact, e.word)
            if key in table:
                raise LexiconError(f"lexicon word {e.word!r} is given twice" + (
                    f" (as {table[key].word!r}, both ignoring case)" if e.ignore_case else ""))
            table[key] = e
        if len(self.exact) + len(self.folded) > MAX_ENTRIES:
            raise LexiconError(f"a lexicon holds at most {MAX_ENTRIES} entries")
        self._automaton = None

    def __len__(self) -> int:
        return len(self.exact) + len(self.folded)

    def entries(self) -> list[Entry]:
        return sorted([*self.exact.values(), *self.folded.values()], key=lambda e: listing_order(e.word))

    @property
    def automaton(self):
        if self._automaton is None:
            import ahocorasick

            a = ahocorasick.Automaton()
            for e in [*self.exact.values(), *self.folded.values()]:
                key = e.word.translate(_ASCII_LOWER)
                a.add_word(key, len(key))
            if len(a):
                a.make_automaton()
            self._automaton = a
        return self._automaton

    def _entry(self, written: str) -> Entry | None:
        return self.exact.get(written) or self.folded.get(written.translate(_ASCII_LOWER))

    def matches(self, text: str) -> list[tuple[int, int, Entry]]:
        """(start, end, entry) of each replacement in `text` (no control token in it), left to right."""
        if not len(self) or not text:
            return []
        found = []
        for last, n in self.automaton.iter(text.translate(_ASCII_LOWER)):  # lowering A-Z keeps every index
            start, end = last + 1 - n, last + 1
            entry = self._entry(text[start:end])
            if entry is None:  # the lowered spelling of an exact entry, in another case
                continue
            if _wordish(text[start]) and start > 0 and _wordish(text[start - 1]):
                continue
            if _wordish(text[end - 1]) and end < len(text) and _wordish(text[end]):
                continue
            found.append((start, end, entry))
        found.sort(key=lambda m: (m[0], m[0] - m[1]))  # leftmost, then longest
        out, pos = [], 0
        for m in found:
            if m[0] >= pos:
                out.append(m)
                pos = m[1]
        return out

    def apply(self, text: str) -> str:
        """`text` with every match replaced (control tokens kept as they are)."""
        if not len(self):
            return text
        out, pos = [], 0
        for tag in TAG_RE.finditer(text):
            out += [self._replace(text[pos:tag.start()]), tag.group()]
            pos = tag.end()
        out.append(self._replace(text[pos:]))
        return "".join(out)

    def _replace(self, text: str) -> str:
        out, pos = [], 0
        for start, end, entry in self.matches(text):
            out += [text[pos:start], entry.say]
            pos = end
        return "".join(out) + text[pos:]


def from_json(doc) -> Lexicon:
    """A lexicon document: {"format": 1, "entries": {"word": {"say": "...", "ignore_case": false}, ...}}."""
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), Mapping):
        raise LexiconError(f'a lexicon is {{"format": {FORMAT}, "entries": {{"word": {{"say": "..."}}, ...}}}}')
    return Lexicon([entry_of(word, d) for word, d in doc["entries"].items()])


def to_json(lexicon: Lexicon) -> dict:
    return {"format": FORMAT, "entries": {e.word: e.to_json() for e in lexicon.entries()}}
