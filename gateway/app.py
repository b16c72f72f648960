"""The speech gateway's HTTP application (FastAPI): OpenAI's speech API in front of a Triton server.

    POST /v1/audio/speech    OpenAI's body → audio (mp3, opus, aac, flac, wav, pcm, G.711), whole or streamed, or SSE
    POST /v1/audio/speech/captioned   the same body → JSON: the whole audio (base64) and each piece's timings
    GET, POST /v1/audio/voices, GET, DELETE /v1/audio/voices/{id}   the voice store (voices_http.py)
    GET, PUT, POST /v1/audio/lexicon, GET, DELETE /v1/audio/lexicon/{word}   its pronunciation lexicon (lexicon_http.py)
    GET  /v1/audio/models, /v1/models, /v1/models/{id}
    GET  /health             200 when Triton and both models are ready, else 503
    GET  /metrics            Prometheus
    GET  /                   the playground (static/index.html)

Errors are OpenAI's: {"error": {"message", "type", "param", "code"}}, 400 naming the field at fault, 401 for a
missing or wrong API key, 429 over the gateway's own concurrency bound, 503 when Triton is overloaded or down
(UNAVAILABLE), 504 on a timeout. What the text decides is checked for every piece before a stream starts; once it
has started, a failure ends it cleanly (SSE: an `error` event) and is counted. See docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import gc
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from chattts_triton.config import SAMPLE_RATE

from . import api, captions, lexicon_http, realtime, voices_http
from .audio import CONTENT_TYPES, FORMATS, StreamEncoder, encode, needs_pyav, out_length, pyav_available
from .metrics import Metrics
from .synth import Job, Part, Segment, SynthesisError, Synthesizer, split_text

log = logging.getLogger("chattts_gateway")
STATIC = Path(__file__).with_name("static")
OWNER = "chattts-triton"
WHOLE_BY_DEFAULT = ("flac",)  # formats streamed only when a request says `stream: true`
DRAIN_BYTES = 64 << 20  # an oversized body is read (and dropped) up to this much before the 400


# Two processes by default: under load one event loop makes each request wait its turn at every step (HTTP in,
# gRPC out and back, encoding, HTTP out), which costs closed-loop clients throughput; a second loop removes most of
# that wait, more add little (docs/gateway.md#cost). Idle, a process costs memory only.
DEFAULT_WORKERS = 2
SETTINGS_ENV = "CHATTTS_GATEWAY_SETTINGS"  # how `--workers N` hands the settings to its worker processes


@dataclass
class Settings:
    grpc_url: str = "127.0.0.1:8001"
    repo: Path | None = None  # the model repository, for /v1/audio/voices (the server resolves VOICE itself)
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    timeout_s: float = 300.0  # a whole synthesis (streams: each chunk)
    channels: int = 2  # gRPC connections to Triton
    max_concurrency: int = 1024  # speech requests in flight before 429
    piece_concurrency: int = 16  # pieces of one request in flight at once
    pause_ms: int = 200  # silence between the pieces of a long input
    stream_default: bool = True  # `stream` when a request does not say
    max_body_bytes: int = 1 << 20  # a body of OpenAI's longest input is < 50 KB; a larger one is refused
    voice_store: str = ""  # where the voices are kept (voices_http.py; empty: env, the repository's setting, its file)
    admin_key: str = ""  # writes to the voice store need it; empty: taken on a loopback `host` only
    host: str = "127.0.0.1"  # the address the gateway listens on

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["repo"] = None if self.repo is None else str(self.repo)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Settings:
        d = json.loads(text)
        d["repo"] = None if d.get("repo") is None else Path(d["repo"])
        d["api_keys"] = tuple(d.get("api_keys", ()))
        return cls(**d)


STATUS_OF = {"INVALID_ARGUMENT": 400, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "NOT_FOUND": 503,
             "CANCELLED": 503, "RESOURCE_EXHAUSTED": 429}


def api_error(err: SynthesisError, req: api.SpeechRequest | None = None) -> api.APIError:
    status = STATUS_OF.get(err.status, 500)
    if status == 400:
        return api.invalid(err.message, api.field_of(err.field, req))
    if status == 503:
        return api.APIError(503, f"the TTS server is overloaded or not ready, retry later ({err.message})",
                            "server_error",
                            None, "server_unavailable", {"Retry-After": "1"})
    if status == 504:
        return api.APIError(504, f"synthesis timed out ({err.message})", "server_error", None, "timeout")
    if status == 429:
        return api.APIError(429, err.message, "rate_limit_error", None, "rate_limit_exceeded", {"Retry-After": "1"})
    return api.APIError(status, f"synthesis failed: {err.message}", "server_error", None, err.status.lower())


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body already read, the server's next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _timeout(timeout_s: float) -> api.APIError:
    return api.APIError(504, f"synthesis took longer than {timeout_s:g} s", "server_error", None, "timeout")


class _StreamingResponse(StreamingResponse):
    """Runs `end` however the response ends: sent, failed, or never started (a client gone before the first
    byte never starts the body iterator, whose own `finally` would then never run)."""

    def __init__(self, content, end: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self._end = end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._end()


class _Stream:
    """One streamed response: the audio encoded as it comes (FFmpeg on a worker thread: it lets the GIL go), each
    piece's segment once its audio was encoded, and the request's accounting when it ends. What fails after the
    first byte (the server overloaded or gone, a timeout) ends the response cleanly, never an exception out of the
    app: the audio stream is closed as a whole file of what was made, SSE gets an `error` event; the abort is
    logged and counted (chattts_gateway_stream_aborts_total{reason})."""

    def __init__(self, gw: Gateway, req: api.SpeechRequest, mode: str, t0: float, first: Part | None,
                 parts: AsyncIterator[Part], encoder: StreamEncoder):
        self.gw, self.req, self.mode, self.t0 = gw, req, mode, t0
        self.fmt, self.rate = req.response_format, req.sample_rate
        self.first, self.parts = first, parts
        self.encoder = encoder
        self.status = "aborted"
        self.reason: str | None = None  # why the stream ended early, when it did on the server's side
        self.busy: asyncio.Future | None = None  # the encoder call on a thread, if any
        self.ended = False

    async def _encode(self, fn: Callable, *args) -> bytes:
        if self.fmt == "pcm" and self.rate == SAMPLE_RATE:  # a numpy cast: no thread hop
            return fn(*args)
        self.busy = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        return await asyncio.shield(self.busy)  # a cancelled request waits for it in end(), never races it

    async def _encoded(self) -> AsyncIterator[bytes | Segment | api.APIError]:
        """Encoded bytes and segments in order; a failure ends it with the APIError it would have been."""
        metrics, sent = self.gw.metrics, False
        pending = [self.first] if self.first is not None else []
        failure: api.APIError | None = None
        try:
            while True:
                if pending:
                    part = pending.pop()
                else:
                    try:
                        part = await self.parts.__anext__()
                    except StopAsyncIteration:
                        break
                if isinstance(part, Segment):
                    yield part
                    continue
                t = time.perf_counter()
                data = await self._encode(self.encoder.push, part)
                metrics.encode_seconds.labels(self.fmt).inc(time.perf_counter() - t)
                if data:
                    if not sent:
                        metrics.first_byte.labels(self.fmt).observe(time.perf_counter() - self.t0)
                        sent = True
                    yield data
        except SynthesisError as e:
            metrics.errors.labels(e.status).inc()
            self.reason, failure = e.status.lower(), api_error(e, self.req)
        except Exception as e:  # a fault here must end the response, not the connection
            log.exception("stream failed")
            self.reason = "internal"
            failure = api.APIError(500, f"internal error: {type(e).__name__}", "server_error", None, "internal_error")
        if failure is not None:
            metrics.stream_aborts.labels(self.reason).inc()
            log.warning("a %s stream ended early after %.2f s of audio (%s): %s", self.mode,
                        self.encoder.samples / SAMPLE_RATE, self.reason, failure.message)
        try:
            tail = await self._encode(self.encoder.close)  # a whole file of what was made, even after a failure
        except Exception:  # the encoder itself failed: nothing more to send
            if failure is None:
                log.exception("stream failed at its end")
                self.reason = "internal"
                metrics.stream_aborts.labels(self.reason).inc()
                failure = api.APIError(500, "internal error at the stream's end", "server_error", None,
                                       "internal_error")
            tail = b""
        if tail:
            yield tail
        if failure is None:
            self.status = "200"
        else:
            self.status = "aborted"
            yield failure

    async def audio(self) -> AsyncIterator[bytes]:
        async for item in self._encoded():
            if isinstance(item, bytes):
                yield item

    async def sse(self) -> AsyncIterator[bytes]:
        """OpenAI's speech events: speech.audio.delta (base64 of the next bytes in response_format), then
        speech.audio.done; beside them speech.segment after each piece's audio, and `error` if it failed."""
        async for item in self._encoded():
            if isinstance(item, bytes):
                event: dict[str, Any] = {"type": "speech.audio.delta", "audio": base64.b64encode(item).decode("ascii")}
            elif isinstance(item, Segment):
                event = {"type": "speech.segment", **captions.segment_json(item, self.rate)}
            else:
                event = {"type": "error", **item.body()}
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        if self.status == "200":
            yield b'data: {"type": "speech.audio.done"}\n\n'

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        with contextlib.suppress(BaseException):
            await self.parts.aclose()  # a stream still running is cancelled on the server
        if self.busy is not None:
            with contextlib.suppress(BaseException):
                await self.busy
        self.encoder.abort()
        if self.status == "aborted" and self.reason is None:
            self.reason = "client_gone"
            self.gw.metrics.stream_aborts.labels(self.reason).inc()
        self.gw.finished(self.fmt, self.mode, self.status, self.t0, self.encoder.samples / SAMPLE_RATE)


