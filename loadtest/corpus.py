"""The load-test corpus: one utterance per non-empty line (lines starting with '#' are comments)."""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus.txt"
# Request names group utterances by spoken length, since TTS latency grows with it. Length is
# estimated in syllables: one per CJK character, about 1.5 per Latin-script word.
LENGTH_BUCKETS = ((8, "short"), (30, "medium"))
LONGEST_BUCKET = "long"
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_WORD = re.compile(r"[A-Za-z0-9']+")


class CorpusError(ValueError):
    pass


def load_corpus(path: str | Path | None = None) -> list[str]:
    path = Path(path) if path else DEFAULT_CORPUS
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read corpus {path}: {e}") from None
    texts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not texts:
        raise CorpusError(f"corpus {path} has no utterances")
    return texts


def spoken_units(text: str) -> float:
    return len(_CJK.findall(text)) + 1.5 * len(_WORD.findall(text))


def length_bucket(text: str) -> str:
    units = spoken_units(text)
    for max_units, name in LENGTH_BUCKETS:
        if units <= max_units:
            return name
    return LONGEST_BUCKET
