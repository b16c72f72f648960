"""Speech from Triton for the gateway: long text split into pieces, the pieces synthesised concurrently over
a pooled asyncio gRPC client (`client.AsyncChatTTSClient`), joined in order with a short pause; or streamed,
the first piece from `chattts_stream` chunk by chunk, the others made by `chattts` from its first chunk on.

Every piece gets the same voice and the request's seed schedule: piece i is sent with SEED = seed + i, so
a request with a seed is reproducible and a one-piece request equals the same call over gRPC. An SSML request's
pieces may each have their own voice and speed (`Job.piece_extras`) and silence of their own around them
(`Job.gaps_ms`, from its breaks); a dialogue's lines likewise. With `Job.condition_on_first` the later pieces in the
first piece's voice wait for its audio and are sent with it as their reference audio (upstream's spk_smp).

What the text decides (an unknown control token, a piece with nothing left to say) is checked for the pieces
after the first by `chattts_preprocess` alone (`preflight`), while the first piece's first chunk is made: a
stream then starts only when every piece can be spoken. Each piece's place in the audio is a `Segment`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import unicodedata
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chattts_triton.config import ENSEMBLE_INPUTS, LIMITS, PREPROCESS, SAMPLE_RATE
from client.client import AsyncChatTTSClient, split_sentences
from client.contract import MODEL, STREAM_MODEL, SynthesisOptions, spoken_text_from_result, to_infer_inputs
from client.errors import ChatTTSError, to_chattts_error

SEED_LIMIT = 2**63  # SEED is INT64: the schedule wraps below this


def split_text(text: str) -> list[str]:
    """The pieces of a request's input, each one Triton request. The one place the gateway splits text: the
    client's length-aware split (`client.split_sentences`, chattts_triton.model.split.split_for_synthesis: pieces that
    fit in time, never cut inside a number or control token), a piece still over the server's TEXT limit cut at
    the last space or punctuation before it, and pieces with nothing to say (no letter or digit, e.g. "…") kept
    with their neighbour."""
    pieces: list[str] = []
    for sentence in split_sentences(text):
        for piece in _fit(sentence.strip(), LIMITS.max_text_chars):
            if pieces and not speakable(piece):
                pieces[-1] = f"{pieces[-1]} {piece}"
            elif pieces and not speakable(pieces[-1]):
                pieces[-1] = f"{pieces[-1]} {piece}"
            else:
                pieces.append(piece)
    return [p for p in pieces if p.strip()]


def speakable(text: str) -> bool:
    return any(unicodedata.category(c)[0] in "LN" for c in text)


_BREAK = re.compile(r"[\s,;:，、；：。.!?！？]")


def _fit(text: str, limit: int) -> list[str]:
    out = []
    while len(text) > limit:
        cut = max((m.end() for m in _BREAK.finditer(text, 0, limit)), default=0) or limit
        out.append(text[:cut].strip())
        text = text[cut:].strip()
    return out + ([text] if text else [])


class SynthesisError(Exception):
    """A failed synthesis: `status` a canonical (gRPC) name, `message` for the client, `field` the contract
    input the server named (VOICE, TEXT, ...) if any."""

    def __init__(self, status: str, message: str, field: str | None = None):
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
    """One speech request: its pieces and the `SynthesisOptions` every piece shares (a mapping of its field names is
    made into one; its seed is the schedule's, `seed`). `piece_extras[i]`: the fields of piece i that differ (an SSML
    segment's voice and prompt; None resets one); `gaps_ms` (len(pieces) + 1): the silence before each piece and after
    the last, None for the synthesizer's pause between pieces (None: that pause between pieces, nothing before or
    after). `piece_options(i)` is what piece i is sent with."""

    pieces: list[str]
    options: SynthesisOptions
    seed: int = field(default_factory=lambda: secrets.randbits(62))
    piece_extras: list[dict[str, Any]] | None = None
    gaps_ms: list[int | None] | None = None
    # `condition_on_first_piece`: the pieces after the first wait for its audio, which becomes their reference audio
    # (SPEAKER_AUDIO, its SPOKEN_TEXT the SPEAKER_TEXT: upstream's spk_smp / txt_smp) where they speak in its voice
    condition_on_first: bool = False
    reference: tuple[np.ndarray, str] | None = None  # (audio, spoken text) of the first piece, once made

    def __post_init__(self) -> None:
        self.options = SynthesisOptions.of(self.options)  # a bad value: ChatTTSInputError naming the field

    def _extra(self, i: int) -> dict[str, Any]:
        return self.piece_extras[i] if self.piece_extras else {}

    def _options(self, i: int) -> dict[str, Any]:
        return {**self.options, **self._extra(i)}

    @property
    def conditions(self) -> bool:
        """Whether the pieces after the first wait for its audio (the option is on and some piece can use it)."""
        return self.condition_on_first and any(self._conditionable(i) for i in range(1, len(self.pieces)))

    def _conditionable(self, i: int) -> bool:
        """Piece i speaks in the first piece's voice, and neither carries reference audio of its own."""
        first, this = self._options(0), self._options(i)
        return (first.get("speaker_audio") is None and this.get("speaker_audio") is None
                and first.get("voice") == this.get("voice") and first.get("speaker") == this.get("speaker"))

    def conditioned(self, i: int) -> bool:
        """Piece i is sent with the first piece's audio as its reference."""
        return i > 0 and self.reference is not None and self._conditionable(i)

    def piece_options(self, i: int, condition: bool = True) -> SynthesisOptions:
        """The options piece i is sent with: the job's, its extras, its seed, and the first piece's audio as its
        reference when it is conditioned on it."""
        changes = {**self._extra(i), "seed": (self.seed + i) % SEED_LIMIT}
        if condition and self.conditioned(i):
            changes["speaker_audio"], changes["speaker_text"] = self.reference
        return self.options.replace(**changes)

    def set_reference(self, audio: np.ndarray, spoken: str | None) -> None:
        """The first piece's audio as the later pieces' reference, when it is within SPEAKER_AUDIO's bounds (2048
        samples to the reference-audio limit; a longer first piece conditions nothing)."""
        if 2048 <= audio.size <= LIMITS.max_reference_audio_seconds * SAMPLE_RATE:
            self.reference = (np.ascontiguousarray(audio, np.float32), spoken or self.pieces[0])


