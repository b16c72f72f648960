"""Python client of the `chattts` Triton ensemble: sync (`ChatTTSClient`) and asyncio
(`AsyncChatTTSClient`), over gRPC or HTTP.

- Every contract input is a field of `SynthesisOptions` (client/contract.py; None = server default, input not
  sent), which `synthesize`, `synthesize_batch` and `stream` take, sync and async; keywords of the same names
  override its fields.
- Long text is split into pieces that fit (`split_sentences`: sentence ends, then clauses when a sentence is
  too long to be spoken whole, very short sentences joined; chattts_triton.model.split); the pieces go out as
  concurrent requests (so Triton's dynamic batcher can batch them) and are joined in order.
  Like upstream, when no reference audio is given the first sentence is synthesised once and used as
  the speaker reference (SPEAKER_AUDIO / SPEAKER_TEXT) for all sentences, so the voice stays the same.
- Each attempt has `timeout_s`; UNAVAILABLE and connection failures are retried with exponential
  backoff, everything else raises `ChatTTSError` at once (INVALID_ARGUMENT is never retried).
- `stream()` yields the audio of the decoupled `chattts_stream` model chunk by chunk (gRPC
  bidirectional stream, or HTTP `generate_stream` server-sent events); see `ChatTTSClient.stream`.
- `on_spoken_text` (synthesize, stream) gets the text the server voices for each piece: numbers, dates
  and money in words, characters it cannot say removed (the SPOKEN_TEXT output).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import queue
import threading
import time
import uuid
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import numpy as np

from .contract import (
    MODEL,
    STREAM_MODEL,
    SynthesisOptions,
    audio_from_result,
    build_inputs,
    chunk_from_json,
    chunk_from_result,
    requested_outputs,
    spoken_text_from_json,
    spoken_text_from_result,
    takes_options,
    to_infer_inputs,
    to_json_inputs,
)
from .errors import INTERNAL, ChatTTSError, ChatTTSInputError, ChatTTSUnavailableError, stream_error, to_chattts_error

PROTOCOLS = ("grpc", "http")
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
DEFAULT_MAX_CONCURRENCY = 16
CONNECT_TIMEOUT_S = 10.0
CLOSE_WAIT_S = 1.0  # how long closing a stream waits for its call to end
# Triton's HTTP frontend gzips an infer response whenever the request accepts gzip or deflate, and it does so
# in the thread that delivers the ensemble's responses: one response after the other, ~10-20 ms for a few
# seconds of float32 audio (which hardly compresses). aiohttp (tritonclient.http.aio) accepts both by default,
# which held every asyncio HTTP client to one answer at a time. Ask for the bytes as they are.
UNCOMPRESSED_HEADERS = {"Accept-Encoding": "identity"}

OnResult = Callable[[int, Union[np.ndarray, ChatTTSError]], None]
OnSpokenText = Callable[[str], None]


def split_sentences(text: str, max_frames: Optional[int] = None) -> List[str]:
    """`text` as the pieces `synthesize(split=True)` sends: cut at sentence ends, a sentence too long to be spoken
    whole cut at clauses, very short ones joined, none cut inside a number or control token; each estimated under
    `max_frames` code frames (default chattts_triton.model.split.DEFAULT_MAX_FRAMES, ≈ 21.8 s). Blank pieces dropped."""
    from chattts_triton.model.split import DEFAULT_MAX_FRAMES, split_for_synthesis

    return split_for_synthesis(text, DEFAULT_MAX_FRAMES if max_frames is None else max_frames)


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return protocol


def check_url(url: str) -> str:
    if not isinstance(url, str) or not url or "://" in url:
        raise ValueError(f"url must be HOST:PORT without a scheme, got {url!r}")
    return url


def _ints(obj):
    """gRPC's JSON statistics carry uint64 as strings; make them ints like HTTP's."""
    if isinstance(obj, dict):
        return {k: (v if k in ("name", "version") else _ints(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_ints(v) for v in obj]
    if isinstance(obj, str) and obj.isdigit():
        return int(obj)
    return obj


class _RetryPolicy:
    def __init__(self, retries: int, backoff_s: float, max_backoff_s: float):
        if retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("retries, backoff_s and max_backoff_s must be >= 0")
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based): backoff_s * 2**attempt, capped."""
        return min(self.backoff_s * (2**attempt), self.max_backoff_s)

    def give_up(self, err: ChatTTSError, attempt: int) -> Optional[ChatTTSError]:
        """The error to raise now, or None to retry."""
        if not err.retryable:
            return err
        if attempt >= self.retries:
            return ChatTTSUnavailableError(f"{err.message} (gave up after {attempt + 1} attempt(s))")
        return None


def _voice_reference_needed(sentences: Sequence[str], options: SynthesisOptions, voice_from_first: bool) -> bool:
    # upstream's condition is `spk_smp is None`; SPEAKER_AUDIO and SPEAKER_SAMPLE both provide it. A named
    # VOICE is the same speaker for every sentence already (and may hold a reference sample itself)
    return (
        voice_from_first
        and len(sentences) > 1
        and options.speaker_audio is None
        and options.speaker_sample is None
        and options.voice is None
    )


def _with_voice_reference(options: SynthesisOptions, reference: np.ndarray, reference_text: str) -> SynthesisOptions:
    # upstream: params_infer_code.spk_smp = sample_audio_speaker(wav[0]); txt_smp = text[0]
    return options.replace(speaker_audio=reference, speaker_text=reference_text)


