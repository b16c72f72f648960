"""`python -m gateway.wyoming`: the Wyoming protocol (Home Assistant's text-to-speech integration) in front of a
running Triton server.

    python -m gateway.wyoming --grpc-url 127.0.0.1:8001 --host 0.0.0.0 --port 10200 --repo build/repo   # make wyoming

describe → info (one TtsProgram, a TtsVoice per voice, streaming supported); synthesize → audio-start,
audio-chunk…, audio-stop; synthesize-start, synthesize-chunk…, synthesize-stop → the audio of each sentence as soon
as it is complete, then synthesize-stopped. Audio: 16-bit mono PCM at --sample-rate. See docs/wyoming.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler, AsyncTcpServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from chattts_triton.config import BUILTIN_VOICE_SEEDS, SAMPLE_RATE
from client.contract import OPTION_INPUTS, SynthesisOptions, input_datatype
from client.errors import ChatTTSError
from client.realtime import (
    DEFAULT_IDLE_FLUSH_S,
    DEFAULT_PAUSE_S,
    DEFAULT_PIECE_CONCURRENCY,
    Audio,
    SegmentError,
    SpeechSession,
    TurnCancelled,
    TurnEnd,
)

from .api import MAX_INPUT_CHARS
from .audio import SAMPLE_RATES, StreamEncoder
from .synth import Synthesizer, synthesis_error

log = logging.getLogger("chattts_wyoming")

DEFAULT_PORT = 10200  # the port Home Assistant's Wyoming TTS services use (wyoming-piper)
DEFAULT_VOICE = "alloy"  # spoken when an event names no voice: one stable voice, not a random one per reply
WIDTH, CHANNELS = 2, 1  # 16-bit mono
# an event's data or payload above this is refused (a text event of the longest text is < 50 KB)
MAX_EVENT_BYTES = 1 << 20
DISCARD_S = 2.0  # how long the rest of a refused stream of bytes is read before the connection closes
LANGUAGES = ["en", "zh"]  # what ChatTTS speaks
PROGRAM = "chattts-triton"
CHATTTS = Attribution(name="2noise", url="https://github.com/2noise/ChatTTS")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("chattts_triton")
    except PackageNotFoundError:
        return "0.2.0"


@dataclass
class Settings:
    grpc_url: str = "127.0.0.1:8001"
    repo: Path | None = None  # the model repository, for the voices `describe` lists (its voices.json)
    voice_store: str = ""  # the voice store `describe` lists (empty: env, the repository's setting, its voices.json)
    voice: str = DEFAULT_VOICE
    sample_rate: int = SAMPLE_RATE
    seed: int | None = None  # every synthesis starts its seed schedule here (None: random per synthesis)
    options: dict[str, Any] = field(default_factory=lambda: {"prompt": "[speed_5]"})  # contract keywords of every piece
    timeout_s: float = 300.0  # each stream's next chunk
    channels: int = 2
    piece_concurrency: int = DEFAULT_PIECE_CONCURRENCY
    pause_s: float = DEFAULT_PAUSE_S
    idle_flush_s: float | None = DEFAULT_IDLE_FLUSH_S
    samples_per_chunk: int = 1024  # samples of one audio-chunk event, as wyoming-piper sends them
    max_text_chars: int = MAX_INPUT_CHARS  # one synthesis's text (a whole `synthesize`, or a stream's chunks together)
    streaming: bool = True  # advertise and serve synthesize-start/-chunk/-stop


class BadEvent(Exception):
    """An event this server cannot take: `code` goes into the error event."""

    def __init__(self, text: str, code: str = "bad-request"):
        super().__init__(text)
        self.text, self.code = text, code


# --- voices and the info event ------------------------------------------------------------------------------------
def voices(repo: Path | None, voice_store: str = "") -> list[tuple[str, str]]:
    """(name, description) of each voice VOICE can name, as the speech gateway lists them: the voice store's (its URL
    `voice_store`, else env CHATTTS_VOICE_STORE, else the repository's setting, else its voices.json), or the built-in
    voices without a store or a repository. StoreError where the store cannot be read (a server that was, once read:
    the voices read last)."""
    from chattts_triton.runtime.voices import store_url

    follower = _voice_listing(repo, store_url(repo, voice_store))
    if follower is None:  # the server serves the built-ins then
        return [(n, f"{n} (seed {s})") for n, s in sorted(BUILTIN_VOICE_SEEDS.items())]
    return follower.current()[1]


@functools.lru_cache(maxsize=8)
def _voice_listing(repo: Path | None, url: str):
    """The store's listing, followed as the models follow the store (one connection a process, its poll interval)."""
    from chattts_triton.runtime.stores import Follower
    from chattts_triton.runtime.voices import open_voice_store, voices_of

    if not url and repo is None:
        return None

    def listed(docs) -> list[tuple[str, str]]:
        return [(n, f"{n} ({v.description or v.source})") for n, v in sorted(voices_of(docs)[0].items())]

    return Follower(open_voice_store(url, repo), listed, "voice store (describe)")