@dataclass
class Segment:
    """One piece's place in a response's audio: samples at the model's rate from the audio's start (pauses
    between pieces lie outside every segment); `spoken_text` is what the server read (SPOKEN_TEXT), if asked."""

    index: int
    text: str
    start: int
    end: int
    spoken_text: str | None = None


Part = np.ndarray | Segment  # what `parts` yields: audio, or the end of a piece whose audio came before
# the contract options that decide what chattts_preprocess says of a text (the rest is sampling)
PREFLIGHT_OPTIONS = ("voice", "prompt", "normalize_text")
HOLDS_REFERENCE = "holds a reference sample"  # the server's refusal of SPEAKER_AUDIO beside such a VOICE


class Synthesizer:
    """Calls to one Triton server over `channels` gRPC connections (AsyncChatTTSClient: no retries: an
    overloaded server's UNAVAILABLE goes back to the HTTP client, whose library retries it)."""

    def __init__(self, url: str, timeout_s: float = 300.0, channels: int = 2, piece_concurrency: int = 16,
                 pause_ms: int = 200, model: str = MODEL, stream_model: str = STREAM_MODEL,
                 preprocess_model: str = PREPROCESS):
        self.url, self.timeout_s, self.channels = url, float(timeout_s), int(channels)
        self.model, self.stream_model, self.preprocess_model = model, stream_model, preprocess_model
        self.piece_concurrency = int(piece_concurrency)
        self.pause = np.zeros(int(round(pause_ms * SAMPLE_RATE / 1000)), np.float32)
        self._client: AsyncChatTTSClient | None = None
        self._preprocess: Any = None  # tritonclient.grpc.aio client of chattts_preprocess (the preflight)

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
        if self._preprocess is not None:
            await self._preprocess.close()
            self._preprocess = None

    async def ready(self) -> dict[str, bool]:
        """Triton's readiness: the server with each model the gateway calls."""
        return {m: await self.client.is_ready(m) for m in (self.model, self.stream_model)}

    # --- the calls to Triton (a stand-in overrides these) ------------------------------------------
    async def _infer(self, job: Job, i: int, spoken_text: bool = False):
        """Piece i's audio, or (audio, SPOKEN_TEXT) when asked. A piece conditioned on the first one whose voice holds
        reference audio of its own (a stored voice of a recording: the server takes one reference) is sent as it is."""
        try:
            try:
                return await self.client.infer_one(job.pieces[i], job.piece_options(i), spoken_text=spoken_text)
            except ChatTTSError as e:
                if not (job.conditioned(i) and e.status == "INVALID_ARGUMENT" and HOLDS_REFERENCE in e.message):
                    raise
            return await self.client.infer_one(job.pieces[i], job.piece_options(i, condition=False),
                                               spoken_text=spoken_text)
        except ChatTTSError as e:
            raise synthesis_error(e) from None

    def _stream_first(self, job: Job, on_spoken_text: Callable[[str], None] | None) -> AsyncIterator[np.ndarray]:
        """Piece 0's chunks from the stream model."""
        try:
            return self.client.stream(job.pieces[0], job.piece_options(0), split=False, voice_from_first=False,
                                      on_spoken_text=on_spoken_text)
        except ChatTTSError as e:  # refused before anything was sent
            raise synthesis_error(e) from None

    async def _check(self, job: Job, i: int) -> str:
        """Piece i through chattts_preprocess alone (no refine: the text as the client wrote it): its SPOKEN_TEXT,
        or the SynthesisError its text or voice gets."""
        import tritonclient.grpc as module
        import tritonclient.grpc.aio as aio

        if self._preprocess is None:  # inside the running loop: aio channels belong to it
            self._preprocess = aio.InferenceServerClient(self.url)
        piece = job.piece_options(i)
        options = SynthesisOptions(**{k: piece[k] for k in PREFLIGHT_OPTIONS}, refine_text=False)
        arrays = options.to_inputs(job.pieces[i])
        try:
            result = await self._preprocess.infer(self.preprocess_model, to_infer_inputs(module, arrays),
                                                  outputs=[module.InferRequestedOutput("SPOKEN_TEXT")],
                                                  client_timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001  every failure of the call becomes a canonical status
            raise synthesis_error(to_chattts_error(exc, f"grpc://{self.url} model '{self.preprocess_model}'")) from None
        return spoken_text_from_result(result) or ""

    # --- a request's audio -------------------------------------------------------------------------
    async def _piece(self, job: Job, i: int, gate: asyncio.Semaphore, spoken_text: bool = False):
        async with gate:
            return await self._infer(job, i, spoken_text)

    def _start(self, job: Job, first: int, spoken_text: bool = False) -> list[asyncio.Task]:
        gate = asyncio.Semaphore(self.piece_concurrency)
        return [asyncio.ensure_future(self._piece(job, i, gate, spoken_text)) for i in range(first, len(job.pieces))]

    def preflight(self, job: Job, first: int = 1) -> asyncio.Future[list[str]]:
        """What the text decides for pieces[first:], checked before a stream starts (the first piece's own errors
        come before its first chunk): their SPOKEN_TEXT (without refine), or SynthesisError naming the piece. The
        calls are scheduled when this returns, ahead of what the caller starts next."""
        gate = asyncio.Semaphore(self.piece_concurrency)
        n = len(job.pieces)

        async def one(i: int) -> str:
            async with gate:
                try:
                    return await self._check(job, i)
                except SynthesisError as e:
                    if e.status != "INVALID_ARGUMENT":
                        raise
                    shown = job.pieces[i] if len(job.pieces[i]) <= 60 else job.pieces[i][:57] + "..."
                    raise SynthesisError(e.status, f"piece {i + 1} of {n} ({shown!r}): {e.message}", e.field) from None

        tasks = [asyncio.ensure_future(one(i)) for i in range(first, n)]

        def settle(_) -> None:  # the first failure (or a cancel) ends every check still running
            for t in tasks:
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()  # retrieved: a second piece's error is no "never retrieved" warning

        checks = asyncio.gather(*tasks)
        checks.add_done_callback(settle)
        return checks

    def gap(self, job: Job, i: int) -> np.ndarray:
        """The silence before piece i (i == len(pieces): after the last)."""
        ms = job.gaps_ms[i] if job.gaps_ms is not None else None
        if ms is None:
            return self.pause if 0 < i < len(job.pieces) else self.pause[:0]
        return np.zeros(int(round(ms * SAMPLE_RATE / 1000)), np.float32)

    async def synthesize(self, job: Job) -> np.ndarray:
        """The whole audio: every piece at once (in-flight batching makes a paragraph cost about one
        sentence), joined in order with a pause between pieces."""
        if len(job.pieces) == 1 and job.gaps_ms is None:  # most requests: awaited in place, no task and gather
            return await self._infer(job, 0)
        if job.conditions:
            audios = [a for a, _ in await self._conditioned(job)]
            return self.join(audios, job)
        tasks = self._start(job, 0)
        try:
            audios = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return self.join(audios, job)

    async def _conditioned(self, job: Job) -> list[tuple[np.ndarray, str | None]]:
        """(audio, SPOKEN_TEXT) of every piece: the first alone, then the others at once, conditioned on it."""
        audio, spoken = await self._infer(job, 0, spoken_text=True)
        job.set_reference(audio, spoken)
        tasks = self._start(job, 1, spoken_text=True)
        try:
            return [(audio, spoken)] + list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    async def synthesize_segments(self, job: Job) -> tuple[np.ndarray, list[Segment]]:
        """The whole audio and each piece's segment in it, with the text the server read."""
        if job.conditions:
            results = await self._conditioned(job)
        else:
            tasks = self._start(job, 0, spoken_text=True)
            try:
                results = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        segments, offset = [], 0
        for i, (audio, spoken) in enumerate(results):
            offset += self.gap(job, i).size
            segments.append(Segment(i, job.pieces[i], offset, offset + audio.size, spoken))
            offset += audio.size
        return self.join([a for a, _ in results], job), segments

    def join(self, audios: list[np.ndarray], job: Job | None = None) -> np.ndarray:
        """The pieces' audio in order with the silence between them (the job's, else the pause)."""
        if job is None:
            job = Job([""] * len(audios), {}, 0)
        out: list[np.ndarray] = []
        for i, a in enumerate(audios):
            out += [self.gap(job, i), a]
        out.append(self.gap(job, len(audios)))
        out = [a for a in out if a.size]
        if len(out) == 1:
            return out[0]
        return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)

    async def parts(self, job: Job, spoken_text: bool = False) -> AsyncIterator[Part]:
        """The audio as it is made, each piece followed by its Segment: the first piece's chunks from the
        stream model, then a pause and each other piece whole, in order. The others are sent once the first chunk
        has come (before it they would share the server with it, and they are needed only after the whole first
        piece has been heard). An error raises SynthesisError from the iterator; before the first chunk nothing has
        been sent. `spoken_text`: the segments carry what the server read."""
        rest: list[asyncio.Task] = []
        conditions = job.conditions  # the others wait for the whole first piece: it is their reference
        try:
            told: list[str] = []
            lead = self.gap(job, 0)  # an SSML break before any text: sent once the first chunk came
            offset, started = 0, False
            first: list[np.ndarray] = []
            on_spoken = told.append if spoken_text or conditions else None
            async with contextlib.aclosing(self._stream_first(job, on_spoken)) as chunks:
                try:
                    async for chunk in chunks:
                        if not started:
                            if not conditions:
                                rest = self._start(job, 1, spoken_text)
                            started = True
                            if lead.size:
                                yield lead
                                offset = lead.size
                        if conditions:
                            first.append(chunk)
                        offset += chunk.size
                        yield chunk
                except ChatTTSError as e:
                    raise synthesis_error(e) from None
            if conditions:
                job.set_reference(np.concatenate(first) if first else np.zeros(0, np.float32),
                                  told[0] if told else None)
            if not started or conditions:
                rest = self._start(job, 1, spoken_text)
            if not started and lead.size:
                yield lead
                offset = lead.size
            yield Segment(0, job.pieces[0], lead.size, offset, told[0] if told and spoken_text else None)
            for i, task in enumerate(rest, 1):
                gap = self.gap(job, i)
                if gap.size:
                    yield gap
                    offset += gap.size
                result = await task
                audio, spoken = result if spoken_text else (result, None)
                yield audio
                yield Segment(i, job.pieces[i], offset, offset + audio.size, spoken)
                offset += audio.size
            tail = self.gap(job, len(job.pieces))
            if tail.size:
                yield tail
        finally:
            for t in rest:
                t.cancel()
            if rest:  # collect the cancelled pieces: nothing is left unretrieved
                await asyncio.gather(*rest, return_exceptions=True)

    async def stream(self, job: Job) -> AsyncIterator[np.ndarray]:
        """The audio of `parts` without its segments."""
        async with contextlib.aclosing(self.parts(job)) as parts:
            async for part in parts:
                if isinstance(part, np.ndarray):
                    yield part
