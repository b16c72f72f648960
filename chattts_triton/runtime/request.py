"""What the GPT engine takes and gives: a generation request (`GenRequest` with its `SamplingParams`), its result
(`GenResult`), the engine's error, and a running request's slot (`Slot`). Re-exported by engine.py, where callers
import them from."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..config import AUDIO_EOS

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class SamplingParams:
    temperature: float
    top_p: float | None  # None: off (upstream passes None to skip the warper)
    top_k: int | None
    repetition_penalty: float
    max_new_tokens: int
    min_new_tokens: int
    seed: int
    ensure_non_empty: bool = True


@dataclass
class GenRequest:
    """One generation. `mode` "code": audio codes through the 4 code heads (EOS = code 625);
    "text": refine-text through the text head (EOS = `eos_id`)."""

    text_ids: Tensor  # int64 [N]
    params: SamplingParams
    on_done: Callable[[GenResult], None]
    mode: str = "code"
    audio_codes: Tensor | None = None  # int64 [P, num_vq] appended after the text (spk_smp)
    spk_emb: Tensor | None = None  # float [hidden] written at every spk_emb_id position
    spk_emb_id: int = -1
    eos_id: int = AUDIO_EOS
    want_hidden: bool = True
    cancelled: bool = False
    cancelled_at: float | None = None  # time.perf_counter() of the first cancel(): the engine times the release
    # streaming: on_tokens(tokens, hiddens) gets the tokens generated since its last call once
    # there are at least `stream_every` of them (on the engine thread, one step later, after the
    # step's own host sync: hand off, never block). The consumer may change stream_every at any
    # time; the tail arrives in on_done's result.
    on_tokens: Callable[[Tensor, Tensor | None], None] | None = None
    stream_every: int = 1

    @property
    def prompt_len(self) -> int:
        return int(self.text_ids.numel()) + (0 if self.audio_codes is None else int(self.audio_codes.shape[0]))

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled_at = time.perf_counter()
        self.cancelled = True


@dataclass
class GenResult:
    tokens: Tensor | None  # code: int64 [n, num_vq]; text: int64 [n]
    hiddens: Tensor | None  # float32 [n, hidden] (code mode with want_hidden)
    finish_reason: str  # "eos" | "max_tokens" | "cancelled" | "error"
    error: BaseException | None = None
    steps: int = 0
    # CUDA: tokens/hiddens are pinned host copies, complete once this event has (recorded by the
    # engine right after the copies, so waiting on it never waits for a later step)
    ready: Any | None = None

    def wait(self) -> GenResult:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self


class EngineError(RuntimeError):
    pass


class Slot:
    __slots__ = ("req", "idx", "emitted", "seq", "saved", "_eng")

    def __init__(self, eng: Engine, req: GenRequest, idx: int, seq: int):
        self._eng = eng
        self.req = req
        self.idx = idx  # slot; changes when finished requests below it are compacted away
        self.emitted = 0  # tokens handed to req.on_tokens
        self.seq = seq  # admission order: the newest running requests are suspended first
        self.saved: tuple | None = None  # while suspended: its pages' keys/values and its slot state

    @property
    def n(self) -> int:  # tokens generated (kept) so far
        return int(self._eng.h_n[self.idx])

    @property
    def plen(self) -> int:
        return int(self._eng.h_plen[self.idx])