def info(settings: Settings) -> Info:
    from chattts_triton.runtime.stores import StoreError

    try:
        listed = voices(settings.repo, settings.voice_store)
    except StoreError as e:
        raise BadEvent(f"the voice store cannot be read: {e}", "voice-store-error") from None
    tts_voices = [TtsVoice(name=name, description=description, attribution=CHATTTS, installed=True, version=None,
                           languages=list(LANGUAGES)) for name, description in listed]
    return Info(tts=[TtsProgram(name=PROGRAM, description="ChatTTS served by NVIDIA Triton Inference Server",
                                attribution=CHATTTS, installed=True, version=_version(), voices=tts_voices,
                                supports_synthesize_streaming=settings.streaming)])


# --- reading events, bounded --------------------------------------------------------------------------------------
async def read_event(reader: asyncio.StreamReader, max_bytes: int = MAX_EVENT_BYTES) -> Event | None:
    """The next event, None at the end of the connection. wyoming.event.async_read_event with bounds: its reader
    takes any data_length and payload_length a peer announces (memory) and fails on a header that is JSON but not
    an object; here both are a BadEvent. A header line is bounded by the StreamReader's own limit (64 KiB)."""
    try:
        line = await reader.readline()
    except ValueError:  # no newline within the reader's limit
        raise BadEvent("an event header longer than the reader's limit", "bad-event") from None
    if not line:
        return None
    header = _json_object(line, "header")
    kind = header.get("type")
    if not isinstance(kind, str) or not kind:
        raise BadEvent("an event header without a 'type' string", "bad-event")
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise BadEvent("an event's 'data' must be an object", "bad-event")
    lengths = []
    for key in ("data_length", "payload_length"):
        n = header.get(key) or 0
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= max_bytes:
            raise BadEvent(f"an event's {key} must be an integer in [0, {max_bytes}], got {n!r:.40}", "bad-event")
        lengths.append(n)
    try:
        if lengths[0]:
            data = {**data, **_json_object(await reader.readexactly(lengths[0]), "data")}
        payload = await reader.readexactly(lengths[1]) if lengths[1] else None
    except asyncio.IncompleteReadError:
        return None  # the peer left in the middle of an event
    return Event(type=kind, data=data, payload=payload)


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:  # also bytes that are not UTF-8
        raise BadEvent(f"an event {what} that is not JSON", "bad-event") from None
    if not isinstance(value, dict):
        raise BadEvent(f"an event {what} that is not a JSON object", "bad-event")
    return value


def _text(event: Event) -> str:
    text = event.data.get("text")
    if not isinstance(text, str):
        raise BadEvent(f"{event.type}: 'text' must be a string")
    return text


def _voice(event: Event, default: str) -> str:
    """The event's voice.name (a voice of the registry or a seed number), else the default voice. A language alone
    keeps the default (every voice speaks both); a speaker is ignored: a ChatTTS voice has one."""
    voice = event.data.get("voice")
    if voice is None:
        return default
    if not isinstance(voice, dict):
        raise BadEvent(f"{event.type}: 'voice' must be an object")
    name = voice.get("name")
    if name is None or (isinstance(name, str) and not name.strip()):
        return default
    if not isinstance(name, str):
        raise BadEvent(f"{event.type}: 'voice.name' must be a string")
    return name.strip()


# --- audio out ------------------------------------------------------------------------------------------------------
class _Pcm:
    """float32 audio at the model's rate → 16-bit PCM at the output rate (gateway.audio's pcm stream: libsoxr's
    stream resampler, continuous across chunks), in audio-chunk sized pieces."""

    def __init__(self, sample_rate: int, samples_per_chunk: int):
        self.rate, self.per_chunk = sample_rate, samples_per_chunk * WIDTH
        self.encoder = StreamEncoder("pcm", sample_rate)

    def chunks(self, samples: np.ndarray, last: bool = False) -> list[bytes]:
        data = self.encoder.push(samples) + (self.encoder.close() if last else b"")
        return [data[i:i + self.per_chunk] for i in range(0, len(data), self.per_chunk)]


