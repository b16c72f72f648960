"""The wire of the clients, written once for sync and asyncio: what a request sends, how an answer and a stream's
chunks are read, which failures become which status, and the tritonclient transports (gRPC, HTTP) that carry them.

A call's logic is a generator of *steps*: it yields a zero-argument callable for each I/O action and is sent that
action's result (or thrown its exception). `run_sync` calls each step in the calling thread; `run_async` calls it and
awaits what it returns when that is awaitable. `iterate_sync` / `iterate_async` drive a stream the same way: its
generator also yields `Out(value)` for each value handed to the caller, and closing the iterator closes the generator
(its `finally` cancels what is in flight). So the request building, the decoding, the error mapping, the retries and
the stream loops are written once; a sync face and an asyncio face differ in the tritonclient client they hold and
the driver they run. (unasync would generate the sync code from the async code, a second copy in the tree;
synchronicity would run the sync face on an event loop thread, changing the threads the sync transports use.)

The transports take the request's tensors (`SynthesisOptions.to_inputs(text)`, contract input name -> array)
and answer with audio: `infer(arrays, spoken_text=False)` -> AUDIO (or (AUDIO, SPOKEN_TEXT)); `open_stream(model,
chunk_timeout_s, spoken_text=False)` -> a session with `send(arrays)`, `receive()` -> (chunk, final) and
`close(cancel)`; `is_ready(model=None)`, `statistics(model)`, `close()`. Errors are left raw (tritonclient's,
OSError, TimeoutError): `errors.to_chattts_error` maps them, once, where the caller decides whether to retry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import json
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from .contract import (
    audio_from_result,
    chunk_from_json,
    chunk_from_result,
    requested_outputs,
    spoken_text_from_json,
    spoken_text_from_result,
    to_infer_inputs,
    to_json_inputs,
)
from .errors import INTERNAL, ChatTTSError, stream_error

CONNECT_TIMEOUT_S = 10.0
CLOSE_WAIT_S = 1.0  # how long closing a stream waits for its call to end
# Triton's HTTP frontend gzips an infer response whenever the request accepts gzip or deflate, and it does so
# in the thread that delivers the ensemble's responses: one response after the other, ~10-20 ms for a few
# seconds of float32 audio (which hardly compresses). aiohttp (tritonclient.http.aio) accepts both by default,
# which held every asyncio HTTP client to one answer at a time. Ask for the bytes as they are.
UNCOMPRESSED_HEADERS = {"Accept-Encoding": "identity"}
SSE_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}

Chunk = tuple[np.ndarray, bool]  # (audio samples, last response of the request)
NO_AUDIO = np.zeros(0, np.float32)
Steps = Generator[Any, Any, Any]


# --- steps and their drivers -----------------------------------------------------------------------------------------
class Out(NamedTuple):
    """A value a stream's steps hand to the caller (anything else they yield is a step)."""

    value: Any


