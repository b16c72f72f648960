"""Speech from Triton for the gateway: long text split into pieces, the pieces synthesised concurrently over
a pooled asyncio gRPC client (`client.AsyncChatTTSClient`), joined in order with a short pause; or streamed,
the first piece from `chattts_stream` chunk by chunk while the others are made beside it by `chattts`.

Every piece gets the same voice and the request's seed schedule: piece i is sent with SEED = seed + i, so
a request with a seed is reproducible and a one-piece request equals the same call over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import unicodedata
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional

import numpy as np

from chattts_triton.config import ENSEMBLE_INPUTS, LIMITS, SAMPLE_RATE
from client.client import AsyncChatTTSClient, split_sentences
from client.contract import MODEL, STREAM_MODEL
from client.errors import ChatTTSError

SEED_LIMIT = 2**63  # SEED is INT64: the schedule wraps below this


def split_text(text: str) -> List[str]:
    """The pieces of a request's input, each one Triton request. The one place the gateway splits text: the
    client's length-aware split (`client.split_sentences`, chattts_triton.model.split.split_for_synthesis: pieces that
    fit in time, never cut inside a number or control token), a piece still over the server's TEXT limit cut at
    the last space or punctuation before it, and pieces with nothing to say (no letter or digit, e.g. "…") kept
    with their neighbour."""
    pieces: List[str] = []
    for sentence in split_sentences(text):
        for piece in _fit(sentence.strip(), LIMITS.max_text_chars):
            if pieces and not _speakable(piece):
                pieces[-1] = f"{pieces[-1]} {piece}"
            elif pieces and not _speakable(pieces[-1]):
                pieces[-1] = f"{pieces[-1]} {piece}"
            else:
                pieces.append(piece)
    return [p for p in pieces if p.strip()]


def _speakable(text: str) -> bool:
    return any(unicodedata.category(c)[0] in "LN" for c in text)


_BREAK = re.compile(r"[\s,;:，、；：。.!?！？]")


def _fit(text: str, limit: int) -> List[str]:
    out = []
    while len(text) > limit:
        cut = max((m.end() for m in _BREAK.finditer(text, 0, limit)), default=0) or limit
        out.append(text[:cut].strip())
        text = text[cut:].strip()
    return out + ([text] if text else [])


class SynthesisError(Exception):
    """A failed synthesis: `status` a canonical (gRPC) name, `message` for the client, `field` the contract
    input the server named (VOICE, TEXT, ...) if any."""

    def __init__(self, status: str, message: str, field: Optional[str] = None):
        super().__init__(f"[{status}] {message}")
        self.status, self.message, self.field = status, message, field


_PREFIXES = re.compile(r"^(?:grpc://\S+ model '[^']*': )?(?:in ensemble '[^']*', )?(?:[A-Z_]+: )?")
_INPUT_NAMES = sorted(ENSEMBLE_INPUTS, key=len, reverse=True)  # REFINE_TOP_P before TOP_P
_NAMED = re.compile(r"\b(" + "|".join(_INPUT_NAMES) + r")\b")


def synthesis_error(err: ChatTTSError) -> SynthesisError:
    message = _PREFIXES.sub("", err.message, count=1)
    m = _NAMED.search(message)
    return SynthesisError(err.status, message, m.group(1) if m else None)


@dataclass
class Job:
    """One speech request: its pieces and the contract options every piece shares (lower-case keywords of
    `client.contract.OPTION_INPUTS`, without `seed`)."""

    pieces: List[str]
    options: Dict[str, Any]
    seed: int = field(default_factory=lambda: secrets.randbits(62))

    def piece_options(self, i: int) -> Dict[str, Any]:
        return {**self.options, "seed": (self.seed + i) % SEED_LIMIT}


class Synthesizer:
    """Calls to one Triton server over `channels` gRPC connections (AsyncChatTTSClient: no retries: an
    overloaded server's UNAVAILABLE goes back to the HTTP client, whose library retries it)."""

    def __init__(self, url: str, timeout_s: float = 300.0, channels: int = 2, piece_concurrency: int = 16,
                 pause_ms: int = 200, model: str = MODEL, stream_model: str = STREAM_MODEL):
        self.url, self.timeout_s, self.channels = url, float(timeout_s), int(channels)
        self.model, self.stream_model = model, stream_model
        self.piece_concurrency = int(piece_concurrency)
        self.pause = np.zeros(int(round(pause_ms * SAMPLE_RATE / 1000)), np.float32)
        self._client: Optional[AsyncChatTTSClient] = None

    @property
    def client(self) -> AsyncChatTTSClient:
        if self._client is None:  # inside the running loop: aio channels belong to it
            self._client = AsyncChatTTSClient(
                self.url, protocol="grpc", model=self.model, stream_model=self.stream_model, timeout_s=self.timeout_s,
                retries=0, max_concurrency=1 << 20, channels=self.channels,
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> Dict[str, bool]:
        """Triton's readiness: the server with each model the gateway calls."""
        return {m: await self.client.is_ready(m) for m in (self.model, self.stream_model)}

    async def _infer(self, job: Job, i: int) -> np.ndarray:
        try:
            return await self.client.infer_one(job.pieces[i], job.piece_options(i))
        except ChatTTSError as e:
            raise synthesis_error(e) from None

    async def _piece(self, job: Job, i: int, gate: asyncio.Semaphore) -> np.ndarray:
        async with gate:
            return await self._infer(job, i)

    def _start(self, job: Job, first: int) -> List["asyncio.Task[np.ndarray]"]:
        gate = asyncio.Semaphore(self.piece_concurrency)
        return [asyncio.ensure_future(self._piece(job, i, gate)) for i in range(first, len(job.pieces))]

    async def synthesize(self, job: Job) -> np.ndarray:
        """The whole audio: every piece at once (in-flight batching makes a paragraph cost about one
        sentence), joined in order with a pause between pieces."""
        if len(job.pieces) == 1:  # most requests: awaited in place, without a task and a gather of their own
            return await self._infer(job, 0)
        tasks = self._start(job, 0)
        try:
            audios = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return self.join(audios)

    def join(self, audios: List[np.ndarray]) -> np.ndarray:
        if len(audios) == 1:
            return audios[0]
        out: List[np.ndarray] = []
        for i, a in enumerate(audios):
            out += [self.pause, a] if i else [a]
        return np.concatenate(out).astype(np.float32, copy=False)

    async def stream(self, job: Job) -> AsyncIterator[np.ndarray]:
        """The audio as it is made: the first piece's chunks from the stream model, then a pause and each
        other piece whole, in order (they are synthesised from the start, beside the first). An error
        raises SynthesisError from the iterator; before the first chunk nothing has been sent."""
        rest = self._start(job, 1)
        try:
            try:
                chunks = self.client.stream(job.pieces[0], split=False, voice_from_first=False, **job.piece_options(0))
            except ChatTTSError as e:  # refused before anything was sent
                raise synthesis_error(e) from None
            async with contextlib.aclosing(chunks):
                try:
                    async for chunk in chunks:
                        yield chunk
                except ChatTTSError as e:
                    raise synthesis_error(e) from None
            for task in rest:
                yield self.pause
                yield await task
        finally:
            for t in rest:
                t.cancel()
            if rest:  # collect the cancelled pieces: nothing is left unretrieved
                await asyncio.gather(*rest, return_exceptions=True)