def _prepare(text: str, options: SynthesisOptions, split: bool) -> List[str]:
    if not isinstance(text, str):
        raise ChatTTSInputError(f"text must be a str, got {type(text).__name__}")
    sentences = split_sentences(text) if split else [text]
    if not sentences or not any(s.strip() for s in sentences):
        raise ChatTTSInputError("text is empty")
    for sentence in sentences:  # reject bad text before anything is sent
        options.to_inputs(sentence)
    return sentences


def _prepare_batch(texts: Sequence[str], options: SynthesisOptions) -> List[str]:
    texts = list(texts)
    for t in texts:  # every text checked before anything is sent
        options.to_inputs(t)
    return texts


def _spoken(results: Sequence[Any], on_spoken_text: Optional[OnSpokenText]) -> List[np.ndarray]:
    """The audio of `_infer_many`'s results; with `on_spoken_text` they are (audio, spoken text) pairs, each text
    handed to it in order."""
    if on_spoken_text is None:
        return list(results)
    for _, spoken in results:
        on_spoken_text(spoken)
    return [audio for audio, _ in results]


def _tell_spoken(session: Any, on_spoken_text: Optional[OnSpokenText]) -> bool:
    """Hand a stream session's SPOKEN_TEXT to `on_spoken_text` once it has come; whether it was handed."""
    spoken = getattr(session, "spoken_text", None)
    if on_spoken_text is None or spoken is None:
        return False
    on_spoken_text(spoken)
    return True


