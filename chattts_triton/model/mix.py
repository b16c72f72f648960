"""Voice mixes: `VOICE="2222*0.7+nova*0.3"` (or Kokoro's `2222(2)+nova(1)`) → one speaker embedding.

Grammar (whitespace around the symbols is allowed):

    mix    := term ('+' term)*                        at most MAX_TERMS terms
    term   := name | name '*' weight | name '(' weight ')'
    name   := a voice of the registry or a seed number (runtime/voices.py NAME_RE, SEED_RE)
    weight := a positive decimal number ≤ MAX_WEIGHT (`0.7`, `2`, `.5`, `1e-1`); a term without one weighs 1

The rule that keeps a mix in the speaker distribution (`mix`): ChatTTS draws a speaker as
`x = mean + std ⊙ z` with `z ~ N(0, I)` (`spk_stat`, `Speaker.sample_random`). The weights are normalised to sum 1,
and the mix is the weighted average of the terms' embeddings, `x̄ = Σ wᵢ xᵢ = mean + std ⊙ z̄`. Averaging pulls
`z̄` toward 0, the "average voice" the distribution never draws (two independent speakers at 0.5 each: |z̄| is
√0.5 ≈ 0.71 of theirs, 0.76 at 0.7/0.3); so `z̄` is rescaled to the weighted mean of the terms' own norms,
`Σ wᵢ |zᵢ|`. A seed speaker's |z| is √hidden within a few percent (χ with `hidden` degrees of freedom); a mix of
seed speakers is again at that distance from the mean voice, in the direction of their weighted average. A term
mixed with itself (`a*0.5+a*0.5`) is that term. A mix whose average is about the mean voice itself (|z̄| under
CANCELLED = 5 % of Σ wᵢ|zᵢ|: terms that cancel; independent speakers mixed evenly keep 1/√k of it, 25 % at 16 terms)
is refused: its direction would be rounding noise.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from .text import InputError

MAX_TERMS = 16
MAX_WEIGHT = 1000.0
CANCELLED = 0.05  # a weighted average this close to the mean voice (|z̄| / Σ wᵢ|zᵢ|) has no direction worth keeping
MAX_CHARS = 2048  # of a mix expression (16 terms of 64-character names with weights fit)
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_TERM = re.compile(rf"^\s*({_NAME})\s*(?:\*\s*(\S+?)\s*|\(\s*([^()]*?)\s*\)\s*)?$")
_WEIGHT = re.compile(r"^(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")
_MIX_CHARS = re.compile(r"[+*()]")


class MixError(InputError):
    """A mix expression that cannot be read: an empty term, a bad weight, too many terms."""


def is_mix(voice: str) -> bool:
    """Whether a VOICE value is a mix expression (a voice name never holds '+', '*', '(' or ')')."""
    return isinstance(voice, str) and _MIX_CHARS.search(voice) is not None


def parse(expr: str) -> list[tuple[str, float]]:
    """(name, weight) of each term, the weights normalised to sum 1; MixError naming the term at fault."""
    if not isinstance(expr, str):
        raise MixError(f"a voice mix must be a string, got {type(expr).__name__}")
    terms_given = expr.count("+") + 1
    if terms_given > MAX_TERMS:
        raise MixError(f"the voice mix has {terms_given} terms, more than {MAX_TERMS}")
    if len(expr) > MAX_CHARS:
        raise MixError(f"the voice mix has {len(expr)} characters, more than {MAX_CHARS}")
    parts = expr.split("+")
    terms: list[tuple[str, float]] = []
    for i, part in enumerate(parts, 1):
        if not part.strip():
            raise MixError(f"term {i} of the voice mix {shown(expr)} is empty")
        m = _TERM.match(part)
        if m is None:
            raise MixError(f"term {i} of the voice mix ({shown(part.strip())}) is not NAME, NAME*WEIGHT or "
                           f"NAME(WEIGHT) (a name is 1-64 letters, digits, '_', '.' or '-')")
        name, weight = m.group(1), m.group(2) if m.group(2) is not None else m.group(3)
        terms.append((name, 1.0 if weight is None else _weight(weight, i, name)))
    total = math.fsum(w for _, w in terms)
    return [(name, w / total) for name, w in terms]


def _weight(text: str, i: int, name: str) -> float:
    value = float(text) if _WEIGHT.match(text) else math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_WEIGHT):
        raise MixError(f"term {i} of the voice mix ({name}): weight {shown(text)} is not a number in (0, "
                       f"{MAX_WEIGHT:g}] (weights are relative: 0.7 and 0.3, or 2 and 1)")
    return value


def shown(text: str) -> str:
    """A user's text as an error message shows it: quoted, at most 40 characters."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def canonical(terms: Sequence[tuple[str, float]]) -> str:
    """The mix written back with its normalised weights (what a stored mix records)."""
    return "+".join(f"{name}*{weight:.6g}" for name, weight in terms)


def mix(embeddings: Sequence[np.ndarray], weights: Sequence[float], hidden: int) -> np.ndarray:
    """The mixed speaker embedding (fp16 [hidden], what `encode_speaker` stores) of decoded speaker embeddings
    (`decode_speaker`) with weights summing to 1, by the rule in this module's docstring."""
    from .speaker import spk_stat

    if len(embeddings) != len(weights) or not embeddings:
        raise MixError("a voice mix needs one weight per speaker and at least one speaker")
    std_t, mean_t = spk_stat()
    std = std_t[:hidden].double().numpy()
    mean = mean_t[:hidden].double().numpy()
    z = np.stack([(np.asarray(e, np.float64).reshape(-1) - mean) / std for e in embeddings])  # [terms, hidden]
    w = np.asarray(weights, np.float64)
    z_mix = w @ z
    target = float(w @ np.linalg.norm(z, axis=1))
    norm = float(np.linalg.norm(z_mix))
    if not (math.isfinite(norm) and math.isfinite(target)) or norm < CANCELLED * target:
        raise MixError("the voice mix cancels out: its weighted average is the mean voice itself")
    out = (mean + std * (z_mix * (target / norm))).astype(np.float16)
    if not np.isfinite(out).all():
        raise MixError("the voice mix overflows fp16")
    return out
