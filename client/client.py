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
import concurrent.futures
import functools
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .contract import MODEL, STREAM_MODEL, SynthesisOptions, build_inputs, takes_options
from .errors import ChatTTSError, ChatTTSInputError, ChatTTSUnavailableError, to_chattts_error
from .transport import (
    NO_AUDIO,
    AioGrpcTransport,
    AioHttpTransport,
    GrpcTransport,
    HttpTransport,
    Out,
    SSEParser,
    Steps,
    iterate_async,
    iterate_sync,
    run_async,
    run_sync,
)

__all__ = ["AsyncChatTTSClient", "ChatTTSClient", "SSEParser", "check_protocol", "check_url", "split_sentences"]

PROTOCOLS = ("grpc", "http")
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
DEFAULT_MAX_CONCURRENCY = 16

OnResult = Callable[[int, np.ndarray | ChatTTSError], None]
OnSpokenText = Callable[[str], None]


def split_sentences(text: str, max_frames: int | None = None) -> list[str]:
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

    def give_up(self, err: ChatTTSError, attempt: int) -> ChatTTSError | None:
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


def _prepare(text: str, options: SynthesisOptions, split: bool) -> list[str]:
    if not isinstance(text, str):
        raise ChatTTSInputError(f"text must be a str, got {type(text).__name__}")
    sentences = split_sentences(text) if split else [text]
    if not sentences or not any(s.strip() for s in sentences):
        raise ChatTTSInputError("text is empty")
    for sentence in sentences:  # reject bad text before anything is sent
        options.to_inputs(sentence)
    return sentences


def _spoken(results: Sequence[Any], on_spoken_text: OnSpokenText | None) -> list[np.ndarray]:
    """The audio of `_infer_many`'s results; with `on_spoken_text` they are (audio, spoken text) pairs, each text
    handed to it in order."""
    if on_spoken_text is None:
        return list(results)
    for _, spoken in results:
        on_spoken_text(spoken)
    return [audio for audio, _ in results]


def _tell_spoken(session: Any, on_spoken_text: OnSpokenText | None) -> bool:
    """Hand a stream session's SPOKEN_TEXT to `on_spoken_text` once it has come; whether it was handed."""
    spoken = getattr(session, "spoken_text", None)
    if on_spoken_text is None or spoken is None:
        return False
    on_spoken_text(spoken)
    return True