def _join(pieces: Sequence[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces).astype(np.float32, copy=False)


Chunk = Tuple[np.ndarray, bool]  # (audio samples, last response of the request)
_NO_AUDIO = np.zeros(0, np.float32)


class SSEParser:
    """Server-sent events: feed bytes as they arrive, get the `data` of each complete event."""

    def __init__(self):
        self._buf = bytearray()
        self._scan = 0  # no newline before this offset of _buf (long lines arrive in many pieces)
        self._data: List[bytes] = []

    def feed(self, data: bytes) -> List[bytes]:
        self._buf += data
        events: List[bytes] = []
        while True:
            end = self._buf.find(b"\n", self._scan)
            if end < 0:
                self._scan = len(self._buf)
                return events
            line = bytes(self._buf[:end]).rstrip(b"\r")
            del self._buf[: end + 1]
            self._scan = 0
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # comments (":") and the event/id/retry fields carry nothing here

    def close(self) -> List[bytes]:
        """Events left at the end of the body (a last event without its blank line)."""
        events = self.feed(b"\n\n") if self._buf or self._data else []
        self._buf.clear()
        return events


def _sse_event(data: bytes) -> Tuple[np.ndarray, Optional[str]]:
    """(AUDIO, SPOKEN_TEXT or None) of one generate_stream event; an `{"error": ...}` event is raised."""
    try:
        event = json.loads(data)
    except ValueError as e:
        raise ChatTTSError(INTERNAL, f"unreadable stream event ({e}): {data[:200]!r}") from None
    if not isinstance(event, dict):
        raise ChatTTSError(INTERNAL, f"stream event is not an object: {data[:200]!r}")
    if "error" in event:
        raise stream_error(str(event["error"]))
    return chunk_from_json(event), spoken_text_from_json(event)


def _generate_stream_path(model: str) -> str:
    from urllib.parse import quote

    return f"/v2/models/{quote(model, safe='')}/generate_stream"


def _json_body(arrays: Mapping[str, np.ndarray]) -> bytes:
    return json.dumps(to_json_inputs(arrays)).encode("utf-8")


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace").strip() or "(no message)"


def _no_chunk(timeout_s: float) -> TimeoutError:
    return TimeoutError(f"no audio chunk within {timeout_s:g} s")


def _grpc_stream_exception(error):
    """A stream callback's error: a server error response has no status (Triton 2.51), a broken
    stream (RpcError) has one."""
    return error if error.status() else stream_error(error.message() or str(error))


# --- stream sessions: one request to the stream model each; send(), receive() until final, close(cancel)
def _grpc_stream_request(module, model: str, arrays: Mapping[str, np.ndarray], empty_final: bool,
                         spoken_text: bool = False):
    """The ModelInferRequest tritonclient's async_stream_infer would send."""
    from tritonclient.grpc._utils import _get_inference_request

    request = _get_inference_request(
        model_name=model, inputs=to_infer_inputs(module, arrays), model_version="", request_id=uuid.uuid4().hex,
        outputs=requested_outputs(module, spoken_text), sequence_id=0, sequence_start=False, sequence_end=False, priority=0,
        timeout=None, parameters=None,
    )  # fmt: skip
    if empty_final:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def _rpc_exception(e):
    from tritonclient.utils import InferenceServerException

    return InferenceServerException(e.details() or str(e), status=str(e.code()))


class _GrpcStreamSession:
    """One ModelStreamInfer call on the transport's channel (gRPC calls share a channel; tritonclient's
    start_stream allows one stream per client and leaves a thread blocked after each cancel). A reader
    thread queues the responses, so each wait has the chunk timeout; cancel() ends the call."""

    def __init__(self, transport: "GrpcTransport", model: str, timeout_s: float, spoken_text: bool = False):
        self._transport, self._model, self._timeout_s = transport, model, timeout_s
        self._events: "queue.Queue" = queue.Queue()
        self._call = None
        self._reader: Optional[threading.Thread] = None
        self._want_spoken_text = spoken_text
        self.spoken_text: Optional[str] = None  # SPOKEN_TEXT, once a response carried it

    def send(self, arrays: Mapping[str, np.ndarray]) -> None:
        request = _grpc_stream_request(self._transport._module, self._model, arrays, empty_final=True,
                                       spoken_text=self._want_spoken_text)
        # one request, then half-close: the responses keep coming (tritonclient's stub, private)
        self._call = self._transport._client._client_stub.ModelStreamInfer(iter([request]))
        self._reader = threading.Thread(target=self._read, args=(self._call,), name="chattts-stream", daemon=True)
        self._reader.start()

    def _read(self, call) -> None:
        import grpc

        try:
            for response in call:
                self._events.put((response, None))
            self._events.put((None, ConnectionError("the stream ended before its final response")))
        except grpc.RpcError as e:
            self._events.put((None, _rpc_exception(e)))

    def receive(self) -> Chunk:
        from tritonclient.grpc import InferResult

        try:
            response, error = self._events.get(timeout=self._timeout_s)
        except queue.Empty:
            raise _no_chunk(self._timeout_s) from None
        if error is not None:
            raise error
        if response.error_message:
            raise stream_error(response.error_message)
        result = InferResult(response.infer_response)
        if self._want_spoken_text and self.spoken_text is None:
            self.spoken_text = spoken_text_from_result(result)
        return chunk_from_result(result)

    def close(self, cancel: bool) -> None:
        if self._call is None:
            return
        if not cancel:  # after the final response the server ends the call
            self._reader.join(CLOSE_WAIT_S)
        self._call.cancel()  # no-op once the call has ended
        self._reader.join(CLOSE_WAIT_S)  # no call left running on the channel


class _HttpStreamSession:
    """POST .../generate_stream and read its server-sent events (urllib3; the chunk timeout is the
    socket read timeout). Closing the response before its end closes the connection, which Triton
    takes as a cancellation."""

    def __init__(self, pool, model: str, timeout_s: float, connect_timeout_s: float):
        self._pool, self._model, self._timeout_s = pool, model, timeout_s
        self._connect_timeout_s = connect_timeout_s
        self.spoken_text: Optional[str] = None  # SPOKEN_TEXT, once an event carried it (generate_stream sends all outputs)
        self._resp = None
        self._body: Optional[Iterator[bytes]] = None
        self._parser = SSEParser()
        self._pending: "collections.deque[bytes]" = collections.deque()

    def _translate(self, exc: Exception) -> Exception:
        import urllib3

        if isinstance(exc, urllib3.exceptions.ReadTimeoutError):
            return _no_chunk(self._timeout_s)
        if isinstance(exc, urllib3.exceptions.HTTPError):
            return ConnectionError(f"{type(exc).__name__}: {exc}")
        return exc

    def send(self, arrays: Mapping[str, np.ndarray]) -> None:
        import urllib3
        from tritonclient.utils import InferenceServerException

        try:  # returns once the first response (or error) is there: Triton sends the headers with it
            self._resp = self._pool.urlopen(
                "POST",
                _generate_stream_path(self._model),
                body=_json_body(arrays),
                headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
                preload_content=False,
                release_conn=False,
                retries=False,
                timeout=urllib3.Timeout(connect=self._connect_timeout_s, read=self._timeout_s),
            )
            if not self._resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                raise InferenceServerException(_error_text(self._resp.read()), status=str(self._resp.status))
        except urllib3.exceptions.HTTPError as e:
            raise self._translate(e) from e
        # an error as first response comes as HTTP 400 whatever its code: the event is what counts
        self._body = self._resp.stream(None)

    def receive(self) -> Chunk:
        import urllib3

        while not self._pending:
            if self._body is None:
                return _NO_AUDIO, True
            try:
                data = next(self._body)
            except StopIteration:
                self._body = None
                self._pending.extend(self._parser.close())
                continue
            except (urllib3.exceptions.HTTPError, OSError) as e:
                raise self._translate(e) from e
            self._pending.extend(self._parser.feed(data))
        audio, spoken = _sse_event(self._pending.popleft())
        if self.spoken_text is None:
            self.spoken_text = spoken
        return audio, False

    def close(self, cancel: bool) -> None:
        if self._resp is None:
            return
        if cancel or self._body is not None:
            self._resp.close()  # drops the connection: the server cancels the request
        self._resp.release_conn()


class _AioGrpcStreamSession:
    """One `stream_infer` call (many can share a tritonclient.grpc.aio client); cancel() ends it."""

    def __init__(self, client, module, model: str, timeout_s: float, spoken_text: bool = False):
        self._client, self._module, self._model, self._timeout_s = client, module, model, timeout_s
        self._call = None
        self._want_spoken_text = spoken_text
        self.spoken_text: Optional[str] = None

    async def send(self, arrays: Mapping[str, np.ndarray]) -> None:
        request = {
            "model_name": self._model,
            "inputs": to_infer_inputs(self._module, arrays),
            "outputs": requested_outputs(self._module, self._want_spoken_text),
            "request_id": uuid.uuid4().hex,
        }

        async def requests():  # one request, then half-close: the responses keep coming
            yield request

        self._call = self._client.stream_infer(requests())

    async def receive(self) -> Chunk:
        import grpc

        try:
            result, error = await asyncio.wait_for(self._call.__anext__(), self._timeout_s)
        except asyncio.TimeoutError:
            raise _no_chunk(self._timeout_s) from None
        except StopAsyncIteration:
            raise ConnectionError("the stream ended before its final response") from None
        except grpc.RpcError as e:
            raise _rpc_exception(e) from e
        if error is not None:
            raise _grpc_stream_exception(error)
        if self._want_spoken_text and self.spoken_text is None:
            self.spoken_text = spoken_text_from_result(result)
        return chunk_from_result(result)

    def close(self, cancel: bool) -> None:
        if cancel and self._call is not None:  # else the server ends the call after the final response
            self._call.cancel()


class _AioHttpStreamSession:
    def __init__(self, transport: "AioHttpTransport", model: str, timeout_s: float):
        self._transport, self._model, self._timeout_s = transport, model, timeout_s
        self._resp = None
        self._eof = False
        self.spoken_text: Optional[str] = None
        self._parser = SSEParser()
        self._pending: "collections.deque[bytes]" = collections.deque()

    async def send(self, arrays: Mapping[str, np.ndarray]) -> None:
        from tritonclient.utils import InferenceServerException

        session = self._transport._session()
        post = session.post(
            self._transport._base + _generate_stream_path(self._model),
            data=_json_body(arrays),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        try:
            self._resp = await asyncio.wait_for(post, self._timeout_s)
        except asyncio.TimeoutError:
            raise _no_chunk(self._timeout_s) from None
        if not self._resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            body = await asyncio.wait_for(self._resp.read(), self._timeout_s)
            raise InferenceServerException(_error_text(body), status=str(self._resp.status))

    async def receive(self) -> Chunk:
        import aiohttp

        while not self._pending:
            if self._eof:
                return _NO_AUDIO, True
            try:
                data = await asyncio.wait_for(self._resp.content.readany(), self._timeout_s)
            except asyncio.TimeoutError:
                raise _no_chunk(self._timeout_s) from None
            except aiohttp.ClientPayloadError as e:  # the server went away mid-body
                raise ConnectionError(f"{type(e).__name__}: {e}") from e
            if not data:
                self._eof = True
                self._pending.extend(self._parser.close())
            else:
                self._pending.extend(self._parser.feed(data))
        audio, spoken = _sse_event(self._pending.popleft())
        if self.spoken_text is None:
            self.spoken_text = spoken
        return audio, False

    def close(self, cancel: bool) -> None:
        if self._resp is not None:
            if cancel or not self._eof:
                self._resp.close()  # drops the connection: the server cancels the request
            else:
                self._resp.release()


# --- transports: one tritonclient call each, errors left raw ------------------------------------
def _infer_result(result, spoken_text: bool):
    """AUDIO of a response, or (AUDIO, SPOKEN_TEXT) when that was asked for."""
    audio = audio_from_result(result)
    if not spoken_text:
        return audio
    text = spoken_text_from_result(result)
    if text is None:
        raise ChatTTSError(INTERNAL, "response has no SPOKEN_TEXT output")
    return audio, text


def _spoken_kw(on_spoken_text: Optional[OnSpokenText]) -> Dict[str, bool]:
    """The keyword a transport's infer / open_stream gets when the caller wants the spoken text (none otherwise:
    transports written before it take none)."""
    return {"spoken_text": True} if on_spoken_text is not None else {}

class GrpcTransport:
    def __init__(self, url: str, model: str, timeout_s: float):
        import tritonclient.grpc as module

        self._module, self._model, self._timeout_s = module, model, timeout_s
        self._client = module.InferenceServerClient(url)  # thread-safe for unary calls and streams

    def infer(self, arrays: Mapping[str, np.ndarray], spoken_text: bool = False):
        result = self._client.infer(
            self._model,
            to_infer_inputs(self._module, arrays),
            outputs=requested_outputs(self._module, spoken_text),
            client_timeout=self._timeout_s,
        )
        return _infer_result(result, spoken_text)

    def is_ready(self) -> bool:
        t = min(self._timeout_s, CONNECT_TIMEOUT_S)
        return self._client.is_server_ready(client_timeout=t) and self._client.is_model_ready(self._model, client_timeout=t)

    def statistics(self, model: str) -> dict:
        return _ints(self._client.get_inference_statistics(model, as_json=True, client_timeout=self._timeout_s))

    def open_stream(self, model: str, chunk_timeout_s: float, spoken_text: bool = False) -> _GrpcStreamSession:
        return _GrpcStreamSession(self, model, chunk_timeout_s, spoken_text)

    def close(self) -> None:
        self._client.close()


class HttpTransport:
    """tritonclient.http clients are not thread-safe: one per thread."""

    def __init__(self, url: str, model: str, timeout_s: float):
        import tritonclient.http as module

        self._module, self._url, self._model, self._timeout_s = module, url, model, timeout_s
        self._local = threading.local()
        self._clients: List[Any] = []
        self._lock = threading.Lock()
        self._stream_pool = None  # urllib3 pool (thread-safe) for generate_stream

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._module.InferenceServerClient(
                self._url,
                connection_timeout=min(self._timeout_s, CONNECT_TIMEOUT_S),
                network_timeout=self._timeout_s,
            )
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def infer(self, arrays: Mapping[str, np.ndarray], spoken_text: bool = False):
        result = self._client().infer(
            self._model, to_infer_inputs(self._module, arrays), outputs=requested_outputs(self._module, spoken_text),
            headers=dict(UNCOMPRESSED_HEADERS),  # a copy each call: tritonclient adds its own to the dict
        )
        return _infer_result(result, spoken_text)

    def is_ready(self) -> bool:
        return self._client().is_server_ready() and self._client().is_model_ready(self._model)

    def statistics(self, model: str) -> dict:
        return self._client().get_inference_statistics(model)

    def open_stream(self, model: str, chunk_timeout_s: float, spoken_text: bool = False) -> _HttpStreamSession:
        with self._lock:
            if self._stream_pool is None:
                import urllib3

                where = urllib3.util.parse_url("http://" + self._url)
                self._stream_pool = urllib3.HTTPConnectionPool(where.host, where.port, maxsize=16, block=False)
            pool = self._stream_pool
        return _HttpStreamSession(pool, model, chunk_timeout_s, min(self._timeout_s, CONNECT_TIMEOUT_S))

    def close(self) -> None:
        with self._lock:
            pool, self._stream_pool = self._stream_pool, None
        if pool is not None:
            pool.close()
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001  closing a client whose thread has gone: nothing left to release
                pass


class AioGrpcTransport:
    """`channels` > 1: that many gRPC channels, each on its own connection (a local subchannel pool), calls
    spread over them in turn: one HTTP/2 connection carries every call of a channel."""

    def __init__(self, url: str, model: str, timeout_s: float, max_concurrency: int, channels: int = 1):
        import tritonclient.grpc as module
        import tritonclient.grpc.aio as aio

        self._module, self._model, self._timeout_s = module, model, timeout_s
        if channels == 1:
            self._clients = [aio.InferenceServerClient(url)]
        else:
            args = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 2**31 - 1),
                    ("grpc.max_receive_message_length", 2**31 - 1)]
            self._clients = [aio.InferenceServerClient(url, channel_args=args) for _ in range(channels)]
        self._turn = 0

    @property
    def _client(self):
        self._turn = (self._turn + 1) % len(self._clients)
        return self._clients[self._turn]

    async def infer(self, arrays: Mapping[str, np.ndarray], spoken_text: bool = False):
        result = await self._client.infer(
            self._model,
            to_infer_inputs(self._module, arrays),
            outputs=requested_outputs(self._module, spoken_text),
            client_timeout=self._timeout_s,
        )
        return _infer_result(result, spoken_text)

    async def is_ready(self, model: Optional[str] = None) -> bool:
        t = min(self._timeout_s, CONNECT_TIMEOUT_S)
        return await self._client.is_server_ready(client_timeout=t) and await self._client.is_model_ready(
            model or self._model, client_timeout=t
        )

    async def statistics(self, model: str) -> dict:
        return _ints(await self._client.get_inference_statistics(model, as_json=True, client_timeout=self._timeout_s))

    def open_stream(self, model: str, chunk_timeout_s: float, spoken_text: bool = False) -> _AioGrpcStreamSession:
        return _AioGrpcStreamSession(self._client, self._module, model, chunk_timeout_s, spoken_text)

    async def close(self) -> None:
        for client in self._clients:
            await client.close()


