"""`WS /v1/audio/speech/stream`: text in as it is written (an LLM's tokens), audio out as it is made, on one
WebSocket, with each piece's place in the audio and barge-in. The protocol is in docs/realtime.md.

Client → server, JSON text frames:
    {"type": "session.update", "session": {...settings}}   voice, response_format, sample_rate, seed, speed, ...
    {"type": "text", "text": "Hel"}                         a delta of any size
    {"type": "flush"}                                       ends the turn: the rest is spoken, then turn.done
    {"type": "cancel"}                                      barge-in: stop now, then turn.cancelled
Server → client: session.created / session.updated (the settings in force, the seed), the audio as binary frames
(or {"type": "audio"} with base64), segment.start / segment.end (each piece's text and its samples in the output),
turn.done / turn.cancelled, error.

A thin protocol around `client.realtime.SpeechSession`: the session cuts and orders the pieces, this module validates
messages, encodes (resampling, G.711, containers: gateway.audio) and counts.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import time
from typing import Any, Literal

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field, ValidationError

from chattts_triton.config import LIMITS
from chattts_triton.model.split import DEFAULT_MIN_FRAMES
from client.contract import SynthesisOptions
from client.errors import ChatTTSError
from client.realtime import (
    DEFAULT_IDLE_FLUSH_S,
    DEFAULT_PIECE_CONCURRENCY,
    DEFAULT_PIECE_FRAMES,
    Audio,
    SegmentEnd,
    SegmentError,
    SegmentStart,
    SpeechSession,
    TurnCancelled,
    TurnEnd,
)

from . import api
from .audio import StreamEncoder, needs_pyav, out_length

log = logging.getLogger("chattts_gateway")
PATH = "/v1/audio/speech/stream"
MAX_DELTA_CHARS = api.MAX_INPUT_CHARS  # one text message
MAX_PENDING_CHARS = 4 * api.MAX_INPUT_CHARS  # text received and not yet cut into pieces (no sentence end in sight)
# pieces waiting behind the one being sent: a client that sends text far ahead of the audio it takes (or never reads)
# is told to wait instead of holding the gateway's memory for it
MAX_PIECES_AHEAD = 64
MAX_MESSAGE_BYTES = 64 << 10  # a message of the longest delta, JSON-escaped, is well under this
INLINE_FORMATS = ("pcm", "ulaw", "alaw")  # encoded on the event loop (a numpy cast, libsndfile); the rest on a thread
POLICY_VIOLATION = 1008  # WebSocket close codes (RFC 6455)
TRY_AGAIN_LATER = 1013


class SessionSettings(api.ChatTTSOptions):
    """`session.update`'s `session`: the speech request's options (api.ChatTTSOptions: speed, sample_rate, seed, the
    ChatTTS extras), `model`, `voice`, `response_format`, and the session's own. Unknown fields are ignored, as on
    `/v1/audio/speech`."""

    model: str = api.MODELS[0]
    voice: str | api.VoiceRef | None = None  # none: the seed's speaker, the same for the whole session
    response_format: api.ResponseFormat = "pcm"
    # --- the session's own
    audio: Literal["binary", "base64"] = "binary"  # binary WebSocket frames, or {"type": "audio", "audio": base64}
    max_piece_frames: int = Field(DEFAULT_PIECE_FRAMES, ge=16, le=LIMITS.max_new_tokens)
    min_piece_frames: int = Field(DEFAULT_MIN_FRAMES, ge=0, le=LIMITS.max_new_tokens)
    pause_ms: int | None = Field(None, ge=0, le=5000)  # default: the gateway's --pause-ms
    idle_flush_ms: int = Field(int(DEFAULT_IDLE_FLUSH_S * 1000), ge=0, le=60_000)  # 0: only `flush` speaks the rest

    def public(self, seed: int) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        d["seed"] = seed
        return d


def parse_settings(given: Any, base: SessionSettings | None = None) -> SessionSettings:
    """`base` updated with `given` (a JSON object), or APIError(400) naming the field at fault."""
    if not isinstance(given, dict):
        raise api.invalid("'session' must be an object", "session")
    merged = {**(base.model_dump() if base is not None else {}), **given}
    if base is not None and "seed" not in given:
        merged.pop("seed", None)  # a new session draws a new seed unless told
    try:
        s = SessionSettings.model_validate(merged)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int) and x not in ("str", "VoiceRef")]
        field = loc[0] if loc else None
        raise api.invalid(f"'session.{'.'.join(loc)}': {err.get('msg')}", field) from None
    api.check_model(s.model)
    api.check_options(s, given)
    return s


class RealtimeMetrics:
    def __init__(self, registry):
        r = registry
        self.sessions = Gauge("chattts_gateway_ws_sessions", "realtime WebSocket sessions open", registry=r,
                              multiprocess_mode="livesum")
        self.turns = Counter("chattts_gateway_ws_turns", "realtime turns ended, by outcome (done, cancelled, closed)",
                             ["outcome"], registry=r)
        self.segments = Counter("chattts_gateway_ws_segments", "realtime pieces ended, by outcome (spoken, error)",
                                ["outcome"], registry=r)
        self.first_audio = Histogram("chattts_gateway_ws_first_audio_seconds",
                                     "from the text that completed a turn's first piece to its first audio byte sent",
                                     buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5),
                                     registry=r)
        self.messages = Counter("chattts_gateway_ws_messages", "client messages, by type (invalid: refused)", ["type"],
                                registry=r)


def _seconds(samples: int, rate: int) -> float:
    return round(samples / rate, 6)


class Connection:
    """One WebSocket: its settings, its SpeechSession, the task that sends the session's events."""

    def __init__(self, gw, ws: WebSocket, metrics: RealtimeMetrics):
        self.gw, self.ws, self.metrics = gw, ws, metrics
        self.settings = SessionSettings()
        self.session: SpeechSession | None = None
        self.sender: asyncio.Task[None] | None = None
        self.encoder: StreamEncoder | None = None
        self.open_turns = 0  # turns with text whose end (done or cancelled) has not been sent
        self.text_in_turn = False
        # turn → when the text that completed its first piece came, until its first byte
        self.first_cut: dict[int, float] = {}
        self.send_lock = asyncio.Lock()
        self.busy: asyncio.Future | None = None

    # --- sending ----------------------------------------------------------------------------------------------------
    async def send_json(self, obj: dict[str, Any]) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps(obj, ensure_ascii=False))

    async def send_audio(self, data: bytes, turn: int, index: int) -> None:
        if not data:
            return
        if self.settings.audio == "base64":
            await self.send_json({"type": "audio", "turn": turn, "index": index,
                                  "audio": base64.b64encode(data).decode("ascii")})
        else:
            async with self.send_lock:
                await self.ws.send_bytes(data)

    async def error(self, e: api.APIError, **where) -> None:
        await self.send_json({"type": "error", **where, **e.body()})

    async def _encode(self, fn, *args) -> bytes:
        if self.settings.response_format in INLINE_FORMATS:
            return fn(*args)
        self.busy = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        return await asyncio.shield(self.busy)

    def _rate_of(self, samples24k: int) -> dict[str, Any]:
        return {"sample": out_length(samples24k, self.settings.sample_rate),
                "seconds": _seconds(out_length(samples24k, self.settings.sample_rate), self.settings.sample_rate)}

    async def _send_events(self, session: SpeechSession) -> None:
        try:
            async for ev in session.events():
                await self._send_event(ev)
        except (WebSocketDisconnect, RuntimeError, OSError):  # the client went away: the receiver closes the session
            pass
        except Exception:  # a fault here ends this connection (the receiver then closes the session)
            log.exception("realtime session: sending failed")
            with contextlib.suppress(Exception):
                await self.ws.close(1011, "internal error")

    async def _send_event(self, ev) -> None:
        rate, fmt = self.settings.sample_rate, self.settings.response_format
        if isinstance(ev, Audio):
            if self.encoder is None:
                self.encoder = StreamEncoder(fmt, rate)
            data = await self._encode(self.encoder.push, ev.samples)
            await self.send_audio(data, ev.turn, ev.index)
            if data and ev.turn in self.first_cut:  # (a resampler may hold the first chunk's audio back)
                self.metrics.first_audio.observe(time.perf_counter() - self.first_cut.pop(ev.turn))
        elif isinstance(ev, SegmentStart):
            start = self._rate_of(ev.start)
            await self.send_json({"type": "segment.start", "turn": ev.turn, "index": ev.index, "text": ev.text,
                                  "start_sample": start["sample"], "start": start["seconds"]})
            if ev.turn not in self.first_cut and ev.start == 0:  # the turn's first piece: its audio follows
                self.first_cut[ev.turn] = ev.cut_at
        elif isinstance(ev, SegmentEnd):
            start, end = self._rate_of(ev.start), self._rate_of(ev.end)
            self.metrics.segments.labels("spoken").inc()
            await self.send_json({"type": "segment.end", "turn": ev.turn, "index": ev.index, "text": ev.text,
                                  "spoken_text": ev.spoken_text, "start_sample": start["sample"],
                                  "end_sample": end["sample"], "start": start["seconds"], "end": end["seconds"]})
        elif isinstance(ev, SegmentError):
            self.metrics.segments.labels("error").inc()
            self.gw.metrics.errors.labels(ev.error.status).inc()
            await self.error(_segment_error(ev.error), turn=ev.turn, index=ev.index, text=ev.text)
        elif isinstance(ev, TurnEnd):
            if self.encoder is not None:
                tail = await self._encode(self.encoder.close)
                await self.send_audio(tail, ev.turn, -1)
                self.encoder = None
            self._turn_ended(ev.turn, "done")
            end = self._rate_of(ev.samples)
            await self.send_json({"type": "turn.done", "turn": ev.turn, "samples": end["sample"],
                                  "duration": end["seconds"]})
        elif isinstance(ev, TurnCancelled):
            self._drop_encoder()
            self._turn_ended(ev.turn, "cancelled")
            end = self._rate_of(ev.samples)
            await self.send_json({"type": "turn.cancelled", "turn": ev.turn, "samples": end["sample"],
                                  "duration": end["seconds"]})

    def _turn_ended(self, turn: int, outcome: str) -> None:
        self.open_turns = max(0, self.open_turns - 1)
        self.first_cut.pop(turn, None)
        self.metrics.turns.labels(outcome).inc()
        if outcome == "done":
            self.gw.metrics.requests.labels(self.settings.response_format, "realtime", "200").inc()

    def _drop_encoder(self) -> None:
        if self.encoder is not None:
            self.encoder.abort()
            self.encoder = None

    # --- the session ------------------------------------------------------------------------------------------------
    def _new_session(self) -> SpeechSession:
        s = self.settings
        options = SynthesisOptions.of(api.contract_options(s))
        pause_ms = self.gw.settings.pause_ms if s.pause_ms is None else s.pause_ms
        session = SpeechSession(self.gw.synth.client, options, s.seed, max_frames=s.max_piece_frames,
                                min_frames=min(s.min_piece_frames, s.max_piece_frames), pause_s=pause_ms / 1000,
                                piece_concurrency=min(DEFAULT_PIECE_CONCURRENCY, self.gw.settings.piece_concurrency),
                                idle_flush_s=(s.idle_flush_ms / 1000) or None,
                                chunk_timeout_s=self.gw.settings.timeout_s)
        self.session = session
        self.sender = asyncio.ensure_future(self._send_events(session))
        return session

    async def _end_session(self) -> None:
        session, sender = self.session, self.sender
        self.session = self.sender = None
        if session is not None:
            await session.close()
        if sender is not None:
            with contextlib.suppress(BaseException):
                await sender
        if self.busy is not None:
            with contextlib.suppress(BaseException):
                await self.busy
        self._drop_encoder()

    # --- receiving --------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        session = self._new_session()
        await self.send_json({"type": "session.created", "session": self.settings.public(session.seed)})
        try:
            while True:
                raw = await self.ws.receive()
                if raw["type"] == "websocket.disconnect":
                    break
                try:
                    await self.handle(raw)
                except api.APIError as e:
                    self.metrics.messages.labels("invalid").inc()
                    await self.error(e)
        except WebSocketDisconnect:
            pass
        finally:
            if self.open_turns or self.text_in_turn:
                self.metrics.turns.labels("closed").inc()
            await self._end_session()

    async def handle(self, raw: dict[str, Any]) -> None:
        text = raw.get("text")
        if text is None:
            raise api.invalid("messages are JSON text frames ({\"type\": ...}); binary frames are not taken", "type")
        if len(text) > MAX_MESSAGE_BYTES:
            raise api.invalid(f"a message may have at most {MAX_MESSAGE_BYTES} bytes", "text")
        try:
            msg = json.loads(text)
        except ValueError as e:
            raise api.invalid(f"a message must be a JSON object ({e})", None) from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise api.invalid("a message must be a JSON object with a string 'type'", "type")
        kind = msg["type"]
        handler = {"text": self.on_text, "flush": self.on_flush, "cancel": self.on_cancel,
                   "session.update": self.on_update}.get(kind)
        if handler is None:
            raise api.invalid(f"unknown message type {kind!r}; one of text, flush, cancel, session.update", "type")
        self.metrics.messages.labels(kind).inc()
        await handler(msg)

    async def on_text(self, msg: dict[str, Any]) -> None:
        delta = msg.get("text")
        if not isinstance(delta, str):
            raise api.invalid("'text' must be a string", "text")
        if len(delta) > MAX_DELTA_CHARS:
            raise api.invalid(f"'text' has {len(delta)} characters, more than {MAX_DELTA_CHARS} in one message", "text")
        if len(self.session.chunker.pending) + len(delta) > MAX_PENDING_CHARS:
            raise api.invalid(f"more than {MAX_PENDING_CHARS} characters without a sentence end: send 'flush'", "text")
        if self.session.pieces_ahead >= MAX_PIECES_AHEAD:
            raise api.APIError(429, f"{MAX_PIECES_AHEAD} pieces are waiting to be spoken: send more text once their "
                               "audio has come", "rate_limit_error", "text", "too_far_ahead")
        if not delta:
            return
        if not self.text_in_turn:
            self.text_in_turn = True
            self.open_turns += 1
        await self.session.append(delta)
        if msg.get("flush") is True:
            await self.on_flush(msg)

    async def on_flush(self, msg: dict[str, Any]) -> None:
        if not self.text_in_turn:  # nothing sent since the last turn ended: an empty turn ends at once
            self.open_turns += 1
        self.text_in_turn = False
        await self.session.flush()

    async def on_cancel(self, msg: dict[str, Any]) -> None:
        self.open_turns = 1  # whatever was open ends in the one turn.cancelled that answers every cancel
        self.text_in_turn = False
        await self.session.cancel()

    async def on_update(self, msg: dict[str, Any]) -> None:
        if self.open_turns or self.text_in_turn:
            raise api.invalid("session.update is taken between turns (after turn.done or turn.cancelled)", "type")
        settings = parse_settings(msg.get("session"), self.settings)
        if not self.gw.pyav and needs_pyav(settings.response_format, True):
            raise api.invalid(f"response_format {settings.response_format!r} streamed is not available on this server "
                              "(FFmpeg's PyAV is not installed)", "response_format")
        await self._end_session()
        self.settings = settings
        session = self._new_session()
        await self.send_json({"type": "session.updated", "session": settings.public(session.seed)})


