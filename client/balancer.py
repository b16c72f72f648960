"""Client across several Triton servers: `BalancedChatTTSClient` / `AsyncBalancedChatTTSClient`.

Same `synthesize` / `synthesize_batch` / `stream` API as `ChatTTSClient` (they subclass it); only the
transport differs. One tritonclient transport per endpoint; each request goes to the endpoint that is up and has
the fewest requests outstanding (ties: round robin). UNAVAILABLE or a connection failure marks that
endpoint down and the same request is re-sent to another endpoint at once; any other error
(INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...) is raised without re-sending, since another server would
answer the same (or the request may still be running). A down endpoint is probed (server and model
ready) in the background once its cool-down has passed, and comes back when the probe succeeds.
When every endpoint is down a request probes them all itself, ignoring the cool-down, and only then
gives up with UNAVAILABLE; the client's retry policy (retries, exponential backoff) then repeats that
before `ChatTTSUnavailableError` reaches the caller.

Re-sending is safe because synthesis has no side effects: the worst case is a request computed twice.
Note Triton also answers UNAVAILABLE when a model's queue is full; that endpoint then sits out one
cool-down (its probe succeeds) while the others take the load.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .client import (
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    MAX_BACKOFF_S,
    AsyncChatTTSClient,
    ChatTTSClient,
    check_url,
)
from .contract import MODEL, STREAM_MODEL
from .errors import ChatTTSError, ChatTTSUnavailableError, to_chattts_error
from .transport import Steps, run_async, run_sync

DEFAULT_COOLDOWN_S = 2.0  # a down endpoint is not probed again sooner than this


def parse_urls(urls: str | Sequence[str]) -> list[str]:
    """'h1:8001,h2:8001' or ['h1:8001', 'h2:8001'] -> a list of distinct HOST:PORT strings."""
    if isinstance(urls, str):
        urls = urls.split(",")
    items = [u.strip() if isinstance(u, str) else u for u in urls]
    items = [u for u in items if u != ""]
    if not items:
        raise ValueError("urls must name at least one HOST:PORT")
    for url in items:
        check_url(url)
    if len(set(items)) != len(items):
        raise ValueError(f"urls must be distinct, got {items}")
    return items


class Endpoint:
    """One server and its balancing state. Read `endpoint_stats()`; the pool's lock guards writes."""

    def __init__(self, url: str, transport: Any):
        self.url = url
        self.transport = transport
        self.up = True  # optimistic until a request or probe says otherwise
        self.outstanding = 0
        self.served = 0  # requests answered successfully
        self.failures = 0  # times marked down
        self.retry_at = 0.0  # when a down endpoint may be probed
        self.probing = False
        self.last_error: str | None = None

    def stats(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "up": self.up,
            "outstanding": self.outstanding,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
        }