class AioHttpTransport:
    def __init__(self, url: str, model: str, timeout_s: float, max_concurrency: int):
        import tritonclient.http as module
        import tritonclient.http.aio as aio

        self._module, self._model = module, model
        # conn_timeout is aiohttp's total per-request timeout
        self._client = aio.InferenceServerClient(url, conn_limit=max(100, max_concurrency), conn_timeout=timeout_s)
        self._base = "http://" + url
        self._connect_timeout_s = min(timeout_s, CONNECT_TIMEOUT_S)
        self._stream_session = None  # aiohttp session for generate_stream, no total timeout

    def _session(self):
        if self._stream_session is None:
            import aiohttp

            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
            self._stream_session = aiohttp.ClientSession(timeout=timeout)
        return self._stream_session

    def open_stream(self, model: str, chunk_timeout_s: float, spoken_text: bool = False) -> _AioHttpStreamSession:
        return _AioHttpStreamSession(self, model, chunk_timeout_s)

    async def infer(self, arrays: Mapping[str, np.ndarray], spoken_text: bool = False):
        result = await self._client.infer(
            self._model, to_infer_inputs(self._module, arrays), outputs=requested_outputs(self._module, spoken_text),
            headers=dict(UNCOMPRESSED_HEADERS),  # a copy each call: tritonclient adds its own to the dict
        )
        return _infer_result(result, spoken_text)

    async def is_ready(self) -> bool:
        return await self._client.is_server_ready() and await self._client.is_model_ready(self._model)

    async def statistics(self, model: str) -> dict:
        return await self._client.get_inference_statistics(model, headers=dict(UNCOMPRESSED_HEADERS))

    async def close(self) -> None:
        if self._stream_session is not None:
            await self._stream_session.close()
            self._stream_session = None
        await self._client.close()


