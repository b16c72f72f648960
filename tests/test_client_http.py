"""Our HTTP clients ask for answers uncompressed, so concurrent requests are answered concurrently.

Triton's HTTP frontend gzips an infer response whenever the request accepts gzip or deflate, in the thread
that delivers the model's responses: aiohttp (under tritonclient.http.aio) accepts both unless told
otherwise, and the asyncio client then got one answer at a time. Stand-in servers (tests/test_client.py)
record what each request accepted; one answers as Triton does; the e2e test reads the real server's answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import re
import threading
import time

import pytest

from client import AsyncChatTTSClient, ChatTTSClient
from tests.test_client import FakeModel, FakeServers, fake_http_handler

N = 8  # requests in flight at once
COMPRESS_S = 0.25  # the stand-in's time to compress one answer, one answer at a time (as Triton's thread)
COMPRESSING = ("gzip", "deflate", "br")


def accepts_compression(accept_encoding: str | None) -> bool:
    return any(c in (accept_encoding or "").lower() for c in COMPRESSING)


class TritonLikeServers(FakeServers):
    """Stand-ins whose HTTP answers, where the request accepts gzip, are gzipped one at a time, each taking
    COMPRESS_S, as Triton's frontend does; `accepted` holds each infer request's Accept-Encoding (None: absent)."""

    def __init__(self):
        self.accepted: list[str | None] = []
        one_at_a_time = threading.Lock()
        accepted = self.accepted

        def handler(model: FakeModel):
            base = fake_http_handler(model)

            class Handler(base):
                def do_POST(self):
                    accepted.append(self.headers.get("Accept-Encoding"))
                    super().do_POST()

                def _reply(self, code: int, body: bytes, headers=()):
                    if code == 200 and "gzip" in (self.headers.get("Accept-Encoding") or ""):
                        with one_at_a_time:
                            time.sleep(COMPRESS_S)
                            body = gzip.compress(body)
                        headers = [*headers, ("Content-Encoding", "gzip")]
                    super()._reply(code, body, headers)

            return Handler

        super().__init__(http_handler=handler)
        # socketserver listens with a backlog of 5: N connections opened at once would lose SYNs to a 1 s retry
        self.http.socket.listen(64)


@pytest.fixture(scope="module")
def triton_like():
    s = TritonLikeServers()
    yield s
    s.stop()


@pytest.fixture
def stand_in(triton_like):
    triton_like.model.reset()
    triton_like.accepted.clear()
    return triton_like


def test_asyncio_http_requests_accept_no_compression_and_are_answered_together(stand_in):
    async def main():
        async with AsyncChatTTSClient(stand_in.http_url, protocol="http", retries=0, max_concurrency=N) as c:
            await c.infer_one("warm the connection")
            stand_in.accepted.clear()
            t0 = time.monotonic()
            audio = await asyncio.gather(*(c.infer_one(f"sentence {i}") for i in range(N)))
            return audio, time.monotonic() - t0

    audio, elapsed = asyncio.run(main())
    assert [a.size for a in audio] == [FakeModel.audio_for(f"sentence {i}".encode()).size for i in range(N)]
    assert len(stand_in.accepted) == N and not any(map(accepts_compression, stand_in.accepted)), stand_in.accepted
    # answered one at a time they would take N * COMPRESS_S
    assert elapsed < N * COMPRESS_S / 2


def test_sync_http_requests_accept_no_compression(stand_in):
    with ChatTTSClient(stand_in.http_url, protocol="http", retries=0, max_concurrency=N) as c:
        with concurrent.futures.ThreadPoolExecutor(N) as pool:
            audio = list(pool.map(lambda i: c.infer_one(f"sentence {i}"), range(N)))
    assert all(a.size for a in audio)
    assert len(stand_in.accepted) == N and not any(map(accepts_compression, stand_in.accepted)), stand_in.accepted


def test_the_stand_in_serialises_clients_that_accept_gzip(stand_in):
    """The control: tritonclient.http.aio as it comes accepts gzip, and the stand-in then answers one at a time."""
    import tritonclient.http as http
    import tritonclient.http.aio as aio

    from client.contract import build_inputs, requested_outputs, to_infer_inputs

    async def main():
        raw = aio.InferenceServerClient(stand_in.http_url)
        try:
            t0 = time.monotonic()
            await asyncio.gather(*(raw.infer("chattts", to_infer_inputs(http, build_inputs(f"s {i}")),
                                             outputs=requested_outputs(http)) for i in range(N)))
            return time.monotonic() - t0
        finally:
            await raw.close()

    assert asyncio.run(main()) >= N * COMPRESS_S
    assert all(map(accepts_compression, stand_in.accepted))


# --- the real server -----------------------------------------------------------------------------
_CONTENT_ENCODING = re.compile(rb"\r\ncontent-encoding:[ \t]*([^\r\n]*)", re.IGNORECASE)
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] 200 ")


class RecordingProxy:
    """Forwards TCP connections to `upstream` and keeps the bytes the server sent back (all connections)."""

    def __init__(self, upstream: str):
        self.host, port = upstream.rsplit(":", 1)
        self.port = int(port)
        self.replies = bytearray()
        self._server = None

    async def __aenter__(self) -> RecordingProxy:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _connection(self, client_r, client_w) -> None:
        server_r, server_w = await asyncio.open_connection(self.host, self.port)

        async def pump(r, w, record: bool):
            try:
                while data := await r.read(65536):
                    if record:
                        self.replies += data
                    w.write(data)
                    await w.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                w.close()

        await asyncio.gather(pump(client_r, server_w, False), pump(server_r, client_w, True))

    def answers(self) -> int:
        return len(_STATUS_LINE.findall(self.replies))

    def encodings(self) -> list[bytes]:
        return [m.strip().lower() for m in _CONTENT_ENCODING.findall(self.replies)]


@pytest.mark.e2e
def test_the_real_server_answers_the_asyncio_client_uncompressed(served_tiny):
    """The server compresses for a client that accepts it (the control), and not for ours."""
    import tritonclient.http as http
    import tritonclient.http.aio as aio

    from client.contract import build_inputs, requested_outputs, to_infer_inputs

    fixed = {"max_new_tokens": 20, "min_new_tokens": 20, "seed": 1}

    async def main():
        async with RecordingProxy(served_tiny.http_url) as proxy:
            raw = aio.InferenceServerClient(proxy.url)
            try:
                await raw.infer("chattts", to_infer_inputs(http, build_inputs("Hello.", fixed)),
                                outputs=requested_outputs(http))
            finally:
                await raw.close()
            control = (proxy.answers(), proxy.encodings())
            proxy.replies.clear()
            async with AsyncChatTTSClient(proxy.url, protocol="http", retries=0, max_concurrency=4) as c:
                audio = await asyncio.gather(*(c.infer_one(f"Hello number {i}.", fixed) for i in range(4)))
            return control, (proxy.answers(), proxy.encodings()), audio

    control, ours, audio = asyncio.run(main())
    assert control[0] == 1 and control[1] and control[1][0] in (b"gzip", b"deflate"), control
    assert all(a.size for a in audio)
    assert ours[0] == 4 and ours[1] in ([], [b"identity"] * 4), ours