def _do(step: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return step(), None
    except BaseException as exc:  # noqa: BLE001  thrown into the steps: they catch what they handle, the rest goes on out
        return None, exc


def _advance(steps: Steps, value: Any, error: BaseException | None) -> Any:
    return steps.send(value) if error is None else steps.throw(error)


async def _done(value: Any, error: BaseException | None) -> tuple[Any, BaseException | None]:
    """A step's result, awaited when it is awaitable."""
    if error is None and inspect.isawaitable(value):
        try:
            return await value, None
        except BaseException as exc:  # noqa: BLE001  CancelledError too: the steps' finally runs, and it goes on out
            return None, exc
    return value, error


def run_sync(steps: Steps) -> Any:
    """What `steps` return, each of their steps called in this thread."""
    value, error = None, None
    while True:
        try:
            step = _advance(steps, value, error)
        except StopIteration as done:
            return done.value
        value, error = _do(step)


async def run_async(steps: Steps) -> Any:
    """What `steps` return, each step's awaitable awaited."""
    value, error = None, None
    while True:
        try:
            step = _advance(steps, value, error)
        except StopIteration as done:
            return done.value
        value, error = await _done(*_do(step))


def iterate_sync(steps: Steps) -> Iterator[Any]:
    """The values `steps` hand out (`Out`); closing the iterator closes them."""
    with contextlib.closing(steps):
        value, error = None, None
        while True:
            try:
                item = _advance(steps, value, error)
            except StopIteration:
                return
            if type(item) is Out:
                value, error = None, None
                yield item.value
            else:
                value, error = _do(item)


async def iterate_async(steps: Steps) -> AsyncIterator[Any]:
    """asyncio twin of `iterate_sync`."""
    with contextlib.closing(steps):
        value, error = None, None
        while True:
            try:
                item = _advance(steps, value, error)
            except StopIteration:
                return
            if type(item) is Out:
                value, error = None, None
                yield item.value
            else:
                value, error = await _done(*_do(item))


# --- answers: decoding and errors ------------------------------------------------------------------------------------
def infer_result(result, spoken_text: bool):
    """AUDIO of a response, or (AUDIO, SPOKEN_TEXT) when that was asked for."""
    audio = audio_from_result(result)
    if not spoken_text:
        return audio
    text = spoken_text_from_result(result)
    if text is None:
        raise ChatTTSError(INTERNAL, "response has no SPOKEN_TEXT output")
    return audio, text


def json_ints(obj):
    """gRPC's JSON statistics carry uint64 as strings; make them ints like HTTP's."""
    if isinstance(obj, dict):
        return {k: (v if k in ("name", "version") else json_ints(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_ints(v) for v in obj]
    if isinstance(obj, str) and obj.isdigit():
        return int(obj)
    return obj


def no_chunk(timeout_s: float) -> TimeoutError:
    return TimeoutError(f"no audio chunk within {timeout_s:g} s")


def rpc_exception(e):
    """A gRPC RpcError as tritonclient's exception (its status, the canonical one)."""
    from tritonclient.utils import InferenceServerException

    return InferenceServerException(e.details() or str(e), status=str(e.code()))


def error_text(body: bytes) -> str:
    """The message of an HTTP error body (Triton's {"error": ...}, else the body)."""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace").strip() or "(no message)"


class SSEParser:
    """Server-sent events: feed bytes as they arrive, get the `data` of each complete event."""

    def __init__(self):
        self._buf = bytearray()
        self._scan = 0  # no newline before this offset of _buf (long lines arrive in many pieces)
        self._data: list[bytes] = []

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        events: list[bytes] = []
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

    def close(self) -> list[bytes]:
        """Events left at the end of the body (a last event without its blank line)."""
        events = self.feed(b"\n\n") if self._buf or self._data else []
        self._buf.clear()
        return events


def sse_event(data: bytes) -> tuple[np.ndarray, str | None]:
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


def generate_stream_path(model: str) -> str:
    from urllib.parse import quote

    return f"/v2/models/{quote(model, safe='')}/generate_stream"


def json_body(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An HTTP generate_stream request's body."""
    return json.dumps(to_json_inputs(arrays)).encode("utf-8")


# --- stream sessions: one request to the stream model each; send(), receive() until final, close(cancel) ------------
class _StreamSession:
    _run: Callable[[Steps], Any]  # run_sync or run_async: the face's driver

    def __init__(self, model: str, timeout_s: float, spoken_text: bool):
        self._model, self._timeout_s, self._want_spoken_text = model, timeout_s, spoken_text
        self.spoken_text: str | None = None  # SPOKEN_TEXT, once a response carried it

    def _grpc_chunk(self, result) -> Chunk:
        if self._want_spoken_text and self.spoken_text is None:
            self.spoken_text = spoken_text_from_result(result)
        return chunk_from_result(result)


class _GrpcStreamSession(_StreamSession):
    """One ModelStreamInfer call on the transport's channel (gRPC calls share a channel; tritonclient's
    start_stream allows one stream per client and leaves a thread blocked after each cancel). A reader
    thread queues the responses, so each wait has the chunk timeout; cancel() ends the call."""

    def __init__(self, transport: GrpcTransport, model: str, timeout_s: float, spoken_text: bool = False):
        super().__init__(model, timeout_s, spoken_text)
        self._transport = transport
        self._events: queue.Queue = queue.Queue()
        self._call = None
        self._reader: threading.Thread | None = None

    def _request(self, arrays: Mapping[str, np.ndarray]):
        """The ModelInferRequest tritonclient's async_stream_infer would send, asking for an empty final response."""
        from tritonclient.grpc._utils import _get_inference_request

        module = self._transport._module
        request = _get_inference_request(
            model_name=self._model, inputs=to_infer_inputs(module, arrays), model_version="",
            request_id=uuid.uuid4().hex, outputs=requested_outputs(module, self._want_spoken_text), sequence_id=0,
            sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=None,
        )  # fmt: skip
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        return request

    def send(self, arrays: Mapping[str, np.ndarray]) -> None:
        # one request, then half-close: the responses keep coming (tritonclient's stub, private)
        self._call = self._transport._tc._client_stub.ModelStreamInfer(iter([self._request(arrays)]))
        self._reader = threading.Thread(target=self._read, args=(self._call,), name="chattts-stream", daemon=True)
        self._reader.start()

    def _read(self, call) -> None:
        import grpc

        try:
            for response in call:
                self._events.put((response, None))
            self._events.put((None, ConnectionError("the stream ended before its final response")))
        except grpc.RpcError as e:
            self._events.put((None, rpc_exception(e)))

    def receive(self) -> Chunk:
        from tritonclient.grpc import InferResult

        try:
            response, error = self._events.get(timeout=self._timeout_s)
        except queue.Empty:
            raise no_chunk(self._timeout_s) from None
        if error is not None:
            raise error
        if response.error_message:
            raise stream_error(response.error_message)
        return self._grpc_chunk(InferResult(response.infer_response))

    def close(self, cancel: bool) -> None:
        if self._call is None:
            return
        if not cancel:  # after the final response the server ends the call
            self._reader.join(CLOSE_WAIT_S)
        self._call.cancel()  # no-op once the call has ended
        self._reader.join(CLOSE_WAIT_S)  # no call left running on the channel


class _AioGrpcStreamSession(_StreamSession):
    """One `stream_infer` call (many can share a tritonclient.grpc.aio client); cancel() ends it."""

    def __init__(self, client, module, model: str, timeout_s: float, spoken_text: bool = False):
        super().__init__(model, timeout_s, spoken_text)
        self._client, self._module = client, module
        self._call = None

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
            raise no_chunk(self._timeout_s) from None
        except StopAsyncIteration:
            raise ConnectionError("the stream ended before its final response") from None
        except grpc.RpcError as e:
            raise rpc_exception(e) from e
        if error is not None:  # a server error response has no status (Triton 2.51), a broken stream (RpcError) has one
            raise error if error.status() else stream_error(error.message() or str(error))
        return self._grpc_chunk(result)

    def close(self, cancel: bool) -> None:
        if cancel and self._call is not None:  # else the server ends the call after the final response
            self._call.cancel()


class _SSEStreamSession(_StreamSession):
    """POST .../generate_stream and read its server-sent events. Closing the response before its end closes the
    connection, which Triton takes as a cancellation. Generate_stream sends every output: SPOKEN_TEXT comes unasked.
    A face gives the I/O: `_post(path, body)` -> the response (its `headers` and `status` read here), `_read_all()` ->
    the body, `_read_some()` -> the next bytes of the body (b"" at its end), `_drop()` (close the connection) and
    `_release()`; each raises TimeoutError (`no_chunk`) or ConnectionError for what its library raises."""

    def __init__(self, model: str, timeout_s: float):
        super().__init__(model, timeout_s, spoken_text=False)
        self._resp = None
        self._eof = False
        self._parser = SSEParser()
        self._pending: collections.deque[bytes] = collections.deque()

    def send(self, arrays: Mapping[str, np.ndarray]):
        return self._run(self._send(arrays))

    def _send(self, arrays: Mapping[str, np.ndarray]) -> Steps:
        from tritonclient.utils import InferenceServerException

        # returns once the first response (or error) is there: Triton sends the headers with it
        self._resp = yield functools.partial(self._post, generate_stream_path(self._model), json_body(arrays))
        if not self._resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            # an error as first response comes as HTTP 400 whatever its code: the event is what counts
            body = yield self._read_all
            raise InferenceServerException(error_text(body), status=str(self._resp.status))

    def receive(self):
        return self._run(self._receive())

    def _receive(self) -> Steps:
        while not self._pending:
            if self._eof:
                return NO_AUDIO, True
            data = yield self._read_some
            if not data:
                self._eof = True
                self._pending.extend(self._parser.close())
            else:
                self._pending.extend(self._parser.feed(data))
        audio, spoken = sse_event(self._pending.popleft())
        if self.spoken_text is None:
            self.spoken_text = spoken
        return audio, False

    def close(self, cancel: bool) -> None:
        if self._resp is None:
            return
        if cancel or not self._eof:
            self._drop()  # drops the connection: the server cancels the request
        else:
            self._release()


class _HttpStreamSession(_SSEStreamSession):
    """urllib3: the chunk timeout is the socket read timeout."""

    _run = staticmethod(run_sync)

    def __init__(self, pool, model: str, timeout_s: float, connect_timeout_s: float):
        super().__init__(model, timeout_s)
        self._pool, self._connect_timeout_s = pool, connect_timeout_s
        self._body: Iterator[bytes] | None = None

    def _translate(self, exc: Exception) -> Exception:
        import urllib3

        if isinstance(exc, urllib3.exceptions.ReadTimeoutError):
            return no_chunk(self._timeout_s)
        if isinstance(exc, urllib3.exceptions.HTTPError):
            return ConnectionError(f"{type(exc).__name__}: {exc}")
        return exc

    def _post(self, path: str, body: bytes):
        import urllib3

        try:
            return self._pool.urlopen(
                "POST", path, body=body, headers=SSE_HEADERS, preload_content=False, release_conn=False, retries=False,
                timeout=urllib3.Timeout(connect=self._connect_timeout_s, read=self._timeout_s),
            )  # fmt: skip
        except urllib3.exceptions.HTTPError as e:
            raise self._translate(e) from e

    def _read_all(self) -> bytes:
        import urllib3

        try:
            return self._resp.read()
        except urllib3.exceptions.HTTPError as e:
            raise self._translate(e) from e

    def _read_some(self) -> bytes:
        import urllib3

        if self._body is None:
            self._body = self._resp.stream(None)
        try:
            return next(self._body)
        except StopIteration:
            return b""
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise self._translate(e) from e

    def _drop(self) -> None:
        self._resp.close()
        self._resp.release_conn()

    def _release(self) -> None:
        self._resp.release_conn()


class _AioHttpStreamSession(_SSEStreamSession):
    """aiohttp: each read waits at most the chunk timeout."""

    _run = staticmethod(run_async)

    def __init__(self, transport: AioHttpTransport, model: str, timeout_s: float):
        super().__init__(model, timeout_s)
        self._transport = transport

    async def _post(self, path: str, body: bytes):
        post = self._transport._session().post(self._transport._base + path, data=body, headers=SSE_HEADERS)
        try:
            return await asyncio.wait_for(post, self._timeout_s)
        except asyncio.TimeoutError:
            raise no_chunk(self._timeout_s) from None

    async def _read_all(self) -> bytes:
        return await asyncio.wait_for(self._resp.read(), self._timeout_s)

    async def _read_some(self) -> bytes:
        import aiohttp

        try:
            return await asyncio.wait_for(self._resp.content.readany(), self._timeout_s)
        except asyncio.TimeoutError:
            raise no_chunk(self._timeout_s) from None
        except aiohttp.ClientPayloadError as e:  # the server went away mid-body
            raise ConnectionError(f"{type(e).__name__}: {e}") from e

    def _drop(self) -> None:
        self._resp.close()

    def _release(self) -> None:
        self._resp.release()


# --- transports: one tritonclient call each, errors left raw ---------------------------------------------------------
class _Transport:
    """The unary calls of tritonclient's four clients (grpc, http, and their aio twins: the same methods, the aio ones
    awaitable). A face gives `_run`, `_client()` and the keywords each call takes."""

    _run: Callable[[Steps], Any]
    _INFER_KW: dict[str, Any] = {}

    def __init__(self, module, model: str, timeout_s: float):
        self._module, self._model, self._timeout_s = module, model, timeout_s

    def _client(self):
        raise NotImplementedError

    def _call_kw(self, call: str) -> dict[str, Any]:
        """Keywords of tritonclient's `call` ("infer", "ready", "statistics") for this protocol."""
        raise NotImplementedError

    def infer(self, arrays: Mapping[str, np.ndarray], spoken_text: bool = False):
        return self._run(self._infer(arrays, spoken_text))

    def _infer(self, arrays: Mapping[str, np.ndarray], spoken_text: bool) -> Steps:
        m = self._module
        call = functools.partial(self._client().infer, self._model, to_infer_inputs(m, arrays),
                                 outputs=requested_outputs(m, spoken_text), **self._call_kw("infer"))
        return infer_result((yield call), spoken_text)

    def is_ready(self, model: str | None = None):
        """The server and `model` (default: the transport's) are ready."""
        return self._run(self._is_ready(model or self._model))

    def _is_ready(self, model: str) -> Steps:
        client, kw = self._client(), self._call_kw("ready")
        return bool((yield functools.partial(client.is_server_ready, **kw))
                    and (yield functools.partial(client.is_model_ready, model, **kw)))

    def statistics(self, model: str):
        """Triton's per-model statistics (all models when `model` is empty), HTTP JSON layout."""
        return self._run(self._statistics(model))

    def _statistics(self, model: str) -> Steps:
        return json_ints((yield functools.partial(self._client().get_inference_statistics, model,
                                                  **self._call_kw("statistics"))))


class _GrpcCalls(_Transport):
    def __init__(self, model: str, timeout_s: float):
        import tritonclient.grpc as module

        super().__init__(module, model, timeout_s)

    def _call_kw(self, call: str) -> dict[str, Any]:
        if call == "ready":
            return {"client_timeout": min(self._timeout_s, CONNECT_TIMEOUT_S)}
        return {"client_timeout": self._timeout_s, **({"as_json": True} if call == "statistics" else {})}


class _HttpCalls(_Transport):
    def __init__(self, model: str, timeout_s: float):
        import tritonclient.http as module

        super().__init__(module, model, timeout_s)

    def _call_kw(self, call: str) -> dict[str, Any]:
        # a copy each call: tritonclient adds its own headers to the dict
        return {} if call == "ready" else {"headers": dict(UNCOMPRESSED_HEADERS)}


class GrpcTransport(_GrpcCalls):
    _run = staticmethod(run_sync)

    def __init__(self, url: str, model: str, timeout_s: float):
        super().__init__(model, timeout_s)
        self._tc = self._module.InferenceServerClient(url)  # thread-safe for unary calls and streams

    def _client(self):
        return self._tc

    def open_stream(self, model: str, chunk_timeout_s: float, spoken_text: bool = False) -> _GrpcStreamSession:
        return _GrpcStreamSession(self, model, chunk_timeout_s, spoken_text)

    def close(self) -> None:
        self._tc.close()


class HttpTransport(_HttpCalls):
    """tritonclient.http clients are not thread-safe: one per thread."""

    _run = staticmethod(run_sync)

    def __init__(self, url: str, model: str, timeout_s: float):
        super().__init__(model, timeout_s)
        self._url = url
        self._local = threading.local()
        self._clients: list[Any] = []
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
            clients, self._clients = self._clients, []
        if pool is not None:
            pool.close()
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001  closing a client whose thread has gone: nothing left to release
                pass


class AioGrpcTransport(_GrpcCalls):
    """`channels` > 1: that many gRPC channels, each on its own connection (a local subchannel pool), calls
    spread over them in turn: one HTTP/2 connection carries every call of a channel."""

    _run = staticmethod(run_async)

    def __init__(self, url: str, model: str, timeout_s: float, max_concurrency: int, channels: int = 1):
        import tritonclient.grpc.aio as aio

        super().__init__(model, timeout_s)
        if channels == 1:
            self._clients = [aio.InferenceServerClient(url)]
        else:
            args = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 2**31 - 1),
                    ("grpc.max_receive_message_length", 2**31 - 1)]
            self._clients = [aio.InferenceServerClient(url, channel_args=args) for _ in range(channels)]
        self._turn = 0

    def _client(self):
        self._turn = (self._turn + 1) % len(self._clients)
        return self._clients[self._turn]

    def open_stream(self, model: str, chunk_timeout_s: float, spoken_text: bool = False) -> _AioGrpcStreamSession:
        return _AioGrpcStreamSession(self._client(), self._module, model, chunk_timeout_s, spoken_text)

    async def close(self) -> None:
        for client in self._clients:
            await client.close()


class AioHttpTransport(_HttpCalls):
    _run = staticmethod(run_async)

    def __init__(self, url: str, model: str, timeout_s: float, max_concurrency: int):
        import tritonclient.http.aio as aio

        super().__init__(model, timeout_s)
        # conn_timeout is aiohttp's total per-request timeout
        self._tc = aio.InferenceServerClient(url, conn_limit=max(100, max_concurrency), conn_timeout=timeout_s)
        self._base = "http://" + url
        self._connect_timeout_s = min(timeout_s, CONNECT_TIMEOUT_S)
        self._stream_session = None  # aiohttp session for generate_stream, no total timeout

    def _client(self):
        return self._tc

    def _session(self):
        if self._stream_session is None:
            import aiohttp

            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
            self._stream_session = aiohttp.ClientSession(timeout=timeout)
        return self._stream_session

    def open_stream(self, model: str, chunk_timeout_s: float, spoken_text: bool = False) -> _AioHttpStreamSession:
        return _AioHttpStreamSession(self, model, chunk_timeout_s)

    async def close(self) -> None:
        if self._stream_session is not None:
            await self._stream_session.close()
            self._stream_session = None
        await self._tc.close()