class _ClientBase:
    def __init__(
        self, url, protocol, model, timeout_s, retries, backoff_s, max_backoff_s, max_concurrency, stream_model=STREAM_MODEL
    ):
        self.protocol = check_protocol(protocol)
        self.url = check_url(url if url is not None else DEFAULT_URLS[protocol])
        if not model or not stream_model:
            raise ValueError("model and stream_model must be non-empty names")
        self.stream_model = stream_model
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
        self.model = model
        self.timeout_s = float(timeout_s)
        self.max_concurrency = int(max_concurrency)
        self.retry_policy = _RetryPolicy(retries, backoff_s, max_backoff_s)

    @property
    def where(self) -> str:
        return f"{self.protocol}://{self.url} model '{self.model}'"

    @property
    def stream_where(self) -> str:
        return f"{self.protocol}://{self.url} model '{self.stream_model}'"

    def _chunk_timeout(self, chunk_timeout_s: Optional[float]) -> float:
        if chunk_timeout_s is None:
            return self.timeout_s
        if chunk_timeout_s <= 0:
            raise ValueError(f"chunk_timeout_s must be > 0, got {chunk_timeout_s!r}")
        return float(chunk_timeout_s)

    def _stream_failure(self, exc: BaseException, attempt: int, yielded: bool) -> Optional[ChatTTSError]:
        """The error to raise now, or None to send the request again (never once audio was yielded)."""
        err = to_chattts_error(exc, self.stream_where)
        return err if yielded else self.retry_policy.give_up(err, attempt)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, protocol={self.protocol!r}, model={self.model!r})"


