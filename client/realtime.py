"""Realtime speech: text that arrives a delta at a time (an LLM's tokens) spoken piece by piece, in order, with
each piece's place in the audio.

- `TextChunker` cuts pieces out of text as it arrives, with the length-aware splitter
  (chattts_triton.model.split): a piece goes out once its sentence is complete, or, when a sentence runs past the
  frame budget, at a clause; a complete sentence estimated shorter than `min_frames` ("Sure!") waits to join the
  next one. Nothing is dropped or repeated: the pieces joined are the text, less the whitespace between them.
- `SpeechSession` speaks what a chunker cuts through `chattts_stream` (one stream per piece, several pieces at once)
  and hands out ordered events: each piece's audio as it is made, its start and end in the turn's audio, errors;
  `flush` ends a turn, `cancel` (barge-in) stops it at once and cancels every piece on the server. One voice and one
  seed schedule for the whole session: piece n is sent with seed + n.

The gateway's WebSocket (`/v1/audio/speech/stream`) and Wyoming server put a protocol around a session; Python
callers use it directly over gRPC:

    async with AsyncChatTTSClient("127.0.0.1:8001") as tts:
        session = SpeechSession(tts, {"voice": "alloy"})
        for token in llm_tokens:
            await session.append(token)
        await session.flush()
        async for event in session.events():      # in another task while text arrives
            if isinstance(event, Audio): play(event.samples)
            elif isinstance(event, TurnEnd): break
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
import unicodedata
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chattts_triton.config import SAMPLE_RATE
from chattts_triton.model.split import DEFAULT_MIN_FRAMES, estimate_frames, split_spans

from .contract import SynthesisOptions
from .errors import INTERNAL, ChatTTSError, ChatTTSInputError

SEED_LIMIT = 2**63  # SEED is INT64: the schedule wraps below this
# A piece's budget: a sentence estimated longer is cut at clauses. Well under the splitter's default so that a long
# first sentence starts speaking at its first clauses instead of at its full stop.
DEFAULT_PIECE_FRAMES = 384  # ≈ 8 s
DEFAULT_PAUSE_S = 0.2  # silence between the pieces of a turn, as the speech gateway joins them
# pieces of one session synthesised at once: the one being heard and the next are enough to keep the audio
# gapless (synthesis outruns playback), and every stream more holds a server slot other sessions may need
DEFAULT_PIECE_CONCURRENCY = 2
# an overloaded server (UNAVAILABLE before a piece's first audio) is asked again, with backoff, this long: a piece
# late is better than a piece dropped from a conversation
DEFAULT_RETRY_S = 30.0
RETRY_BACKOFF_S = (0.05, 1.0)  # first wait, longest wait
DEFAULT_IDLE_FLUSH_S = 0.5  # text left this long without a new delta is spoken as it is
SPEAKER_OPTIONS = ("voice", "speaker", "speaker_sample", "speaker_audio")

# A sentence end the splitter honours (split._SENTENCE_END), as it may stand at the end of text still arriving: a
# newline or 。！？!?… at once; a "." only after a letter (after a digit it may be "3." of "3.5"), and only once a
# space follows it ("Dr." is no end) or, at the end of the text, immediately: an LLM's next token brings the space.
_END = re.compile(r"\n|[。！？!?…]+[」』”’)）\]】\"']*|(?<=[^\W\d_])\.(?=\s|$)")


def speakable(text: str) -> bool:
    """Whether `text` has anything to say: a letter or a digit (not only punctuation, symbols or emoji)."""
    return any(unicodedata.category(c)[0] in "LN" for c in text)


class TextChunker:
    """Text in as deltas, pieces out as they are complete (see the module docstring)."""

    def __init__(self, max_frames: int = DEFAULT_PIECE_FRAMES, min_frames: int = DEFAULT_MIN_FRAMES):
        if not 1 <= max_frames:
            raise ValueError(f"max_frames must be ≥ 1, got {max_frames}")
        if min_frames < 0:
            raise ValueError(f"min_frames must be ≥ 0, got {min_frames}")
        self.max_frames, self.min_frames = int(max_frames), min(int(min_frames), int(max_frames))
        self._buf = ""

    @property
    def pending(self) -> str:
        """The text received and not yet cut into a piece."""
        return self._buf

    def push(self, delta: str) -> list[str]:
        """The pieces `delta` completes (often none)."""
        if not isinstance(delta, str):
            raise TypeError(f"text must be a str, got {type(delta).__name__}")
        self._buf += delta
        return self._take(final=False)

    def flush(self) -> list[str]:
        """Everything pending, as pieces (the end of a turn, or text left idle)."""
        return self._take(final=True)

    def clear(self) -> str:
        """Drops the pending text (barge-in) and returns it."""
        dropped, self._buf = self._buf, ""
        return dropped

    def _spans(self, end: int) -> list[tuple]:
        return split_spans(self._buf[:end], self.max_frames, self.min_frames)

    def _take(self, final: bool) -> list[str]:
        buf = self._buf
        if final:
            spans, cut = self._spans(len(buf)), len(buf)
        else:
            complete = max((m.end() for m in _END.finditer(buf)), default=0)
            spans, cut = self._spans(complete), complete
            # a short last sentence waits to join the next one (the splitter would have joined them)
            if spans and self.min_frames and estimate_frames(buf[spans[-1][0]:spans[-1][1]]) < self.min_frames:
                cut = spans.pop()[0]
            # a sentence still arriving that is past the budget: its complete clauses go now
            rest = split_spans(buf[cut:], self.max_frames, self.min_frames)
            if len(rest) > 1:
                spans += [(cut + s, cut + e) for s, e in rest[:-1]]
                cut += rest[-1][0]
        # nothing to say on its own ("…", an emoji): it goes with the piece after it, or the one before at the end;
        # a joined piece is the original text from its first part to its last
        pieces: list[list[int]] = []
        held: int | None = None  # where the unspeakable parts waiting for a speakable one start
        for s, e in spans:
            if speakable(buf[s:e]):
                pieces.append([s if held is None else held, e])
                held = None
            elif held is None:
                held = s
        if held is not None:
            if not final:
                cut = held
            elif pieces:
                pieces[-1][1] = spans[-1][1]
            else:
                pieces.append([held, spans[-1][1]])  # a turn of nothing speakable: the session reports it silent
        self._buf = buf[cut:]
        return [buf[s:e] for s, e in pieces]


# --- events, in the order a session hands them out ----------------------------------------------------------------
@dataclass
class SegmentStart:
    turn: int
    index: int  # the piece's number in the session (its seed is the session's seed + index)
    text: str
    start: int  # sample offset in the turn's audio, at SAMPLE_RATE
    cut_at: float = 0.0  # time.perf_counter() when the text that completed the piece came


@dataclass
class Audio:
    turn: int
    index: int
    samples: np.ndarray  # float32 mono at SAMPLE_RATE; a pause before a piece is zeros with that piece's index


@dataclass
class SegmentEnd:
    turn: int
    index: int
    text: str
    spoken_text: str | None  # what the server read (numbers in words, characters it cannot say removed)
    start: int
    end: int  # [start, end) in the turn's audio, at SAMPLE_RATE


@dataclass
class SegmentError:
    turn: int
    index: int
    text: str
    error: ChatTTSError  # the piece is not spoken (or not to its end); the turn goes on


@dataclass
class TurnEnd:
    turn: int
    samples: int  # the turn's audio, all handed out


@dataclass
class TurnCancelled:
    turn: int
    samples: int  # the turn's audio handed out before the cancel


Event = SegmentStart | Audio | SegmentEnd | SegmentError | TurnEnd | TurnCancelled
_DONE = object()
_CLOSED = object()


@dataclass
class _Piece:
    turn: int
    index: int
    text: str
    chunks: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    spoken: list[str] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    cut_at: float = field(default_factory=time.perf_counter)


@dataclass
class _EndOfTurn:
    turn: int


class SpeechSession:
    """Text deltas in, ordered speech events out (see the module docstring). Methods are called from one event loop;
    `events()` has one consumer."""

    def __init__(self, client: Any, options: SynthesisOptions | Mapping[str, Any] | None = None,
                 seed: int | None = None, *,
                 max_frames: int = DEFAULT_PIECE_FRAMES, min_frames: int = DEFAULT_MIN_FRAMES,
                 pause_s: float = DEFAULT_PAUSE_S, piece_concurrency: int = DEFAULT_PIECE_CONCURRENCY,
                 idle_flush_s: float | None = DEFAULT_IDLE_FLUSH_S, chunk_timeout_s: float | None = None,
                 retry_s: float = DEFAULT_RETRY_S):
        options = SynthesisOptions.of(options)  # an unknown name: TypeError; a bad value: ChatTTSInputError naming it
        if "seed" in options:
            raise ChatTTSInputError("give the session's seed as `seed`: piece n is sent with seed + n")
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < SEED_LIMIT):
            raise ChatTTSInputError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        if pause_s < 0 or piece_concurrency < 1 or (idle_flush_s is not None and idle_flush_s <= 0):
            raise ValueError("pause_s must be ≥ 0, piece_concurrency ≥ 1, idle_flush_s > 0 or None")
        self.client = client
        self.seed = secrets.randbits(62) if seed is None else seed
        if not any(k in options for k in SPEAKER_OPTIONS):  # one voice for every piece: the seed's speaker
            options = options.replace(voice=str(self.seed))
        self.options: SynthesisOptions = options
        self.chunker = TextChunker(max_frames, min_frames)
        self.pause = np.zeros(int(round(pause_s * SAMPLE_RATE)), np.float32)
        self.idle_flush_s = idle_flush_s
        self.chunk_timeout_s = chunk_timeout_s
        self.retry_s = float(retry_s)
        self.turn = 0
        self._next_index = 0
        self._gate = asyncio.Semaphore(piece_concurrency)
        self._queue: asyncio.Queue[Any] = asyncio.Queue()  # pieces and ends of turns, in order
        self._out: asyncio.Queue[Any] = asyncio.Queue()  # events for the consumer
        self._live: list[_Piece] = []  # pieces whose synthesis has not ended
        self._turn_samples = 0  # audio of the current output turn put out so far
        self._idle: asyncio.TimerHandle | None = None
        self._closed = False
        self._sequencer = asyncio.ensure_future(self._sequence())

    @property
    def pieces_ahead(self) -> int:
        """Pieces cut and waiting for their turn to be handed out (the one being handed out not counted)."""
        return self._queue.qsize()

    # --- input ----------------------------------------------------------------------------------------------------
    async def append(self, text: str) -> None:
        """A text delta: the pieces it completes start at once."""
        self._check_open()
        self._start(self.chunker.push(text))
        self._arm_idle()

    async def flush(self) -> None:
        """Ends the turn: what is pending is spoken, and TurnEnd follows the turn's audio."""
        self._check_open()
        self._disarm_idle()
        self._start(self.chunker.flush())
        self._queue.put_nowait(_EndOfTurn(self.turn))
        self.turn += 1

    async def cancel(self) -> int:
        """Barge-in: the pending text is dropped, every piece of the session cancelled on the server, the events not
        yet taken dropped; TurnCancelled follows. The session goes on with the next append. Returns the turn."""
        self._check_open()
        self._disarm_idle()
        self.chunker.clear()
        turn, ending = self._halt()
        self._out.put_nowait(TurnCancelled(turn, self._turn_samples))  # before the calls' ends: nothing more comes
        self._turn_samples = 0
        self.turn = max(self.turn, turn) + 1
        await self._ended(ending)
        self._sequencer = asyncio.ensure_future(self._sequence())
        return turn

    async def close(self) -> None:
        """Cancels what is in flight; `events()` ends after what it already holds."""
        if self._closed:
            return
        self._closed = True
        self._disarm_idle()
        _, ending = self._halt(drop_events=False)
        await self._ended(ending)
        self._out.put_nowait(_CLOSED)

    async def __aenter__(self) -> SpeechSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._out.get()
            if event is _CLOSED:
                return
            yield event

    # --- inside -----------------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ChatTTSError(INTERNAL, "the session is closed")

    def _arm_idle(self) -> None:
        self._disarm_idle()
        if self.idle_flush_s is not None and self.chunker.pending.strip():
            self._idle = asyncio.get_running_loop().call_later(self.idle_flush_s, self._idle_flush)

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_flush(self) -> None:
        self._idle = None
        if not self._closed:
            self._start(self.chunker.flush())

    def _start(self, texts: list[str]) -> None:
        for text in texts:
            piece = _Piece(self.turn, self._next_index, text)
            self._next_index += 1
            if speakable(text):
                piece.task = asyncio.ensure_future(self._synthesize(piece))
                self._live.append(piece)
            else:
                piece.chunks.put_nowait(_DONE)
            self._queue.put_nowait(piece)

    async def _synthesize(self, piece: _Piece) -> None:
        try:
            async with self._gate:
                options = self.options.replace(seed=(self.seed + piece.index) % SEED_LIMIT)
                deadline, wait = time.monotonic() + self.retry_s, RETRY_BACKOFF_S[0]
                while True:
                    sent = False
                    chunks = self.client.stream(piece.text, split=False, voice_from_first=False,
                                                on_spoken_text=piece.spoken.append,
                                                chunk_timeout_s=self.chunk_timeout_s,
                                                **options)
                    try:
                        async with contextlib.aclosing(chunks):
                            async for chunk in chunks:
                                sent = True
                                piece.chunks.put_nowait(chunk)
                        break
                    except ChatTTSError as e:
                        if sent or not e.retryable or time.monotonic() + wait > deadline:
                            raise
                    await asyncio.sleep(wait)
                    wait = min(2 * wait, RETRY_BACKOFF_S[1])
            piece.chunks.put_nowait(_DONE)
        except ChatTTSError as e:
            piece.chunks.put_nowait(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  any failure of one piece is that piece's error event, never the session's
            piece.chunks.put_nowait(ChatTTSError(INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            with contextlib.suppress(ValueError):
                self._live.remove(piece)

    async def _sequence(self) -> None:
        """Hands out the pieces' events strictly in order."""
        out = self._out
        while True:
            item = await self._queue.get()
            if isinstance(item, _EndOfTurn):
                out.put_nowait(TurnEnd(item.turn, self._turn_samples))
                self._turn_samples = 0
                continue
            piece: _Piece = item
            started = False
            while True:
                chunk = await piece.chunks.get()
                if chunk is _DONE:
                    break
                if isinstance(chunk, ChatTTSError):
                    out.put_nowait(SegmentError(piece.turn, piece.index, piece.text, chunk))
                    break
                if not started:
                    if self._turn_samples and self.pause.size:
                        out.put_nowait(Audio(piece.turn, piece.index, self.pause))
                        self._turn_samples += self.pause.size
                    start = self._turn_samples
                    out.put_nowait(SegmentStart(piece.turn, piece.index, piece.text, start, piece.cut_at))
                    started = True
                out.put_nowait(Audio(piece.turn, piece.index, chunk))
                self._turn_samples += chunk.size
            if started:
                out.put_nowait(SegmentEnd(piece.turn, piece.index, piece.text,
                                          piece.spoken[0] if piece.spoken else None,
                                          start, self._turn_samples))
            elif not speakable(piece.text):  # nothing to say: consumed, silent, in its place
                out.put_nowait(SegmentStart(piece.turn, piece.index, piece.text, self._turn_samples, piece.cut_at))
                out.put_nowait(SegmentEnd(piece.turn, piece.index, piece.text, "", self._turn_samples,
                                          self._turn_samples))

    def _halt(self, drop_events: bool = True):
        """Stops the sequencer and every piece at once (no await: nothing more is handed out from here) and drops
        what is queued; returns the turn whose audio was being handed out and what is still ending."""
        self._sequencer.cancel()
        live, self._live = list(self._live), []
        for piece in live:
            piece.task.cancel()
        turn = self.turn
        while not self._queue.empty():
            turn = min(turn, self._queue.get_nowait().turn)
        if drop_events:
            while not self._out.empty():
                event = self._out.get_nowait()
                if isinstance(event, Audio):
                    self._turn_samples -= event.samples.size
                turn = min(turn, getattr(event, "turn", turn))
        return turn, [self._sequencer] + [p.task for p in live]

    @staticmethod
    async def _ended(tasks) -> None:
        """Waits for halted tasks: each stream's call is cancelled on the server as its task ends."""
        await asyncio.gather(*tasks, return_exceptions=True)