class _Turn:
    """One synthesis: a SpeechSession of its own (its voice, the seed schedule from --seed), and a task that turns the
    session's events into Wyoming events as they come."""

    def __init__(self, handler: WyomingHandler, voice: str):
        s = handler.settings
        self.handler = handler
        self.session = SpeechSession(handler.client, SynthesisOptions.of(s.options, voice=voice), seed=s.seed,
                                     pause_s=s.pause_s, piece_concurrency=s.piece_concurrency,
                                     idle_flush_s=s.idle_flush_s, chunk_timeout_s=s.timeout_s)
        self.pcm = _Pcm(s.sample_rate, s.samples_per_chunk)
        self.chars = 0
        self.errors: list[ChatTTSError] = []
        self.started = False  # audio-start sent
        self.pump = asyncio.ensure_future(self._pump())

    async def append(self, text: str) -> None:
        self.chars += len(text)
        await self.session.append(text)

    async def finish(self) -> None:
        """Ends the text; returns when all of the turn's audio (and audio-stop, if it had any) has been written."""
        await self.session.flush()
        try:
            await self.pump
        finally:
            await self.session.close()

    async def abort(self) -> None:
        self.pump.cancel()
        with contextlib.suppress(BaseException):
            await self.pump
        await self.session.close()

    async def _pump(self) -> None:
        h = self.handler
        async for event in self.session.events():
            if isinstance(event, Audio):
                await self._audio(self.pcm.chunks(event.samples))
            elif isinstance(event, SegmentError):
                err = synthesis_error(event.error)
                self.errors.append(event.error)
                log.warning("piece %d failed: [%s] %s", event.index, err.status, err.message)
                await h.write_event(Error(text=f"{err.message} (in {event.text!r:.80})", code=err.status).event())
            elif isinstance(event, (TurnEnd, TurnCancelled)):
                break
        await self._audio(self.pcm.chunks(np.zeros(0, np.float32), last=True))
        if self.started:
            await h.write_event(AudioStop().event())

    async def _audio(self, chunks: list[bytes]) -> None:
        rate = self.pcm.rate
        for data in chunks:
            if not self.started:
                await self.handler.write_event(AudioStart(rate=rate, width=WIDTH, channels=CHANNELS).event())
                self.started = True
            await self.handler.write_event(AudioChunk(rate=rate, width=WIDTH, channels=CHANNELS, audio=data).event())