def _join(pieces: Sequence[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces).astype(np.float32, copy=False)


def _spoken_kw(wanted: bool) -> dict[str, bool]:
    """The keyword a transport's infer / open_stream gets when the caller wants the spoken text (none otherwise:
    transports written before it take none)."""
    return {"spoken_text": True} if wanted else {}


class _ClientBase:
    """What a request does, written once as steps (client/transport.py) that each face runs with its driver: the
    retries, one utterance, a whole text (its voice reference first), a stream sentence by sentence. A face gives
    `_get_transport()`, `_sleep`, `infer_one` and `_infer_many` (a thread pool, or asyncio tasks)."""

    _sleep: Callable[[float], Any]

    def __init__(self, url, protocol, model, timeout_s, retries, backoff_s, max_backoff_s, max_concurrency,
                 stream_model=STREAM_MODEL):
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

    def _get_transport(self) -> Any:
        raise NotImplementedError

    def _endpoint_transport(self, url: str) -> Any:
        """A tritonclient transport to `url`."""
        raise NotImplementedError

    def _new_transport(self) -> Any:
        return self._endpoint_transport(self.url)

    def _chunk_timeout(self, chunk_timeout_s: float | None) -> float:
        if chunk_timeout_s is None:
            return self.timeout_s
        if chunk_timeout_s <= 0:
            raise ValueError(f"chunk_timeout_s must be > 0, got {chunk_timeout_s!r}")
        return float(chunk_timeout_s)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, protocol={self.protocol!r}, model={self.model!r})"

    # --- the steps --------------------------------------------------------------------------------------------------
    def _ready(self, model: str | None = None) -> Steps:
        try:
            transport = self._get_transport()
            return bool((yield functools.partial(transport.is_ready, model) if model else transport.is_ready))
        except Exception:  # noqa: BLE001  not ready, whatever the failure
            return False

    def _wait_until_ready(self, timeout_s: float, poll_s: float) -> Steps:
        deadline = time.monotonic() + timeout_s
        while not (yield self.is_ready):
            if time.monotonic() >= deadline:
                raise ChatTTSUnavailableError(f"{self.where}: not ready after {timeout_s:g} s")
            yield functools.partial(self._sleep, poll_s)

    def _retrying(self, step: Callable[[], Any]) -> Steps:
        """`step` again after each retryable failure, with backoff, until the retry policy gives up."""
        attempt = 0
        while True:
            try:
                return (yield step)
            except Exception as exc:
                err = to_chattts_error(exc, self.where)
                final = self.retry_policy.give_up(err, attempt)
                if final is not None:
                    raise final from exc
            yield functools.partial(self._sleep, self.retry_policy.delay(attempt))
            attempt += 1

    def _statistics(self, model: str) -> Steps:
        return (yield from self._retrying(lambda: self._get_transport().statistics(model)))

    def _infer(self, text: str, options: Any, spoken_text: bool) -> Steps:
        arrays = build_inputs(text, options)
        return (yield from self._retrying(lambda: self._get_transport().infer(arrays, **_spoken_kw(spoken_text))))

    def _synthesize(self, text: str, options: Any, overrides: dict[str, Any], split: bool, voice_from_first: bool,
                    on_spoken_text: OnSpokenText | None) -> Steps:
        options = SynthesisOptions.of(options, **overrides)
        sentences = _prepare(text, options, split)
        if _voice_reference_needed(sentences, options, voice_from_first):
            reference = yield functools.partial(self.infer_one, sentences[0], options)
            options = _with_voice_reference(options, reference, sentences[0])
        results = yield functools.partial(self._infer_many, sentences, options, spoken_text=on_spoken_text is not None)
        return _join(_spoken(results, on_spoken_text))

    def _synthesize_batch(self, texts: Sequence[str], options: Any, overrides: dict[str, Any], return_exceptions: bool,
                          on_result: OnResult | None) -> Steps:
        options = SynthesisOptions.of(options, **overrides)
        texts = list(texts)
        for t in texts:  # every text checked before anything is sent
            options.to_inputs(t)
        if not texts:
            return []
        return (yield functools.partial(self._infer_many, texts, options, return_exceptions, on_result))

    def _streamed(self, text: str, options: Any, overrides: dict[str, Any], split: bool, voice_from_first: bool,
                  chunk_timeout_s: float | None, on_spoken_text: OnSpokenText | None) -> Steps:
        """The steps of `stream`, its text and options checked now (not at the first chunk)."""
        options = SynthesisOptions.of(options, **overrides)
        sentences = _prepare(text, options, split)
        return self._stream(sentences, options, voice_from_first, self._chunk_timeout(chunk_timeout_s), on_spoken_text)

    def _stream(self, sentences: list[str], options: SynthesisOptions, voice_from_first: bool, timeout_s: float,
                on_spoken_text: OnSpokenText | None) -> Steps:
        need_reference = _voice_reference_needed(sentences, options, voice_from_first)
        for sentence in sentences:
            pieces: list[np.ndarray] | None = [] if need_reference else None
            yield from self._stream_one(options.to_inputs(sentence), timeout_s, on_spoken_text, pieces)
            if need_reference:
                options = _with_voice_reference(options, _join(pieces) if pieces else NO_AUDIO, sentence)
                need_reference = False

    def _stream_one(self, arrays: Mapping[str, np.ndarray], timeout_s: float, on_spoken_text: OnSpokenText | None,
                    pieces: list[np.ndarray] | None) -> Steps:
        """One request's non-empty chunks (each kept in `pieces` too, when given), with retries before the first one.
        Closed early (the caller stopped, or its task was cancelled), it cancels the request."""
        attempt, told = 0, on_spoken_text is None
        while True:
            session, final, yielded = None, False, False
            try:
                session = self._get_transport().open_stream(self.stream_model, timeout_s,
                                                            **_spoken_kw(on_spoken_text is not None))
                yield functools.partial(session.send, arrays)
                while not final:
                    chunk, final = yield session.receive
                    told = told or _tell_spoken(session, on_spoken_text)
                    if chunk.size:
                        yielded = True
                        if pieces is not None:
                            pieces.append(chunk)
                        yield Out(chunk)
                return
            except Exception as exc:  # CancelledError and GeneratorExit are not: cancelled below, not retried
                err = to_chattts_error(exc, self.stream_where)
                err = err if yielded else self.retry_policy.give_up(err, attempt)  # no retry once audio was yielded
                if err is not None:
                    raise err from exc
            finally:
                if session is not None:
                    session.close(cancel=not final)
            yield functools.partial(self._sleep, self.retry_policy.delay(attempt))
            attempt += 1