class EndpointPool:
    """Selection state shared by the sync and async balancers. Every method holds one lock briefly."""

    def __init__(self, endpoints: Sequence[Endpoint], cooldown_s: float, clock: Callable[[], float]):
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
        self.endpoints = list(endpoints)
        self.cooldown_s = float(cooldown_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._next = 0  # round-robin start among equally loaded endpoints

    def acquire(self, exclude: set[Endpoint] = frozenset()) -> Endpoint | None:
        """The up endpoint (not in `exclude`) with the fewest outstanding requests, now counted as busy."""
        with self._lock:
            n = len(self.endpoints)
            best = None
            for k in range(n):
                ep = self.endpoints[(self._next + k) % n]
                if ep.up and ep not in exclude and (best is None or ep.outstanding < best.outstanding):
                    best = ep
            if best is None:
                return None
            best.outstanding += 1
            self._next = (self.endpoints.index(best) + 1) % n
            return best

    def claim(self, ep: Endpoint) -> None:
        with self._lock:
            ep.outstanding += 1

    def release(self, ep: Endpoint, ok: bool) -> None:
        with self._lock:
            ep.outstanding -= 1
            ep.served += int(ok)

    def mark_down(self, ep: Endpoint, err: ChatTTSError) -> None:
        with self._lock:
            ep.last_error = str(err)
            if ep.up:  # requests failing on an endpoint already down do not extend its cool-down
                ep.up = False
                ep.failures += 1
                ep.retry_at = self._clock() + self.cooldown_s

    def due_probes(self) -> list[Endpoint]:
        """Down endpoints whose cool-down has passed, claimed so that only one probe runs for each."""
        with self._lock:
            now = self._clock()
            due = [ep for ep in self.endpoints if not ep.up and not ep.probing and ep.retry_at <= now]
            for ep in due:
                ep.probing = True
            return due

    def claim_for_probe(self, exclude: set[Endpoint]) -> list[Endpoint]:
        """Every down endpoint not in `exclude` and not being probed, ignoring the cool-down."""
        with self._lock:
            due = [ep for ep in self.endpoints if not ep.up and not ep.probing and ep not in exclude]
            for ep in due:
                ep.probing = True
            return due

    def probe_done(self, ep: Endpoint, ready: bool) -> None:
        with self._lock:
            ep.probing = False
            if ready:
                ep.up = True
            elif not ep.up:
                ep.retry_at = self._clock() + self.cooldown_s

    def unclaim(self, eps: Sequence[Endpoint]) -> None:
        with self._lock:
            for ep in eps:
                ep.probing = False

    def stats(self) -> list[dict[str, Any]]:
        with self._lock:
            return [ep.stats() for ep in self.endpoints]


def _where(protocol: str, url: str, model: str) -> str:
    return f"{protocol}://{url} model '{model}'"


def _all_down(pool: EndpointPool, last: ChatTTSError | None) -> ChatTTSUnavailableError:
    detail = f"; last error: {last}" if last is not None else ""
    urls = ", ".join(ep.url for ep in pool.endpoints)
    return ChatTTSUnavailableError(f"all {len(pool.endpoints)} endpoint(s) down ({urls}){detail}")


# --- selection and failover, as steps (client/transport.py) that each face runs with its driver ---------------------
class _Balanced:
    """The endpoints' transports as one transport. A face gives `_run` and `_start_due_probes` (threads or tasks)."""

    _run: Callable[[Steps], Any]

    def __init__(self, pool: EndpointPool, protocol: str, model: str):
        self.pool, self._protocol, self._model = pool, protocol, model

    def _where(self, ep: Endpoint, model: str | None = None) -> str:
        return _where(self._protocol, ep.url, model or self._model)

    def _start_due_probes(self) -> None:
        raise NotImplementedError

    def _probe(self, ep: Endpoint) -> Steps:
        try:
            ready = bool((yield ep.transport.is_ready))
        except Exception:  # noqa: BLE001  any failure of a probe: not ready
            ready = False
        self.pool.probe_done(ep, ready)
        return ready

    def _revive(self, exclude: set[Endpoint]) -> Steps:
        """All down: probe them here (this request has nothing else to do); the first ready one, claimed."""
        claimed = self.pool.claim_for_probe(exclude)
        for k, ep in enumerate(claimed):
            if (yield from self._probe(ep)):
                self.pool.claim(ep)
                self.pool.unclaim(claimed[k + 1 :])
                return ep
        return None

    def _acquire(self, tried: set[Endpoint], last: ChatTTSError | None) -> Steps:
        """The endpoint for the next attempt, counted as busy; UNAVAILABLE when none is up or revives."""
        self._start_due_probes()
        ep = self.pool.acquire(tried) or (yield from self._revive(tried))
        if ep is None:
            raise _all_down(self.pool, last)
        return ep

    def infer(self, arrays: Mapping[str, np.ndarray], **kw):
        return self._run(self._infer(arrays, kw))

    def _infer(self, arrays: Mapping[str, np.ndarray], kw: dict[str, Any]) -> Steps:
        tried: set[Endpoint] = set()
        last: ChatTTSError | None = None
        while True:
            ep = yield from self._acquire(tried, last)
            ok = False
            try:
                audio = yield functools.partial(ep.transport.infer, arrays, **kw)
                ok = True
                return audio
            except Exception as exc:  # CancelledError is a BaseException: not a failover
                err = to_chattts_error(exc, self._where(ep))
                if not err.retryable:
                    raise err from exc
                self.pool.mark_down(ep, err)
                tried.add(ep)
                last = err
            finally:
                self.pool.release(ep, ok)

    def open_stream(self, model: str, chunk_timeout_s: float, **kw) -> _BalancedStreamSession:
        return _BalancedStreamSession(self, model, chunk_timeout_s, **kw)

    def statistics(self, model: str):
        return self._run(self._statistics(model))

    def _statistics(self, model: str) -> Steps:
        stats: dict[str, Any] = {}
        last: ChatTTSError | None = None
        for ep in self.pool.endpoints:
            try:
                stats[ep.url] = yield functools.partial(ep.transport.statistics, model)
            except Exception as exc:  # noqa: BLE001  any failure: the next server's statistics
                last = to_chattts_error(exc, self._where(ep))
        if not stats:
            raise _all_down(self.pool, last)
        return stats


class _BalancedStreamSession:
    """A stream request on the least busy endpoint. UNAVAILABLE or a connection failure before the
    first audio marks the endpoint down and sends the request to another one, like `infer`."""

    def __init__(self, transport: _Balanced, model: str, chunk_timeout_s: float, **kw):
        self._t, self._model, self._timeout_s = transport, model, chunk_timeout_s
        self._kw = kw  # open_stream keywords (spoken_text) for each endpoint's session
        self.spoken_text: str | None = None
        self._tried: set[Endpoint] = set()
        self._last: ChatTTSError | None = None
        self._arrays: Mapping[str, np.ndarray] | None = None
        self._ep: Endpoint | None = None
        self._session: Any = None
        self._audio = False  # audio came back: no failover any more

    def _open(self) -> Steps:
        self._ep = yield from self._t._acquire(self._tried, self._last)
        try:
            self._session = self._ep.transport.open_stream(self._model, self._timeout_s, **self._kw)
            yield functools.partial(self._session.send, self._arrays)
        except Exception as exc:  # noqa: BLE001  any failure before the first chunk: the next server
            yield from self._failed(exc)

    def _failed(self, exc: Exception) -> Steps:
        """Raise, or fail over to the next endpoint (which may raise in turn)."""
        ep = self._ep
        err = to_chattts_error(exc, self._t._where(ep, self._model))
        self._release(cancel=True)
        if not err.retryable or self._audio:
            raise err from exc
        self._t.pool.mark_down(ep, err)
        self._tried.add(ep)
        self._last = err
        yield from self._open()

    def _release(self, cancel: bool) -> None:
        ep, session, self._ep, self._session = self._ep, self._session, None, None
        try:
            if session is not None:
                session.close(cancel)
        finally:
            if ep is not None:
                self._t.pool.release(ep, not cancel)

    def send(self, arrays: Mapping[str, np.ndarray]):
        self._arrays = arrays
        return self._t._run(self._open())

    def receive(self):
        return self._t._run(self._receive())

    def _receive(self) -> Steps:
        while True:
            try:
                chunk, final = yield self._session.receive
            except Exception as exc:  # noqa: BLE001  any failure: _failed decides whether another server gets it
                yield from self._failed(exc)
                continue
            self._audio = self._audio or chunk.size > 0
            self.spoken_text = self.spoken_text or getattr(self._session, "spoken_text", None)
            return chunk, final

    def close(self, cancel: bool) -> None:  # synchronous in both faces, as the sessions' is
        self._release(cancel)


class _BalancedTransport(_Balanced):
    _run = staticmethod(run_sync)

    def __init__(self, pool: EndpointPool, protocol: str, model: str):
        super().__init__(pool, protocol, model)
        self._probe_threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()

    def _start_due_probes(self) -> None:
        for ep in self.pool.due_probes():
            thread = threading.Thread(target=run_sync, args=(self._probe(ep),), name=f"chattts-probe-{ep.url}",
                                      daemon=True)
            with self._threads_lock:
                self._probe_threads = [t for t in self._probe_threads if t.is_alive()] + [thread]
            thread.start()

    def wait_for_probes(self, timeout_s: float | None = None) -> None:
        with self._threads_lock:
            threads = list(self._probe_threads)
        for thread in threads:
            thread.join(timeout_s)

    def is_ready(self) -> bool:
        """Probe every endpoint now (updating up/down); True if any is ready."""
        return any([run_sync(self._probe(ep)) for ep in self.pool.endpoints])

    def close(self) -> None:
        self.wait_for_probes(timeout_s=1.0)
        for ep in self.pool.endpoints:
            ep.transport.close()


class _AsyncBalancedTransport(_Balanced):
    _run = staticmethod(run_async)

    def __init__(self, pool: EndpointPool, protocol: str, model: str):
        super().__init__(pool, protocol, model)
        self._probe_tasks: set[asyncio.Task] = set()

    def _start_due_probes(self) -> None:
        for ep in self.pool.due_probes():
            task = asyncio.ensure_future(run_async(self._probe(ep)))
            self._probe_tasks.add(task)
            task.add_done_callback(self._probe_tasks.discard)

    async def wait_for_probes(self) -> None:
        if self._probe_tasks:
            await asyncio.gather(*list(self._probe_tasks), return_exceptions=True)

    async def is_ready(self) -> bool:
        results = await asyncio.gather(*[run_async(self._probe(ep)) for ep in self.pool.endpoints])
        return any(results)

    async def close(self) -> None:
        for task in list(self._probe_tasks):
            task.cancel()
        await asyncio.gather(*list(self._probe_tasks), return_exceptions=True)
        for ep in self.pool.endpoints:
            await ep.transport.close()


# --- the clients -----------------------------------------------------------------------------------------------------
class _BalancedClient:
    """What the sync and async balanced clients add to their client: the endpoints, made into one transport by
    `_new_transport` (the sync face's at once, the async face's on first use, inside the running loop, unless
    `transports` are given). `inference_statistics()` answers {url: Triton statistics} for every endpoint that
    answered (UNAVAILABLE if none did)."""

    _BALANCED: type  # _BalancedTransport or _AsyncBalancedTransport
    protocol: str
    model: str
    _transport: Any
    _endpoint_transport: Callable[[str], Any]  # the client's: a tritonclient transport to one url

    def __init__(
        self,
        urls: str | Sequence[str],
        protocol: str = "grpc",
        model: str = MODEL,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        *,
        max_backoff_s: float = MAX_BACKOFF_S,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        stream_model: str = STREAM_MODEL,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        transports: Sequence[Any] | None = None,
        sleep: Callable[[float], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`sleep`: None for the client's (time.sleep, asyncio.sleep)."""
        self.urls = parse_urls(urls)
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
        self._cooldown_s, self._transports, self._clock = cooldown_s, transports, clock
        face = {"sleep": sleep} if sleep is not None else {}
        super().__init__(
            ",".join(self.urls), protocol, model, timeout_s, retries, backoff_s, max_backoff_s=max_backoff_s,
            max_concurrency=max_concurrency, stream_model=stream_model, **face,
        )  # fmt: skip
        if transports is not None and self._transport is None:  # else the async face's comes on first use
            self._transport = self._new_transport()

    def _new_transport(self) -> _Balanced:
        transports = self._transports
        if transports is None:
            transports = [self._endpoint_transport(url) for url in self.urls]
        transports = list(transports)
        if len(transports) != len(self.urls):
            raise ValueError(f"got {len(transports)} transports for {len(self.urls)} urls")
        endpoints = [Endpoint(u, t) for u, t in zip(self.urls, transports, strict=True)]
        pool = EndpointPool(endpoints, self._cooldown_s, self._clock)
        return self._BALANCED(pool, self.protocol, self.model)

    def endpoint_stats(self) -> list[dict[str, Any]]:
        """Per endpoint, in `urls` order: url, up, outstanding, served, failures, last_error."""
        return self._get_transport().pool.stats()

    def wait_for_probes(self, *args):
        """Join the background probes started so far (tests; close() does it too): `timeout_s` (sync), awaitable
        (async)."""
        return self._get_transport().wait_for_probes(*args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.urls!r}, protocol={self.protocol!r}, model={self.model!r})"


class BalancedChatTTSClient(_BalancedClient, ChatTTSClient):
    """`ChatTTSClient` over several servers: least-outstanding-requests balancing with failover.

    `urls`: a list of HOST:PORT or one comma-separated string. Thread-safe. `retries` / `backoff_s`
    apply only once every endpoint is down (a single endpoint's failure is absorbed by failover).
    `transports` (one per url, objects with infer / is_ready / statistics / close) and `clock`
    replace tritonclient and time.monotonic, for tests.
    """

    _BALANCED = _BalancedTransport


class AsyncBalancedChatTTSClient(_BalancedClient, AsyncChatTTSClient):
    """asyncio twin of `BalancedChatTTSClient`; create and use it inside one event loop."""

    _BALANCED = _AsyncBalancedTransport