class Gateway:
    def __init__(self, settings: Settings, synthesizer: Synthesizer | None = None):
        self.settings = settings
        self.synth = synthesizer or Synthesizer(settings.grpc_url, settings.timeout_s, settings.channels,
                                                settings.piece_concurrency, settings.pause_ms)
        self.metrics = Metrics()
        self.inflight = 0
        self.playground = (STATIC / "index.html").read_text(encoding="utf-8")
        self.pyav = pyav_available()
        if not self.pyav:
            log.warning("PyAV is not installed: only %s whole and %s streamed can be served",
                        ", ".join(f for f in FORMATS if not needs_pyav(f, False)),
                        ", ".join(f for f in FORMATS if not needs_pyav(f, True)))

    # --- guards ------------------------------------------------------------------------------------
    def authenticate(self, request: Request) -> None:
        keys = self.settings.api_keys
        if not keys:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise api.APIError(401, "you must provide an API key: 'Authorization: Bearer KEY'", "invalid_request_error",
                               None, "missing_api_key", {"WWW-Authenticate": "Bearer"})
        token = token.strip().encode()
        if not any([hmac.compare_digest(token, k.encode()) for k in keys]):  # every key compared: no timing hint
            raise api.APIError(401, "incorrect API key provided", "invalid_request_error", None, "invalid_api_key",
                               {"WWW-Authenticate": "Bearer"})

    async def body(self, request: Request) -> bytes:
        """The request body, at most max_body_bytes of it, or that and a voice's reference audio (api.VoiceAudio,
        `parse` tells them apart): a larger one is read to its end (up to DRAIN_BYTES, so that the client, still
        sending, gets the answer instead of a reset connection) and refused."""
        limit = self.settings.max_body_bytes + api.MAX_VOICE_AUDIO_BASE64
        data, seen = bytearray(), 0
        async for part in request.stream():
            seen += len(part)
            if seen <= limit:
                data += part
            elif seen > DRAIN_BYTES:
                break
        if seen > limit:
            for field, key in (("voice.audio", b'"audio"'), ("ref_audio", b'"ref_audio"')):
                if key in data:  # the voice's reference audio is what is too large
                    raise api.invalid(f"the request body is larger than {limit} bytes: '{field}' may be at most "
                                      f"{api.MAX_VOICE_AUDIO_BYTES} bytes", field, "voice_audio_too_large")
            raise api.invalid(f"the request body is larger than {self.settings.max_body_bytes} bytes ('input' may "
                              f"have at most {api.MAX_INPUT_CHARS} characters)", "input", "string_above_max_length")
        return bytes(data)

    # --- speech ------------------------------------------------------------------------------------
    async def speech(self, request: Request, captioned: bool = False) -> Response:
        """`POST /v1/audio/speech`, or with `captioned` its JSON form with timings (always whole)."""
        t0 = time.perf_counter()
        self.authenticate(request)
        req = api.parse(await self.body(request), api.CaptionedRequest if captioned else api.SpeechRequest,
                        self.settings.max_body_bytes)
        fmt = req.response_format
        # a FLAC stream cannot carry its length (libsndfile's readers refuse it): whole unless asked for
        default = self.settings.stream_default and fmt not in WHOLE_BY_DEFAULT
        streamed = not captioned and (req.stream_format == "sse" or (req.stream if req.stream is not None else default))
        mode = ("captioned" if captioned else "sse" if req.stream_format == "sse"
                else ("stream" if streamed else "whole"))
        if not self.pyav and needs_pyav(fmt, streamed):
            can = [f for f in FORMATS if not needs_pyav(f, streamed)]
            raise api.invalid(f"response_format {fmt!r} {'streamed ' if streamed else ''}is not available on this "
                              f"server (FFmpeg's PyAV is not installed); available: {', '.join(can)}",
                              "response_format", "unsupported_format")
        if self.inflight >= self.settings.max_concurrency:
            self.metrics.requests.labels(fmt, mode, "429").inc()
            raise api.APIError(429, f"more than {self.settings.max_concurrency} speech requests in flight, retry later",
                               "rate_limit_error", None, "rate_limit_exceeded", {"Retry-After": "1"})
        job = await api.speech_job(req)  # the pieces: the text split, or its SSML's segments (docs/ssml.md)
        pieces = job.pieces
        headers = {"X-ChatTTS-Seed": str(job.seed), "X-ChatTTS-Pieces": str(len(pieces))}
        self.metrics.pieces.inc(len(pieces))
        self.inflight += 1
        self.metrics.inflight.inc()
        handed_over = False
        try:
            if not streamed:
                response, seconds = await self._whole(job, req, headers, request, captioned)
                self._done(fmt, mode, str(response.status_code), t0, seconds)
                return response
            response = await self._stream(job, req, headers, mode, t0)
            handed_over = True  # the response's end ends the request
            return response
        except api.APIError as e:
            self.metrics.requests.labels(fmt, mode, str(e.status)).inc()
            raise
        finally:
            if not handed_over:
                self.inflight -= 1
                self.metrics.inflight.dec()

    def finished(self, fmt: str, mode: str, status: str, t0: float, audio_s: float) -> None:
        """A stream's end: out of the in-flight count, into the metrics."""
        self.inflight -= 1
        self.metrics.inflight.dec()
        self._done(fmt, mode, status, t0, audio_s)

    def _done(self, fmt: str, mode: str, status: str, t0: float, audio_s: float) -> None:
        self.metrics.requests.labels(fmt, mode, status).inc()
        self.metrics.latency.labels(fmt, mode).observe(time.perf_counter() - t0)
        if audio_s:
            self.metrics.audio_seconds.labels(fmt).inc(audio_s)

    def _synthesis_failed(self, e: SynthesisError, req: api.SpeechRequest) -> api.APIError:
        self.metrics.errors.labels(e.status).inc()
        return api_error(e, req)

    async def _whole(self, job: Job, req: api.SpeechRequest, headers: dict[str, str], request: Request,
                     captioned: bool = False) -> tuple[Response, float]:
        synthesis = self.synth.synthesize_segments(job) if captioned else self.synth.synthesize(job)
        work = asyncio.ensure_future(asyncio.wait_for(synthesis, self.settings.timeout_s))
        gone = asyncio.ensure_future(_disconnected(request))
        try:  # a client that leaves stops its synthesis (and frees the server's slots) instead of paying for it
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            return Response(status_code=499), 0.0  # nobody reads it (nginx's "client closed request")
        try:
            result = work.result()
        except SynthesisError as e:
            raise self._synthesis_failed(e, req) from None
        except asyncio.TimeoutError:
            raise _timeout(self.settings.timeout_s) from None
        audio, segments = result if captioned else (result, [])
        fmt, rate = req.response_format, req.sample_rate
        t = time.perf_counter()
        quick = fmt in ("pcm", "wav") and rate == SAMPLE_RATE  # no thread hop for a numpy cast or libsndfile's copy
        data = encode(fmt, audio, rate) if quick else await asyncio.to_thread(encode, fmt, audio, rate)
        self.metrics.encode_seconds.labels(fmt).inc(time.perf_counter() - t)
        if not captioned:
            return Response(data, media_type=CONTENT_TYPES[fmt], headers=headers), audio.size / SAMPLE_RATE
        timed = [captions.segment_json(seg, rate) for seg in segments]
        body: dict[str, Any] = {"audio": base64.b64encode(data).decode("ascii"), "content_type": CONTENT_TYPES[fmt],
                                "response_format": fmt, "sample_rate": rate, "samples": out_length(audio.size, rate),
                                "seed": job.seed, "segments": timed}
        if req.subtitle_format is not None:
            body["subtitles"] = captions.subtitles(timed, req.subtitle_format)
        return JSONResponse(body, headers=headers), audio.size / SAMPLE_RATE

    async def _first(self, job: Job, parts: AsyncIterator[Part]) -> Part | None:
        """The stream's first part, and every other piece checked for what its text decides (`preflight`, beside
        the first chunk: a stream starts only when each piece can be spoken); the first error raised."""
        timeout = self.settings.timeout_s
        if len(job.pieces) == 1:
            try:
                return await asyncio.wait_for(parts.__anext__(), timeout)
            except StopAsyncIteration:
                return None
        checks = self.synth.preflight(job)  # sent first: it is short, the chunk is not
        first = asyncio.ensure_future(parts.__anext__())
        try:
            done, _ = await asyncio.wait((first, checks), timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
            for task in (first, checks):  # the first piece's error before the others'
                failed = task in done and task.exception() is not None
                if failed and not isinstance(task.exception(), StopAsyncIteration):
                    raise task.exception()
            if len(done) < 2:
                raise asyncio.TimeoutError()
            return None if first.exception() is not None else first.result()
        finally:
            for task in (first, checks):
                task.cancel()
            await asyncio.gather(first, checks, return_exceptions=True)  # parts may be closed only once it rests

    async def _stream(self, job: Job, req: api.SpeechRequest, headers: dict[str, str], mode: str,
                      t0: float) -> Response:
        parts = self.synth.parts(job, spoken_text=mode == "sse")
        fmt = req.response_format
        # the encoder is made (its codec opened) while the first chunk is generated
        encoder = asyncio.get_running_loop().run_in_executor(None, StreamEncoder, fmt, req.sample_rate)
        try:  # the first chunk (or the error) before any header: a bad voice or text is still a 400
            first = await self._first(job, parts)
            stream = _Stream(self, req, mode, t0, first, parts, await encoder)
        except BaseException as e:
            await parts.aclose()
            with contextlib.suppress(BaseException):
                (await encoder).abort()
            if isinstance(e, SynthesisError):
                raise self._synthesis_failed(e, req) from None
            if isinstance(e, asyncio.TimeoutError):
                raise _timeout(self.settings.timeout_s) from None
            raise
        media_type = "text/event-stream" if mode == "sse" else CONTENT_TYPES[req.response_format]
        return _StreamingResponse(stream.sse() if mode == "sse" else stream.audio(), stream.end, media_type=media_type,
                                  headers={**headers, "Cache-Control": "no-store"})

    # --- the rest ----------------------------------------------------------------------------------
    async def health(self) -> tuple[int, dict[str, object]]:
        ready = await self.synth.ready()
        ok = all(ready.values())
        return (200 if ok else 503), {"status": "ok" if ok else "unavailable", "triton": self.settings.grpc_url,
                                      "ready": ready}


def _error_response(e: api.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(settings: Settings, synthesizer: Synthesizer | None = None) -> FastAPI:
    gw = Gateway(settings, synthesizer)
    split_text("Warm up.")  # imports the splitter's modules now, not in the first client's request

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # what was loaded at start (torch, through the splitter, is most of it) leaves the collector's generations:
        # each full collection would walk it all again, a pause of every request in flight
        gc.freeze()
        yield
        await gw.synth.close()
        gw.metrics.close()
        voices.close()
        lexicon.close()

    app = FastAPI(title="chattts-triton speech gateway", version="0.2.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.gateway = gw

    @app.exception_handler(api.APIError)
    async def _api_error(request: Request, e: api.APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error_response(api.APIError(e.status_code, str(e.detail), kind, None, None, dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        return _error_response(api.APIError(500, f"internal error: {type(e).__name__}", "server_error", None,
                                            "internal_error"))

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        return await gw.speech(request)

    @app.post("/v1/audio/speech/captioned")
    async def captioned(request: Request):
        return await gw.speech(request, captioned=True)

    def model_card(name: str) -> dict[str, object]:
        return {"id": name, "object": "model", "created": 0, "owned_by": OWNER}

    @app.get("/v1/models")
    async def models(request: Request):
        gw.authenticate(request)
        return {"object": "list", "data": [model_card(m) for m in api.MODELS]}

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request):
        gw.authenticate(request)
        if model not in api.MODELS:
            raise api.APIError(404, f"the model {model!r} does not exist", "invalid_request_error", "model",
                               "model_not_found")
        return model_card(model)

    @app.get("/v1/audio/models")
    async def audio_models(request: Request):  # Open WebUI lists speech models here
        gw.authenticate(request)
        return {"models": [{"id": m} for m in api.MODELS]}

    @app.get("/health")
    async def health():
        status, body = await gw.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(gw.playground)

    realtime.install(app, gw)  # WS /v1/audio/speech/stream
    voices = voices_http.install(app, gw)  # the voice store: /v1/audio/voices
    lexicon = lexicon_http.install(app, gw)  # its pronunciation lexicon: /v1/audio/lexicon
    return app


# glibc gives a freed block above its mmap threshold (128 KiB at first) back to the kernel, and
# trims the heap's top past
# 128 KiB: every request's audio (a few 100 KiB per second of it, in several copies: the gRPC message, the array, the
# encoded file) then costs mmap/munmap calls and page faults again. Kept instead: blocks up to 32 MiB come from the
# heap, and up to 256 MiB of freed heap stays for the next request.
MALLOC_MMAP_THRESHOLD = 32 << 20  # the most a 64-bit glibc accepts
MALLOC_TRIM_THRESHOLD = 256 << 20


def tune_malloc() -> bool:
    """Sets glibc's thresholds (mallopt) for this gateway process; False where there is no glibc or it refuses."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return (bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD))
            and bool(mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD)))


def app_from_env() -> FastAPI:
    """The app of one worker process of `python -m gateway --workers N` (uvicorn's factory): the settings come from
    the environment its parent set."""
    tune_malloc()
    return create_app(Settings.from_json(os.environ[SETTINGS_ENV]))