class ChatTTSClient(_ClientBase):
    """Blocking client. Thread-safe; batches run on an internal thread pool of `max_concurrency`."""

    def __init__(
        self,
        url: str | None = None,
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
        self._transport = transport if transport is not None else self._new_transport()
        self._sleep = sleep
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _endpoint_transport(self, url: str) -> Any:
        return (GrpcTransport if self.protocol == "grpc" else HttpTransport)(url, self.model, self.timeout_s)

    def _get_transport(self) -> Any:
        return self._transport

    # --- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._transport.close()

    def __enter__(self) -> ChatTTSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def is_ready(self) -> bool:
        """Server up and model ready; False (not an exception) when the server cannot be reached."""
        return run_sync(self._ready())

    def wait_until_ready(self, timeout_s: float = 60.0, poll_s: float = 0.5) -> None:
        run_sync(self._wait_until_ready(timeout_s, poll_s))

    def inference_statistics(self, model: str = "") -> dict:
        """Triton's per-model statistics (all models when `model` is empty), HTTP JSON layout."""
        return run_sync(self._statistics(model))

    # --- inference -------------------------------------------------------------------------------
    def infer_one(self, text: str, options: SynthesisOptions | Mapping[str, Any] | None = None,
                  spoken_text: bool = False):
        """One request, one utterance (no sentence splitting), with retries: its audio, or (audio, the text the
        server voiced) with `spoken_text`. `options`: a SynthesisOptions or a mapping of its field names."""
        return run_sync(self._infer(text, options, spoken_text))

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
        on_result: OnResult | None = None,
        spoken_text: bool = False,
    ) -> list[np.ndarray | ChatTTSError]:
        if len(texts) == 1 and on_result is None:
            try:
                return [self.infer_one(texts[0], options, spoken_text)]
            except ChatTTSError as err:
                if return_exceptions:
                    return [err]
                raise
        pool = self._executor()
        futures = {pool.submit(self.infer_one, t, options, spoken_text): i for i, t in enumerate(texts)}
        results: list[Any] = [None] * len(texts)
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
        options: SynthesisOptions | None = None,
        *,
        split: bool = True,
        voice_from_first: bool = True,
        on_spoken_text: OnSpokenText | None = None,
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
        return run_sync(self._synthesize(text, options, overrides, split, voice_from_first, on_spoken_text))

    @takes_options
    def synthesize_batch(
        self,
        texts: Sequence[str],
        options: SynthesisOptions | None = None,
        *,
        return_exceptions: bool = False,
        on_result: OnResult | None = None,
        **overrides: Any,
    ) -> list[np.ndarray | ChatTTSError]:
        """One utterance per text (not split, like upstream `infer(list)`), sent concurrently.

        Takes the same `options` and option keywords as `synthesize`. Results are in input order; with
        `return_exceptions` failed items are their ChatTTSError instead of raising the first one.
        `on_result(index, audio_or_error)` is called as each item finishes (e.g. a progress bar).
        """
        return run_sync(self._synthesize_batch(texts, options, overrides, return_exceptions, on_result))

    @takes_options
    def stream(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        *,
        split: bool = True,
        voice_from_first: bool = True,
        chunk_timeout_s: float | None = None,
        on_spoken_text: OnSpokenText | None = None,
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
        return iterate_sync(self._streamed(text, options, overrides, split, voice_from_first, chunk_timeout_s,
                                           on_spoken_text))


class AsyncChatTTSClient(_ClientBase):
    """asyncio client (tritonclient.grpc.aio / tritonclient.http.aio). Create and use it inside one
    event loop; `async with AsyncChatTTSClient(...) as c: audio = await c.synthesize(...)`."""

    def __init__(
        self,
        url: str | None = None,
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
        self._semaphore: asyncio.Semaphore | None = None
        self._channels = int(channels)

    def _endpoint_transport(self, url: str) -> Any:
        if self.protocol == "grpc":
            return AioGrpcTransport(url, self.model, self.timeout_s, self.max_concurrency, self._channels)
        return AioHttpTransport(url, self.model, self.timeout_s, self.max_concurrency)

    def _get_transport(self) -> Any:
        if self._transport is None:
            self._transport = self._new_transport()
        return self._transport

    async def close(self) -> None:
        if self._transport is not None:
            await self._transport.close()
            self._transport = None

    async def __aenter__(self) -> AsyncChatTTSClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def is_ready(self, model: str | None = None) -> bool:
        """The server and `model` (default: this client's; gRPC only for another) are ready."""
        return await run_async(self._ready(model))

    async def wait_until_ready(self, timeout_s: float = 60.0, poll_s: float = 0.5) -> None:
        await run_async(self._wait_until_ready(timeout_s, poll_s))

    async def inference_statistics(self, model: str = "") -> dict:
        return await run_async(self._statistics(model))

    async def infer_one(self, text: str, options: SynthesisOptions | Mapping[str, Any] | None = None,
                        spoken_text: bool = False):
        """See `ChatTTSClient.infer_one`."""
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        async with self._semaphore:
            return await run_async(self._infer(text, options, spoken_text))

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
    async def synthesize(self, text: str, options: SynthesisOptions | None = None, *, split: bool = True,
                         voice_from_first: bool = True, on_spoken_text: OnSpokenText | None = None,
                         **overrides: Any) -> np.ndarray:
        """See `ChatTTSClient.synthesize`."""
        return await run_async(self._synthesize(text, options, overrides, split, voice_from_first, on_spoken_text))

    @takes_options
    async def synthesize_batch(self, texts: Sequence[str], options: SynthesisOptions | None = None, *,
                               return_exceptions: bool = False, on_result: OnResult | None = None,
                               **overrides: Any) -> list[np.ndarray | ChatTTSError]:
        """See `ChatTTSClient.synthesize_batch`."""
        return await run_async(self._synthesize_batch(texts, options, overrides, return_exceptions, on_result))

    @takes_options
    def stream(self, text: str, options: SynthesisOptions | None = None, *, split: bool = True,
               voice_from_first: bool = True, chunk_timeout_s: float | None = None,
               on_spoken_text: OnSpokenText | None = None, **overrides: Any) -> AsyncIterator[np.ndarray]:
        """See `ChatTTSClient.stream`: `async for chunk in client.stream(...)`. Breaking out of the loop
        cancels the request once the generator is collected; `contextlib.aclosing(client.stream(...))`
        (or cancelling the task) cancels it at once."""
        return iterate_async(self._streamed(text, options, overrides, split, voice_from_first, chunk_timeout_s,
                                            on_spoken_text))