def _segment_error(e: ChatTTSError) -> api.APIError:
    from .app import api_error  # the same mapping as the REST path's (app imports this module)
    from .synth import synthesis_error

    err = api_error(synthesis_error(e))
    if err.param == "input":  # the session's text came in `text` messages
        err.param = "text"
    return err


def _authorized(gw, ws: WebSocket) -> bool:
    """The gateway's API keys: `Authorization: Bearer KEY`, or `?api_key=KEY` for browsers (which cannot set headers
    on a WebSocket)."""
    keys = gw.settings.api_keys
    if not keys:
        return True
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ws.query_params.get("api_key", "")
    return bool(token) and any([hmac.compare_digest(token.encode(), k.encode()) for k in keys])


def install(app: FastAPI, gw) -> RealtimeMetrics:
    metrics = RealtimeMetrics(gw.metrics.registry)
    gw.ws_sessions = 0

    @app.websocket(PATH)
    async def speech_stream(ws: WebSocket):
        if not _authorized(gw, ws):
            await ws.close(POLICY_VIOLATION, "a valid API key is required")
            return
        if gw.ws_sessions >= gw.settings.max_concurrency:
            await ws.close(TRY_AGAIN_LATER, f"more than {gw.settings.max_concurrency} sessions, retry later")
            return
        await ws.accept()
        gw.ws_sessions += 1
        metrics.sessions.inc()
        try:
            await Connection(gw, ws, metrics).run()
        except Exception:  # a fault of this module ends its connection, never the app
            log.exception("realtime session failed")
            with contextlib.suppress(Exception):
                await ws.close(1011, "internal error")
        finally:
            gw.ws_sessions -= 1
            metrics.sessions.dec()

    return metrics