class ChatTTSClient(_ClientBase):
    """Blocking client. Thread-safe; batches run on an internal thread pool of `max_concurrency`."""

    def __init__(
        self,
        url: Optional[str] = None,
        protocol: str = "grpc",
        model: str = MODEL,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        *,
        max_backoff_s: float = MAX_BACKOFF_S,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        stream_model: str = STREAM_MODEL,
        transport: Any = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        """`url` is HOST:PORT (default localhost:8001 for grpc, :8000 for http). `stream_model` is the
        decoupled model `stream()` uses. `transport` replaces the tritonclient transport (an object
        with infer(arrays) -> audio and open_stream(model, chunk_timeout_s) -> session), for tests."""
        super().__init__(
            url, protocol, model, timeout_s, retries, backoff_s, max_backoff_s, max_concurrency, stream_model
        )
        if transport is None:
            cls = GrpcTransport if self.protocol == "grpc" else HttpTransport
            transport = cls(self.url, self.model, self.timeout_s)
        self._transport = transport
        self._sleep = sleep
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()

    # --- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._transport.close()

    def __enter__(self) -> "ChatTTSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def is_ready(self) -> bool:
        """Server up and model ready; False (not an exception) when the server cannot be reached."""
        try:
            return bool(self._transport.is_ready())
        except Exception:  # noqa: BLE001  not ready, whatever the failure
            return False

    def wait_until_ready(self, timeout_s: float = 60.0, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if time.monotonic() >= deadline:
                raise ChatTTSUnavailableError(f"{self.where}: not ready after {timeout_s:g} s")
            self._sleep(poll_s)

    def inference_statistics(self, model: str = "") -> dict:
        """Triton's per-model statistics (all models when `model` is empty), HTTP JSON layout."""
        return self._call(lambda: self._transport.statistics(model))

    # --- inference -------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Any:
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                err = to_chattts_error(exc, self.where)
                final = self.retry_policy.give_up(err, attempt)
                if final is not None:
                    raise final from exc
                self._sleep(self.retry_policy.delay(attempt))
                attempt += 1

    def infer_one(self, text: str, options: Union[SynthesisOptions, Mapping[str, Any], None] = None,
                  spoken_text: bool = False):
        """One request, one utterance (no sentence splitting), with retries: its audio, or (audio, the text the
        server voiced) with `spoken_text`. `options`: a SynthesisOptions or a mapping of its field names."""
        arrays = build_inputs(text, options)
        kw = {"spoken_text": True} if spoken_text else {}
        return self._call(lambda: self._transport.infer(arrays, **kw))

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="chattts")
            return self._pool

    def _infer_many(
        self,
        texts: Sequence[str],
        options: SynthesisOptions,
        return_exceptions: bool = False,
        on_result: Optional[OnResult] = None,
        spoken_text: bool = False,
    ) -> List[Union[np.ndarray, ChatTTSError]]:
        if len(texts) == 1 and on_result is None:
            try:
                return [self.infer_one(texts[0], options, spoken_text)]
            except ChatTTSError as err:
                if return_exceptions:
                    return [err]
                raise
        pool = self._executor()
        futures = {pool.submit(self.infer_one, t, options, spoken_text): i for i, t in enumerate(texts)}
        results: List[Any] = [None] * len(texts)
        try:
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                try:
                    results[i] = future.result()
                except ChatTTSError as err:
                    if not return_exceptions:
                        raise
                    results[i] = err
                if on_result is not None:
                    on_result(i, results[i])
        finally:
            for future in futures:
                future.cancel()  # only those not started yet; a failure should not keep the pool busy
        return results

    @takes_options
    def synthesize(
        self,
        text: str,
        options: Optional[SynthesisOptions] = None,
        *,
        split: bool = True,
        voice_from_first: bool = True,
        on_spoken_text: Optional[OnSpokenText] = None,
        **overrides: Any,
    ) -> np.ndarray:
        """Speech for `text` as float32 mono samples at 24 kHz.

        `options` (`SynthesisOptions`) holds the ensemble's optional inputs; keywords of its field names override
        its fields (or are the options alone: `synthesize(text, seed=7, temperature=0.3)`); an unknown keyword is a
        TypeError. None leaves an input to the server default. `speaker` is an upstream speaker-embedding string;
        a reference voice is either `speaker_audio` (24 kHz mono samples) or `speaker_sample` (upstream
        `sample_audio_speaker` string), with `speaker_text` its transcript.
        `split`: split into pieces that fit (`split_sentences`) and synthesise them as one concurrent batch.
        `voice_from_first`: like upstream, without `speaker_audio` use the first sentence's audio as
        the voice reference of all sentences (one extra request before the batch).
        `on_spoken_text(text)`: called with the text the server voices for each piece, in order (SPOKEN_TEXT).
        """
        options = SynthesisOptions.of(options, **overrides)
        sentences = _prepare(text, options, split)
        if _voice_reference_needed(sentences, options, voice_from_first):
            reference = self.infer_one(sentences[0], options)
            options = _with_voice_reference(options, reference, sentences[0])
        return _join(_spoken(self._infer_many(sentences, options, spoken_text=on_spoken_text is not None),
                             on_spoken_text))

    @takes_options
    def synthesize_batch(
        self,
        texts: Sequence[str],
        options: Optional[SynthesisOptions] = None,
        *,
        return_exceptions: bool = False,
        on_result: Optional[OnResult] = None,
        **overrides: Any,
    ) -> List[Union[np.ndarray, ChatTTSError]]:
        """One utterance per text (not split, like upstream `infer(list)`), sent concurrently.

        Takes the same `options` and option keywords as `synthesize`. Results are in input order; with
        `return_exceptions` failed items are their ChatTTSError instead of raising the first one.
        `on_result(index, audio_or_error)` is called as each item finishes (e.g. a progress bar).
        """
        options = SynthesisOptions.of(options, **overrides)
        texts = _prepare_batch(texts, options)
        if not texts:
            return []
        return self._infer_many(texts, options, return_exceptions=return_exceptions, on_result=on_result)

    @takes_options
    def stream(
        self,
        text: str,
        options: Optional[SynthesisOptions] = None,
        *,
        split: bool = True,
        voice_from_first: bool = True,
        chunk_timeout_s: Optional[float] = None,
        on_spoken_text: Optional[OnSpokenText] = None,
        **overrides: Any,
    ) -> Iterator[np.ndarray]:
        """Speech for `text` as float32 chunks (24 kHz mono) while the server generates it, from the
        decoupled `stream_model`; the chunks joined equal `synthesize(text, ...)` for one sentence.

        Same `options` and keywords as `synthesize`. Sentences are streamed one after the other; with
        `voice_from_first` (and no reference given) sentence 1 is streamed as it comes and its audio
        is the voice reference of the rest (`synthesize` sends sentence 1 again with that reference).
        Errors raise `ChatTTSError` from the iterator, also mid-stream. UNAVAILABLE is retried like
        `synthesize` only while no chunk of that request was yielded. `chunk_timeout_s` (default
        `timeout_s`) bounds the wait for each chunk (DEADLINE_EXCEEDED). Leaving the loop early, or
        closing the iterator, cancels the request on the server. `on_spoken_text(text)` is called with the
        text the server voices for each piece, as that piece's first chunk arrives.
        """
        options = SynthesisOptions.of(options, **overrides)
        sentences = _prepare(text, options, split)  # checked now, not at the first next()
        return self._stream(sentences, options, voice_from_first, self._chunk_timeout(chunk_timeout_s), on_spoken_text)

    def _stream(self, sentences, options, voice_from_first: bool, timeout_s: float,
                on_spoken_text: Optional[OnSpokenText] = None) -> Iterator[np.ndarray]:
        need_reference = _voice_reference_needed(sentences, options, voice_from_first)
        for sentence in sentences:
            pieces: List[np.ndarray] = []
            arrays = options.to_inputs(sentence)
            with contextlib.closing(self._stream_one(arrays, timeout_s, on_spoken_text)) as chunks:
                for chunk in chunks:
                    if need_reference:
                        pieces.append(chunk)
                    yield chunk
            if need_reference:
                options = _with_voice_reference(options, _join(pieces) if pieces else _NO_AUDIO, sentence)
                need_reference = False

    def _stream_one(self, arrays: Mapping[str, np.ndarray], timeout_s: float,
                    on_spoken_text: Optional[OnSpokenText] = None) -> Iterator[np.ndarray]:
        """One request's non-empty chunks, with retries before the first one."""
        attempt, told = 0, on_spoken_text is None
        while True:
            session, final, yielded = None, False, False
            try:
                session = self._transport.open_stream(self.stream_model, timeout_s, **_spoken_kw(on_spoken_text))
                session.send(arrays)
                while not final:
                    chunk, final = session.receive()
                    told = told or _tell_spoken(session, on_spoken_text)
                    if chunk.size:
                        yielded = True
                        yield chunk
                return
            except Exception as exc:
                err = self._stream_failure(exc, attempt, yielded)
                if err is not None:
                    raise err from exc
            finally:  # also on GeneratorExit (the caller stopped early): cancel
                if session is not None:
                    session.close(cancel=not final)
            self._sleep(self.retry_policy.delay(attempt))
            attempt += 1


class AsyncChatTTSClient(_ClientBase):
    """asyncio client (tritonclient.grpc.aio / tritonclient.http.aio). Create and use it inside one
    event loop; `async with AsyncChatTTSClient(...) as c: audio = await c.synthesize(...)`."""

    def __init__(
        self,
        url: Optional[str] = None,
        protocol: str = "grpc",
        model: str = MODEL,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        *,
        max_backoff_s: float = MAX_BACKOFF_S,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        stream_model: str = STREAM_MODEL,
        transport: Any = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        channels: int = 1,
    ):
        """`channels` (gRPC): calls go over that many connections in turn (a pool for a server of many
        concurrent calls, such as the speech gateway)."""
        super().__init__(
            url, protocol, model, timeout_s, retries, backoff_s, max_backoff_s, max_concurrency, stream_model
        )
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels!r}")
        self._transport = transport  # created on first use: aio channels/sessions belong to a running loop
        self._sleep = sleep
        self._semaphore: Optional[asyncio.Semaphore] = None
        self._channels = int(channels)

    def _get_transport(self):
        if self._transport is None:
            if self.protocol == "grpc":
                self._transport = AioGrpcTransport(self.url, self.model, self.timeout_s, self.max_concurrency,
                                                    self._channels)
            else:
                self._transport = AioHttpTransport(self.url, self.model, self.timeout_s, self.max_concurrency)
        return self._transport

    async def close(self) -> None:
        if self._transport is not None:
            await self._transport.close()
            self._transport = None

    async def __aenter__(self) -> "AsyncChatTTSClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def is_ready(self, model: Optional[str] = None) -> bool:
        """The server and `model` (default: this client's; gRPC only for another) are ready."""
        try:
            transport = self._get_transport()
            return bool(await (transport.is_ready(model) if model else transport.is_ready()))
        except Exception:  # noqa: BLE001  not ready, whatever the failure
            return False

    async def wait_until_ready(self, timeout_s: float = 60.0, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.is_ready():
            if time.monotonic() >= deadline:
                raise ChatTTSUnavailableError(f"{self.where}: not ready after {timeout_s:g} s")
            await self._sleep(poll_s)

    async def inference_statistics(self, model: str = "") -> dict:
        return await self._call(lambda: self._get_transport().statistics(model))

    async def _call(self, make_call: Callable[[], Awaitable[Any]]) -> Any:
        attempt = 0
        while True:
            try:
                return await make_call()
            except Exception as exc:
                err = to_chattts_error(exc, self.where)
                final = self.retry_policy.give_up(err, attempt)
                if final is not None:
                    raise final from exc
                await self._sleep(self.retry_policy.delay(attempt))
                attempt += 1

    async def infer_one(self, text: str, options: Union[SynthesisOptions, Mapping[str, Any], None] = None,
                        spoken_text: bool = False):
        """See `ChatTTSClient.infer_one`."""
        arrays = build_inputs(text, options)
        kw = {"spoken_text": True} if spoken_text else {}
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        async with self._semaphore:
            return await self._call(lambda: self._get_transport().infer(arrays, **kw))

    async def _infer_many(self, texts, options, return_exceptions=False, on_result=None, spoken_text=False):
        async def one(i: int, text: str):
            try:
                result = await self.infer_one(text, options, spoken_text)
            except ChatTTSError as err:
                if not return_exceptions:
                    raise
                result = err
            if on_result is not None:
                on_result(i, result)
            return result

        tasks = [asyncio.ensure_future(one(i, t)) for i, t in enumerate(texts)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    @takes_options
    async def synthesize(
        self,
        text: str,
        options: Optional[SynthesisOptions] = None,
        *,
        split: bool = True,
        voice_from_first: bool = True,
        on_spoken_text: Optional[OnSpokenText] = None,
        **overrides: Any,
    ) -> np.ndarray:
        """See `ChatTTSClient.synthesize`."""
        options = SynthesisOptions.of(options, **overrides)
        sentences = _prepare(text, options, split)
        if _voice_reference_needed(sentences, options, voice_from_first):
            reference = await self.infer_one(sentences[0], options)
            options = _with_voice_reference(options, reference, sentences[0])
        results = await self._infer_many(sentences, options, spoken_text=on_spoken_text is not None)
        return _join(_spoken(results, on_spoken_text))

    @takes_options
    async def synthesize_batch(
        self,
        texts: Sequence[str],
        options: Optional[SynthesisOptions] = None,
        *,
        return_exceptions: bool = False,
        on_result: Optional[OnResult] = None,
        **overrides: Any,
    ) -> List[Union[np.ndarray, ChatTTSError]]:
        """See `ChatTTSClient.synthesize_batch`."""
        options = SynthesisOptions.of(options, **overrides)
        texts = _prepare_batch(texts, options)
        if not texts:
            return []
        return await self._infer_many(texts, options, return_exceptions, on_result)

    @takes_options
    def stream(
        self,
        text: str,
        options: Optional[SynthesisOptions] = None,
        *,
        split: bool = True,
        voice_from_first: bool = True,
        chunk_timeout_s: Optional[float] = None,
        on_spoken_text: Optional[OnSpokenText] = None,
        **overrides: Any,
    ) -> AsyncIterator[np.ndarray]:
        """See `ChatTTSClient.stream`: `async for chunk in client.stream(...)`. Breaking out of the loop
        cancels the request once the generator is collected; `contextlib.aclosing(client.stream(...))`
        (or cancelling the task) cancels it at once."""
        options = SynthesisOptions.of(options, **overrides)
        sentences = _prepare(text, options, split)
        return self._stream(sentences, options, voice_from_first, self._chunk_timeout(chunk_timeout_s), on_spoken_text)

    async def _stream(self, sentences, options, voice_from_first: bool, timeout_s: float,
                      on_spoken_text: Optional[OnSpokenText] = None) -> AsyncIterator[np.ndarray]:
        need_reference = _voice_reference_needed(sentences, options, voice_from_first)
        for sentence in sentences:
            pieces: List[np.ndarray] = []
            arrays = options.to_inputs(sentence)
            async with contextlib.aclosing(self._stream_one(arrays, timeout_s, on_spoken_text)) as chunks:
                async for chunk in chunks:
                    if need_reference:
                        pieces.append(chunk)
                    yield chunk
            if need_reference:
                options = _with_voice_reference(options, _join(pieces) if pieces else _NO_AUDIO, sentence)
                need_reference = False

    async def _stream_one(self, arrays: Mapping[str, np.ndarray], timeout_s: float,
                          on_spoken_text: Optional[OnSpokenText] = None) -> AsyncIterator[np.ndarray]:
        attempt, told = 0, on_spoken_text is None
        while True:
            session, final, yielded = None, False, False
            try:
                session = self._get_transport().open_stream(self.stream_model, timeout_s, **_spoken_kw(on_spoken_text))
                await session.send(arrays)
                while not final:
                    chunk, final = await session.receive()
                    told = told or _tell_spoken(session, on_spoken_text)
                    if chunk.size:
                        yielded = True
                        yield chunk
                return
            except Exception as exc:  # CancelledError is a BaseException: cancelled below, not retried
                err = self._stream_failure(exc, attempt, yielded)
                if err is not None:
                    raise err from exc
            finally:
                if session is not None:
                    session.close(cancel=not final)
            await self._sleep(self.retry_policy.delay(attempt))
            attempt += 1
