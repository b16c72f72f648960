"""Python client of the `chattts` Triton ensemble: sync (`ChatTTSClient`) and asyncio
(`AsyncChatTTSClient`), over gRPC or HTTP.

- Every contract input is a keyword of `synthesize` (None = server default, input not sent).
- Long text is split into sentences like upstream `Chat.infer(split_text=True)`; the sentences go out
  as concurrent requests (so Triton's dynamic batcher can batch them) and are joined in order.
  Like upstream, when no reference audio is given the first sentence is synthesised once and used as
  the speaker reference (SPEAKER_AUDIO / SPEAKER_TEXT) for all sentences, so the voice stays the same.
- Each attempt has `timeout_s`; UNAVAILABLE and connection failures are retried with exponential
  backoff, everything else raises `ChatTTSError` at once (INVALID_ARGUMENT is never retried).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from .contract import (
    MODEL,
    OPTION_INPUTS,
    audio_from_result,
    build_inputs,
    check_options,
    requested_outputs,
    to_infer_inputs,
)
from .errors import ChatTTSError, ChatTTSInputError, ChatTTSUnavailableError, to_chattts_error

PROTOCOLS = ("grpc", "http")
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
DEFAULT_MAX_CONCURRENCY = 16
CONNECT_TIMEOUT_S = 10.0

OnResult = Callable[[int, Union[np.ndarray, ChatTTSError]], None]


def split_sentences(text: str) -> List[str]:
    """Upstream Chat.infer sentence split (newlines first, else after '。' / '. '), blank pieces dropped."""
    # Imported here: chattts_triton.text pulls in torch (through .assets), which a client does not need
    # unless it actually splits text.
    from chattts_triton.text import split_text

    return split_text(text, drop_empty=True)


def _check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return protocol


def _check_url(url: str) -> str:
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


def _voice_reference_needed(sentences: Sequence[str], options: Mapping[str, Any], voice_from_first: bool) -> bool:
    # upstream's condition is `spk_smp is None`; SPEAKER_AUDIO and SPEAKER_SAMPLE both provide it
    return (
        voice_from_first
        and len(sentences) > 1
        and options.get("speaker_audio") is None
        and options.get("speaker_sample") is None
    )


def _with_voice_reference(options: Mapping[str, Any], reference: np.ndarray, reference_text: str) -> Dict[str, Any]:
    # upstream: params_infer_code.spk_smp = sample_audio_speaker(wav[0]); txt_smp = text[0]
    return {**options, "speaker_audio": reference, "speaker_text": reference_text}


def _prepare(text: str, options: Mapping[str, Any], split: bool) -> List[str]:
    check_options(options)
    if not isinstance(text, str):
        raise ChatTTSInputError(f"text must be a str, got {type(text).__name__}")
    sentences = split_sentences(text) if split else [text]
    if not sentences or not any(s.strip() for s in sentences):
        raise ChatTTSInputError("text is empty")
    for sentence in sentences:  # reject bad options before anything is sent
        build_inputs(sentence, options)
    return sentences


def _join(pieces: Sequence[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces).astype(np.float32, copy=False)


# --- transports: one tritonclient call each, errors left raw ------------------------------------
class _GrpcTransport:
    def __init__(self, url: str, model: str, timeout_s: float):
        import tritonclient.grpc as module

        self._module, self._model, self._timeout_s = module, model, timeout_s
        self._client = module.InferenceServerClient(url)  # thread-safe for unary calls

    def infer(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        result = self._client.infer(
            self._model,
            to_infer_inputs(self._module, arrays),
            outputs=requested_outputs(self._module),
            client_timeout=self._timeout_s,
        )
        return audio_from_result(result)

    def is_ready(self) -> bool:
        t = min(self._timeout_s, CONNECT_TIMEOUT_S)
        return self._client.is_server_ready(client_timeout=t) and self._client.is_model_ready(self._model, client_timeout=t)

    def statistics(self, model: str) -> dict:
        return _ints(self._client.get_inference_statistics(model, as_json=True, client_timeout=self._timeout_s))

    def close(self) -> None:
        self._client.close()


class _HttpTransport:
    """tritonclient.http clients are not thread-safe: one per thread."""

    def __init__(self, url: str, model: str, timeout_s: float):
        import tritonclient.http as module

        self._module, self._url, self._model, self._timeout_s = module, url, model, timeout_s
        self._local = threading.local()
        self._clients: List[Any] = []
        self._lock = threading.Lock()

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

    def infer(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        result = self._client().infer(
            self._model, to_infer_inputs(self._module, arrays), outputs=requested_outputs(self._module)
        )
        return audio_from_result(result)

    def is_ready(self) -> bool:
        return self._client().is_server_ready() and self._client().is_model_ready(self._model)

    def statistics(self, model: str) -> dict:
        return self._client().get_inference_statistics(model)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception:  # closing a client whose thread has gone: nothing left to release
                pass


class _AioGrpcTransport:
    def __init__(self, url: str, model: str, timeout_s: float, max_concurrency: int):
        import tritonclient.grpc.aio as aio
        import tritonclient.grpc as module

        self._module, self._model, self._timeout_s = module, model, timeout_s
        self._client = aio.InferenceServerClient(url)

    async def infer(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        result = await self._client.infer(
            self._model,
            to_infer_inputs(self._module, arrays),
            outputs=requested_outputs(self._module),
            client_timeout=self._timeout_s,
        )
        return audio_from_result(result)

    async def is_ready(self) -> bool:
        t = min(self._timeout_s, CONNECT_TIMEOUT_S)
        return await self._client.is_server_ready(client_timeout=t) and await self._client.is_model_ready(
            self._model, client_timeout=t
        )

    async def statistics(self, model: str) -> dict:
        return _ints(await self._client.get_inference_statistics(model, as_json=True, client_timeout=self._timeout_s))

    async def close(self) -> None:
        await self._client.close()


class _AioHttpTransport:
    def __init__(self, url: str, model: str, timeout_s: float, max_concurrency: int):
        import tritonclient.http.aio as aio
        import tritonclient.http as module

        self._module, self._model = module, model
        # conn_timeout is aiohttp's total per-request timeout
        self._client = aio.InferenceServerClient(url, conn_limit=max(100, max_concurrency), conn_timeout=timeout_s)

    async def infer(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        result = await self._client.infer(
            self._model, to_infer_inputs(self._module, arrays), outputs=requested_outputs(self._module)
        )
        return audio_from_result(result)

    async def is_ready(self) -> bool:
        return await self._client.is_server_ready() and await self._client.is_model_ready(self._model)

    async def statistics(self, model: str) -> dict:
        return await self._client.get_inference_statistics(model)

    async def close(self) -> None:
        await self._client.close()


class _ClientBase:
    def __init__(self, url, protocol, model, timeout_s, retries, backoff_s, max_backoff_s, max_concurrency):
        self.protocol = _check_protocol(protocol)
        self.url = _check_url(url if url is not None else DEFAULT_URLS[protocol])
        if not model:
            raise ValueError("model must be a non-empty name")
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
        transport: Any = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        """`url` is HOST:PORT (default localhost:8001 for grpc, :8000 for http). `transport` replaces
        the tritonclient transport (an object with infer(arrays) -> audio), for tests."""
        super().__init__(url, protocol, model, timeout_s, retries, backoff_s, max_backoff_s, max_concurrency)
        if transport is None:
            cls = _GrpcTransport if self.protocol == "grpc" else _HttpTransport
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
        except Exception:
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

    def infer_one(self, text: str, options: Optional[Mapping[str, Any]] = None) -> np.ndarray:
        """One request, one utterance (no sentence splitting), with retries."""
        arrays = build_inputs(text, options)
        return self._call(lambda: self._transport.infer(arrays))

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="chattts")
            return self._pool

    def _infer_many(
        self,
        texts: Sequence[str],
        options: Mapping[str, Any],
        return_exceptions: bool = False,
        on_result: Optional[OnResult] = None,
    ) -> List[Union[np.ndarray, ChatTTSError]]:
        if len(texts) == 1 and on_result is None:
            try:
                return [self.infer_one(texts[0], options)]
            except ChatTTSError as err:
                if return_exceptions:
                    return [err]
                raise
        pool = self._executor()
        futures = {pool.submit(self.infer_one, t, options): i for i, t in enumerate(texts)}
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

    def synthesize(
        self,
        text: str,
        *,
        speaker: Optional[str] = None,
        seed: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        repetition_penalty: Optional[float] = None,
        max_new_tokens: Optional[int] = None,
        min_new_tokens: Optional[int] = None,
        prompt: Optional[str] = None,
        refine_text: Optional[bool] = None,
        refine_prompt: Optional[str] = None,
        refine_temperature: Optional[float] = None,
        refine_top_p: Optional[float] = None,
        refine_top_k: Optional[int] = None,
        refine_repetition_penalty: Optional[float] = None,
        refine_max_new_tokens: Optional[int] = None,
        use_decoder: Optional[bool] = None,
        normalize_text: Optional[bool] = None,
        speaker_audio: Optional[np.ndarray] = None,
        speaker_text: Optional[str] = None,
        speaker_sample: Optional[str] = None,
        split: bool = True,
        voice_from_first: bool = True,
    ) -> np.ndarray:
        """Speech for `text` as float32 mono samples at 24 kHz.

        Keywords are the ensemble's optional inputs (see chattts_triton.config.ENSEMBLE_INPUTS);
        None leaves an input to the server default. `speaker` is an upstream speaker-embedding string;
        a reference voice is either `speaker_audio` (24 kHz mono samples) or `speaker_sample` (upstream
        `sample_audio_speaker` string), with `speaker_text` its transcript.
        `split`: split into sentences like upstream and synthesise them as one concurrent batch.
        `voice_from_first`: like upstream, without `speaker_audio` use the first sentence's audio as
        the voice reference of all sentences (one extra request before the batch).
        """
        options = {k: v for k, v in locals().items() if k in OPTION_INPUTS}
        sentences = _prepare(text, options, split)
        if _voice_reference_needed(sentences, options, voice_from_first):
            reference = self.infer_one(sentences[0], options)
            options = _with_voice_reference(options, reference, sentences[0])
        return _join(self._infer_many(sentences, options))

    def synthesize_batch(
        self,
        texts: Sequence[str],
        *,
        return_exceptions: bool = False,
        on_result: Optional[OnResult] = None,
        **options: Any,
    ) -> List[Union[np.ndarray, ChatTTSError]]:
        """One utterance per text (not split, like upstream `infer(list)`), sent concurrently.

        Takes the same option keywords as `synthesize`. Results are in input order; with
        `return_exceptions` failed items are their ChatTTSError instead of raising the first one.
        `on_result(index, audio_or_error)` is called as each item finishes (e.g. a progress bar).
        """
        check_options(options)
        texts = list(texts)
        for t in texts:
            build_inputs(t, options)
        if not texts:
            return []
        return self._infer_many(texts, options, return_exceptions=return_exceptions, on_result=on_result)

    def stream(self, text: str, **options: Any):
        """Yield AUDIO chunks as they are generated, from the decoupled `chattts_stream` model.

        Not implemented yet: it needs the decoupled model (gRPC bidirectional stream,
        `start_stream` / `async_stream_infer`, same inputs as `synthesize`)."""
        raise NotImplementedError("streaming needs the decoupled 'chattts_stream' model, which is not served yet")


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
        transport: Any = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        super().__init__(url, protocol, model, timeout_s, retries, backoff_s, max_backoff_s, max_concurrency)
        self._transport = transport  # created on first use: aio channels/sessions belong to a running loop
        self._sleep = sleep
        self._semaphore: Optional[asyncio.Semaphore] = None

    def _get_transport(self):
        if self._transport is None:
            cls = _AioGrpcTransport if self.protocol == "grpc" else _AioHttpTransport
            self._transport = cls(self.url, self.model, self.timeout_s, self.max_concurrency)
        return self._transport

    async def close(self) -> None:
        if self._transport is not None:
            await self._transport.close()
            self._transport = None

    async def __aenter__(self) -> "AsyncChatTTSClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def is_ready(self) -> bool:
        try:
            return bool(await self._get_transport().is_ready())
        except Exception:
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

    async def infer_one(self, text: str, options: Optional[Mapping[str, Any]] = None) -> np.ndarray:
        arrays = build_inputs(text, options)
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        async with self._semaphore:
            return await self._call(lambda: self._get_transport().infer(arrays))

    async def _infer_many(self, texts, options, return_exceptions=False, on_result=None):
        async def one(i: int, text: str):
            try:
                result = await self.infer_one(text, options)
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

    async def synthesize(
        self,
        text: str,
        *,
        speaker: Optional[str] = None,
        seed: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        repetition_penalty: Optional[float] = None,
        max_new_tokens: Optional[int] = None,
        min_new_tokens: Optional[int] = None,
        prompt: Optional[str] = None,
        refine_text: Optional[bool] = None,
        refine_prompt: Optional[str] = None,
        refine_temperature: Optional[float] = None,
        refine_top_p: Optional[float] = None,
        refine_top_k: Optional[int] = None,
        refine_repetition_penalty: Optional[float] = None,
        refine_max_new_tokens: Optional[int] = None,
        use_decoder: Optional[bool] = None,
        normalize_text: Optional[bool] = None,
        speaker_audio: Optional[np.ndarray] = None,
        speaker_text: Optional[str] = None,
        speaker_sample: Optional[str] = None,
        split: bool = True,
        voice_from_first: bool = True,
    ) -> np.ndarray:
        """See `ChatTTSClient.synthesize`."""
        options = {k: v for k, v in locals().items() if k in OPTION_INPUTS}
        sentences = _prepare(text, options, split)
        if _voice_reference_needed(sentences, options, voice_from_first):
            reference = await self.infer_one(sentences[0], options)
            options = _with_voice_reference(options, reference, sentences[0])
        return _join(await self._infer_many(sentences, options))

    async def synthesize_batch(
        self,
        texts: Sequence[str],
        *,
        return_exceptions: bool = False,
        on_result: Optional[OnResult] = None,
        **options: Any,
    ) -> List[Union[np.ndarray, ChatTTSError]]:
        """See `ChatTTSClient.synthesize_batch`."""
        check_options(options)
        texts = list(texts)
        for t in texts:
            build_inputs(t, options)
        if not texts:
            return []
        return await self._infer_many(texts, options, return_exceptions, on_result)

    def stream(self, text: str, **options: Any):
        """Async-iterator counterpart of `ChatTTSClient.stream` (not implemented yet)."""
        raise NotImplementedError("streaming needs the decoupled 'chattts_stream' model, which is not served yet")