# --- one connection ---------------------------------------------------------------------------------------------------
class WyomingHandler(AsyncEventHandler):
    """One client connection. Events are taken one at a time; a streamed synthesis's audio is written by its turn's
    task meanwhile."""

    def __init__(self, settings: Settings, client: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        super().__init__(reader, writer)
        self.settings, self.client = settings, client
        self.stream: _Turn | None = None  # the streamed synthesis in progress
        self.stream_text = False  # whether it got any synthesize-chunk text
        self._write_lock = asyncio.Lock()

    async def write_event(self, event: Event) -> None:
        async with self._write_lock:  # one event's bytes are never interleaved with another's
            await super().write_event(event)

    async def run(self) -> None:
        try:
            while True:
                try:
                    event = await read_event(self.reader)
                except BadEvent as e:  # the byte stream cannot be trusted after it: said, then the connection ends
                    log.warning("closing a connection: %s", e.text)
                    await self._refuse(e)
                    break
                if event is None or not await self.handle_event(event):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except Exception as e:  # a fault of this server ends the connection it happened on, said and logged
            log.exception("internal error")
            with contextlib.suppress(Exception):
                await self.write_event(Error(text=f"internal error: {type(e).__name__}", code="internal").event())
        finally:
            await self.disconnect()
            self.writer.close()

    async def _refuse(self, e: BadEvent) -> None:
        """The error event, then the end of what this side sends; what the peer is still sending is read and dropped
        (for a while) first: closing with unread bytes resets the connection, and a reset loses the error event."""
        with contextlib.suppress(Exception):
            await self.write_event(Error(text=e.text, code=e.code).event())
            if self.writer.can_write_eof():
                self.writer.write_eof()
            await asyncio.wait_for(self._discard(), DISCARD_S)

    async def _discard(self) -> None:
        while await self.reader.read(1 << 16):
            pass

    async def disconnect(self) -> None:
        if self.stream is not None:
            turn, self.stream = self.stream, None
            await turn.abort()

    async def handle_event(self, event: Event) -> bool:
        try:
            return await self._handle(event)
        except BadEvent as e:
            await self.write_event(Error(text=e.text, code=e.code).event())
            return True

    async def _handle(self, event: Event) -> bool:
        kind = event.type
        if Describe.is_type(kind):  # a shared store is asked over the network: off the event loop
            await self.write_event((await asyncio.to_thread(info, self.settings)).event())
            return True
        if Ping.is_type(kind):
            await self.write_event(Pong(text=event.data.get("text") if isinstance(event.data.get("text"), str)
                                        else None).event())
            return True
        if Synthesize.is_type(kind):
            if self.stream is not None:
                # Home Assistant sends the whole text again inside a stream, for servers that do not stream; it is
                # spoken only when the stream brought no text of its own
                if not self.stream_text:
                    await self._append(_text(event))
                    self.stream_text = True
                return True
            return await self._synthesize(_text(event), _voice(event, self.settings.voice))
        if not self.settings.streaming:
            return True
        if SynthesizeStart.is_type(kind):
            if self.stream is not None:
                raise BadEvent("synthesize-start inside a stream: send synthesize-stop first")
            self.stream = _Turn(self, _voice(event, self.settings.voice))
            self.stream_text = False
            return True
        if SynthesizeChunk.is_type(kind):
            if self.stream is None:
                raise BadEvent("synthesize-chunk outside a stream: send synthesize-start first")
            text = _text(event)
            await self._append(text)
            self.stream_text = self.stream_text or bool(text)
            return True
        if SynthesizeStop.is_type(kind):
            if self.stream is None:
                raise BadEvent("synthesize-stop outside a stream: send synthesize-start first")
            turn = self.stream
            try:
                await turn.finish()
            finally:
                self.stream = None
            await self.write_event(SynthesizeStopped().event())
            return True
        log.debug("ignoring an event of type %r", kind)  # another program's events (audio, asr, ...): not for TTS
        return True

    async def _append(self, text: str) -> None:
        turn = self.stream
        if turn.chars + len(text) > self.settings.max_text_chars:
            raise BadEvent(f"the stream's text would pass {self.settings.max_text_chars} characters: this chunk "
                           "is not spoken", "text-too-long")
        await turn.append(text)

    async def _synthesize(self, text: str, voice: str) -> bool:
        """A whole text. When it fails with no audio at all, the error event is followed by the end of the
        connection: Home Assistant's client reads a plain synthesis to audio-stop and passes over error events, so
        the closed connection is what tells it, at once, that there is no audio."""
        limit = self.settings.max_text_chars
        if len(text) > limit:
            await self.write_event(Error(text=f"the text has {len(text)} characters, more than the limit of {limit}",
                                         code="text-too-long").event())
            return False
        if not text.strip():
            await self.write_event(Error(text="the text is empty", code="text-empty").event())
            return False
        turn = _Turn(self, voice)
        try:
            await turn.append(text)
            await turn.finish()
        except BaseException:
            await turn.abort()
            raise
        return turn.started or not turn.errors


# --- the server
# ---------------------------------------------------------------------------------------------------------
class WyomingServer:
    """The TCP server and the gRPC client its connections share."""

    def __init__(self, settings: Settings, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 client_factory: Callable[[], Any] | None = None):
        self.settings = settings
        self.host, self.port = host, port
        self._synth = (Synthesizer(settings.grpc_url, settings.timeout_s, settings.channels) if client_factory is None
                       else None)
        self._client_factory = client_factory
        self._client: Any = None
        self.tcp = AsyncTcpServer(host, port)

    @property
    def client(self) -> Any:
        if self._client is None:  # made inside the running loop: gRPC's aio channels belong to it
            self._client = self._synth.client if self._synth is not None else self._client_factory()
        return self._client

    def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> WyomingHandler:
        return WyomingHandler(self.settings, self.client, reader, writer)

    async def run(self) -> None:
        try:
            await self.tcp.run(self.handler)  # returns on SIGTERM, after every connection was stopped
        finally:
            await self.close()

    async def close(self) -> None:
        if self._synth is not None:
            await self._synth.close()


# --- command line -------------------------------------------------------------------------------------------------
def _option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip().lower()
    if not sep or key not in OPTION_INPUTS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE with KEY one of "
                                         f"{', '.join(sorted(OPTION_INPUTS))}")
    if key in ("seed", "voice"):
        raise argparse.ArgumentTypeError(f"{key}: give it as --{key}")
    if input_datatype(OPTION_INPUTS[key]) == "BYTES":
        return key, raw
    try:
        return key, json.loads(raw)  # numbers, true and false
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: {raw!r} is not a number or true/false") from None


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m gateway.wyoming", description=__doc__.split("\n\n")[0])
    p.add_argument("--grpc-url", default=d.grpc_url, help="Triton's gRPC HOST:PORT (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s; 0.0.0.0 for every "
                                                       "interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (default %(default)s)")
    p.add_argument("--repo", type=Path, help="the served model repository: describe lists its voices (voices.json)")
    p.add_argument("--voice-store", metavar="URL", default=d.voice_store,
                   help="the voice store describe lists (docs/voices.md; default: env CHATTTS_VOICE_STORE, else the "
                        "repository's voice_store setting, else its voices.json)")
    p.add_argument("--voice", default=d.voice, help="the voice of an event that names none (default %(default)s)")
    p.add_argument("--sample-rate", type=int, default=d.sample_rate,
                   help=f"output rate in Hz, one of {', '.join(map(str, SAMPLE_RATES))} (default %(default)s)")
    p.add_argument("--seed", type=int, help="seed of every synthesis (piece n gets seed + n): the same text always "
                                            "gives "
                                            "the same audio (default: random)")
    p.add_argument("--option", action="append", type=_option, default=[], metavar="KEY=VALUE",
                   help="a contract keyword every piece is sent with, e.g. prompt=[speed_3], temperature=0.2, "
                        "max_new_tokens=1024 (repeatable; prompt defaults to [speed_5])")
    p.add_argument("--timeout", type=float, default=d.timeout_s, metavar="S",
                   help="the longest wait for a stream's next chunk")
    p.add_argument("--channels", type=int, default=d.channels, help="gRPC connections to Triton")
    p.add_argument("--piece-concurrency", type=int, default=d.piece_concurrency,
                   help="pieces (sentences) of one synthesis made at once")
    p.add_argument("--pause-ms", type=int, default=int(round(d.pause_s * 1000)), help="silence between pieces")
    p.add_argument("--idle-flush-s", type=float, default=d.idle_flush_s, metavar="S",
                   help="a stream's text left this long without a new chunk is spoken as it is (0: only at a "
                        "sentence's "
                        "end and at synthesize-stop)")
    p.add_argument("--samples-per-chunk", type=int, default=d.samples_per_chunk,
                   help="samples of one audio-chunk event")
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars, help="the longest text of one synthesis")
    p.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=d.streaming,
                   help="advertise and serve streamed synthesis (synthesize-start/-chunk/-stop)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def settings_from_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> Settings:
    for name in ("channels", "piece_concurrency", "samples_per_chunk", "max_text_chars"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1")
    if a.timeout <= 0 or a.pause_ms < 0 or a.idle_flush_s < 0:
        p.error("--timeout must be > 0, --pause-ms and --idle-flush-s ≥ 0")
    if a.sample_rate not in SAMPLE_RATES:
        p.error(f"--sample-rate must be one of {', '.join(map(str, SAMPLE_RATES))}")
    if a.seed is not None and not 0 <= a.seed < 2**63:
        p.error("--seed must be in [0, 2**63)")
    if not 0 < a.port < 65536:
        p.error("--port must be in 1-65535")
    if a.repo is not None and not (a.repo / "manifest.json").is_file():
        p.error(f"--repo {a.repo}: no manifest.json, not an exported model repository")
    options = {"prompt": "[speed_5]", **dict(a.option)}
    try:
        SynthesisOptions.of(options)  # every value of the contract's type
    except (ChatTTSError, TypeError) as e:
        p.error(f"--option: {e}")
    return Settings(grpc_url=a.grpc_url, repo=a.repo, voice_store=a.voice_store or "", voice=a.voice,
                    sample_rate=a.sample_rate, seed=a.seed,
                    options=options, timeout_s=a.timeout, channels=a.channels, piece_concurrency=a.piece_concurrency,
                    pause_s=a.pause_ms / 1000, idle_flush_s=a.idle_flush_s or None,
                    samples_per_chunk=a.samples_per_chunk,
                    max_text_chars=a.max_text_chars, streaming=a.streaming)


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    settings = settings_from_args(p, a)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _loopback(a.host):
        log.warning("binding %s: the Wyoming protocol has no authentication, anyone who reaches this port can "
                    "synthesise speech (keep it on a trusted network)", a.host)
    try:
        voices(settings.repo, settings.voice_store)
    except Exception as e:  # noqa: BLE001  an unreadable registry is refused at start, not at the first describe
        p.error(f"the voice registry cannot be read ({e}): --repo {settings.repo}, --voice-store")
    server = WyomingServer(settings, a.host, a.port)
    log.info("Wyoming text-to-speech on tcp://%s:%d → Triton gRPC %s (%d Hz, streaming %s)", a.host, a.port,
             settings.grpc_url, settings.sample_rate, "on" if settings.streaming else "off")
    try:
        asyncio.run(server.run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
