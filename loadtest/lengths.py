"""How many code frames each request of a load tool forces (MIN_NEW_TOKENS = MAX_NEW_TOKENS): one length for
every request (`150`), or each request its own, drawn uniformly from a range (`50-400`) by a seeded generator.

Real traffic mixes lengths, and that changes what the server does: Triton's dynamic batcher groups only
requests of identical input shapes unless a model allows ragged batches, and the GPT engine's rows finish at
different steps. A mix is drawn per stream of requests (a worker, a burst), each stream from its own generator
seeded by (seed, the stream's key), so a run repeats its lengths however the requests interleave.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from chattts_triton.config import LIMITS, SAMPLE_RATE, samples_for_codes

_SPEC = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class Lengths:
    low: int
    high: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high <= LIMITS.max_new_tokens:
            raise ValueError(f"need 1 <= A <= B <= {LIMITS.max_new_tokens} (LIMITS.max_new_tokens), got "
                             f"{self.low}-{self.high}")

    @classmethod
    def parse(cls, text: str | int, seed: int = 0) -> Lengths:
        """`N` or `A-B` (whole numbers, 1 <= A <= B <= LIMITS.max_new_tokens)."""
        m = _SPEC.match(str(text))
        if not m:
            raise ValueError(f"expected N or A-B (whole numbers of code frames), got {text!r}")
        low = int(m.group(1))
        return cls(low, int(m.group(2) or low), seed)

    @classmethod
    def of(cls, value: Lengths | int | str) -> Lengths:
        """A Lengths as it is, or one parsed from N / "A-B" (the callers that passed a scalar keep doing so)."""
        return value if isinstance(value, Lengths) else cls.parse(value)

    @property
    def fixed(self) -> bool:
        return self.low == self.high

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    @property
    def mean_audio_s(self) -> float:
        """Mean audio seconds of an utterance (the served length is linear in the frames)."""
        return samples_for_codes(self.mean) / SAMPLE_RATE

    def __str__(self) -> str:
        return str(self.low) if self.fixed else f"{self.low}-{self.high}"

    def describe(self) -> str:
        if self.fixed:
            return f"{self.low} forced code frames per utterance (≈ {self.mean_audio_s:.2f} s of audio)"
        return (f"forced code frames drawn per utterance uniformly from {self.low}–{self.high} (seed {self.seed}; "
                f"mean {self.mean:g} frames ≈ {self.mean_audio_s:.2f} s of audio)")

    def stream(self, *key) -> Iterator[int]:
        """The lengths of one stream of requests, endless: the same for the same (seed, key) in any process."""
        rng = random.Random("/".join(map(str, (self.seed, *key))))  # a str seed hashes with SHA-512: stable across runs
        while True:
            yield rng.randint(self.low, self.high)

    def draw(self, n: int, *key) -> list[int]:
        it = self.stream(*key)
        return [next(it) for _ in range(n)]

    def spread(self, n: int = 16) -> list[int]:
        """Up to n distinct lengths evenly over [low, high], both ends included (a file of fixed entries)."""
        if self.fixed or n <= 1:
            return [self.low]
        return sorted({round(self.low + i * (self.high - self.low) / (n - 1)) for i in range(n)})

    def to_json(self) -> dict:
        return {"frames": str(self), "low": self.low, "high": self.high, "seed": self.seed, "mean_frames": self.mean,
                "mean_audio_s": round(self.mean_audio_s, 4)}


def lengths_arg(text: str) -> Lengths:
    """argparse `type` for N / A-B: argparse's error names the flag ("argument --tokens: ...")."""
    try:
        return Lengths.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
