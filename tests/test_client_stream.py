"""`stream()`: the client of the decoupled `chattts_stream` model, its CLI and the streaming WAV writer.

Unit tests run against an in-memory transport (chunk assembly, final detection, errors, retries, cancel
on early exit, timeouts) and against in-process fake servers that speak the real protocols (gRPC
ModelStreamInfer; HTTP generate_stream server-sent events as Triton 2.51 sends them: the error code is
lost, an error as first response is HTTP 400), so the real sessions run. Tests marked e2e run against
a real tritonserver on the tiny-weight repository (`served_tiny`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import wave
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from chattts_triton import config as C
from chattts_triton.triton.backend import STATS_PERIOD_S
from client import (
    AsyncChatTTSClient,
    BalancedChatTTSClient,
    ChatTTSClient,
    ChatTTSError,
    ChatTTSInputError,
    cli,
    read_wav,
)
from client.audio import WavStreamWriter, save_wav
from client.client import SSEParser, split_sentences
from client.contract import STREAM_MODEL, build_inputs, input_datatype, to_json_inputs
from client.errors import stream_error_status
from tests.test_client import (
    OPTIONAL,
    AsyncSleeps,
    FakeModel,
    FakeServers,
    GrpcServicer,
    Sleeps,
    decode_tensor,
    fake_http_handler,
    free_port,
    sample_value,
)

ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = pytest.mark.parametrize("protocol", ["grpc", "http"])
CHUNK = 64  # samples per chunk of the fake servers
# How the server words each status: Triton 2.51 sends a stream's error as a message only.
STREAM_MESSAGES = {"UNAVAILABLE": "server busy: 2 streams in flight, retry later",
                   "INTERNAL": "internal error: scripted"}


def unavailable(msg="busy, retry later"):
    return InferenceServerException(msg, status="StatusCode.UNAVAILABLE")


# --- an in-memory transport -----------------------------------------------------------------------
class FakeSession:
    def __init__(self, transport, model, timeout_s):
        self.transport, self.model, self.timeout_s = transport, model, timeout_s
        self.arrays, self.items, self.closed, self.received = None, [], None, 0

    def send(self, arrays):
        self.arrays = arrays
        plan = self.transport.plans.pop(0) if self.transport.plans else None
        if isinstance(plan, BaseException):
            raise plan
        self.items = list(plan) if plan is not None else default_items(arrays["TEXT"][0, 0])

    def receive(self):
        self.received += 1
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, cancel):
        assert self.closed is None, "closed twice"
        self.closed = "cancel" if cancel else "done"


def default_items(text: bytes, chunk: int = CHUNK):
    audio = FakeModel.audio_for(text)
    items = [(audio[i : i + chunk], False) for i in range(0, audio.size, chunk)]
    return items + [(np.zeros(0, np.float32), True), RuntimeError("read past the final response")]


class FakeStreamTransport:
    """open_stream() -> a FakeSession; `plans` (one per request, in order): a list of (chunk, final)
    and exceptions to return / raise, or an exception for send(); the default streams audio_for(TEXT)."""

    def __init__(self, plans=()):
        self.plans = list(plans)
        self.sessions = []

    def open_stream(self, model, chunk_timeout_s):
        self.sessions.append(FakeSession(self, model, chunk_timeout_s))
        return self.sessions[-1]

    def is_ready(self):
        return True

    def close(self):
        pass


class AsyncFakeStreamTransport(FakeStreamTransport):
    def open_stream(self, model, chunk_timeout_s):
        session = super().open_stream(model, chunk_timeout_s)
        sync_send, sync_receive = session.send, session.receive

        async def send(arrays):
            sync_send(arrays)

        async def receive():
            await asyncio.sleep(0)
            item = session.items[0] if session.items else None
            if item == "hang":
                await asyncio.sleep(3600)
            return sync_receive()

        session.send, session.receive = send, receive
        return session

    async def close(self):
        pass


def chunks(n, size=10, final_size=0):
    return [(np.full(size, i, np.float32), False) for i in range(n)] + [(np.ones(final_size, np.float32), True)]


# --- the API --------------------------------------------------------------------------------------
def test_stream_takes_the_keywords_of_synthesize_plus_a_chunk_timeout():
    for cls in (ChatTTSClient, AsyncChatTTSClient):
        def keywords(method):
            return {k for k, p in inspect.signature(method).parameters.items() if p.kind is p.KEYWORD_ONLY}

        assert keywords(cls.stream) == keywords(cls.synthesize) | {"chunk_timeout_s"}, cls
        assert {n.lower() for n in OPTIONAL} <= keywords(cls.stream)


def test_bad_arguments_fail_when_stream_is_called_before_anything_is_sent():
    t = FakeStreamTransport()
    c = ChatTTSClient("x:1", transport=t)
    with pytest.raises(ChatTTSInputError):
        c.stream("  ")
    with pytest.raises(ChatTTSInputError):
        c.stream("hi", seed="7")
    with pytest.raises(TypeError):
        c.stream("hi", sead=7)
    with pytest.raises(ValueError, match="chunk_timeout_s"):
        c.stream("hi", chunk_timeout_s=0)
    with pytest.raises(ChatTTSInputError):
        AsyncChatTTSClient("x:1", transport=AsyncFakeStreamTransport()).stream("")
    assert t.sessions == []


# --- chunks, final, errors, retries, cancel: in-memory transport -----------------------------------
def test_chunks_arrive_in_order_until_the_final_response():
    t = FakeStreamTransport()
    c = ChatTTSClient("x:1", transport=t, timeout_s=42)
    out = list(c.stream("Hello", seed=3, top_p=0.5, split=False))
    (s,) = t.sessions
    assert s.model == STREAM_MODEL and s.timeout_s == 42 and s.closed == "done"
    assert s.items == [s.items[0]] and isinstance(s.items[0], RuntimeError)  # nothing read past final
    assert {k: v.tolist() for k, v in s.arrays.items()} == {
        k: v.tolist() for k, v in build_inputs("Hello", {"seed": 3, "top_p": 0.5}).items()
    }
    assert all(x.size == CHUNK for x in out[:-1]) and all(x.size for x in out)  # the 0-sample final is not yielded
    assert np.array_equal(np.concatenate(out), FakeModel.audio_for(b"Hello"))


def test_a_final_chunk_with_samples_is_yielded_and_the_model_and_timeout_are_configurable():
    t = FakeStreamTransport([chunks(2, final_size=5)])
    c = ChatTTSClient("x:1", transport=t, stream_model="other")
    out = list(c.stream("hi", split=False, chunk_timeout_s=1.5))
    assert [x.size for x in out] == [10, 10, 5] and out[2][0] == 1
    assert t.sessions[0].model == "other" and t.sessions[0].timeout_s == 1.5


def test_error_mid_stream_raises_from_the_iterator_and_is_not_retried():
    mid = chunks(2)[:2] + [unavailable("server busy: 2 streams in flight, retry later")]
    t = FakeStreamTransport([mid])
    c = ChatTTSClient("x:1", transport=t, retries=5, sleep=Sleeps())
    it = c.stream("hi", split=False)
    assert next(it)[0] == 0 and next(it)[0] == 1
    with pytest.raises(ChatTTSError) as e:
        next(it)
    assert e.value.status == "UNAVAILABLE" and "retry later" in e.value.message and "chattts_stream" in e.value.message
    assert len(t.sessions) == 1 and t.sessions[0].closed == "cancel"


def test_unavailable_before_the_first_chunk_is_retried_with_backoff():
    t = FakeStreamTransport([[unavailable()], unavailable(), None])
    sleeps = Sleeps()
    out = list(ChatTTSClient("x:1", transport=t, retries=3, backoff_s=0.1, sleep=sleeps).stream("hi", split=False))
    assert np.array_equal(np.concatenate(out), FakeModel.audio_for(b"hi")) and sleeps == [0.1, 0.2]
    assert [s.closed for s in t.sessions] == ["cancel", "cancel", "done"]

    t = FakeStreamTransport([[unavailable()]] * 3)
    with pytest.raises(ChatTTSError, match="gave up after 2 attempt"):
        list(ChatTTSClient("x:1", transport=t, retries=1, sleep=Sleeps()).stream("hi", split=False))


def test_other_errors_are_raised_at_once_with_the_server_message():
    for error, status in [(InferenceServerException("text is too long", status="INVALID_ARGUMENT"), "INVALID_ARGUMENT"),
                          (TimeoutError("no audio chunk within 2 s"), "DEADLINE_EXCEEDED"),
                          (ChatTTSError("INTERNAL", "boom"), "INTERNAL")]:  # fmt: skip
        t = FakeStreamTransport([[error]])
        sleeps = Sleeps()
        with pytest.raises(ChatTTSError) as e:
            list(ChatTTSClient("x:1", transport=t, retries=3, sleep=sleeps).stream("hi", split=False))
        assert e.value.status == status and str(error.args[0] if error.args else error) in str(e.value)
        assert len(t.sessions) == 1 and sleeps == [] and t.sessions[0].closed == "cancel"


def test_breaking_out_early_cancels_the_request():
    t = FakeStreamTransport([chunks(5)])
    for _ in ChatTTSClient("x:1", transport=t).stream("hi", split=False):
        break
    assert t.sessions[0].closed == "cancel" and t.sessions[0].received == 1

    t = FakeStreamTransport([chunks(5)])
    it = ChatTTSClient("x:1", transport=t).stream("hi", split=False)
    next(it)
    it.close()
    assert t.sessions[0].closed == "cancel"
    assert ChatTTSClient("x:1", transport=t).stream("hi") is not None and len(t.sessions) == 1  # lazy


LONG_TEXT = "The first sentence is long enough to stand alone. The second one is here as well. 第三句话也足够长了。"


def test_sentences_are_streamed_one_after_another_with_the_first_as_voice_reference():
    sentences = split_sentences(LONG_TEXT)
    assert len(sentences) == 3
    t = FakeStreamTransport()
    out = list(ChatTTSClient("x:1", transport=t).stream(LONG_TEXT, seed=1))
    assert [s.arrays["TEXT"][0, 0] for s in t.sessions] == [s.encode() for s in sentences]
    first = FakeModel.audio_for(sentences[0].encode())
    assert "SPEAKER_AUDIO" not in t.sessions[0].arrays
    for s in t.sessions[1:]:  # upstream spk_smp / txt_smp from sentence 1, as synthesize()
        assert np.array_equal(s.arrays["SPEAKER_AUDIO"][0], first)
        assert s.arrays["SPEAKER_TEXT"][0, 0] == sentences[0].encode() and s.arrays["SEED"][0, 0] == 1
    expected = np.concatenate([FakeModel.audio_for(s.encode()) for s in sentences])
    assert np.array_equal(np.concatenate(out), expected)

    for kwargs in ({"voice_from_first": False}, {"speaker_audio": np.ones(8, np.float32)}):
        t = FakeStreamTransport()
        list(ChatTTSClient("x:1", transport=t).stream(LONG_TEXT, **kwargs))
        assert len(t.sessions) == 3
        assert all(s.arrays.get("SPEAKER_AUDIO", np.ones((1, 8))).shape == (1, 8) for s in t.sessions)
    t = FakeStreamTransport()
    list(ChatTTSClient("x:1", transport=t).stream(LONG_TEXT, split=False))
    assert len(t.sessions) == 1


def test_an_error_in_a_later_sentence_stops_the_stream():
    t = FakeStreamTransport([None, [ChatTTSError("INVALID_ARGUMENT", "bad sentence")]])
    got = []
    with pytest.raises(ChatTTSError, match="bad sentence"):
        for x in ChatTTSClient("x:1", transport=t, sleep=Sleeps()).stream(LONG_TEXT, voice_from_first=False):
            got.append(x)
    first = FakeModel.audio_for(split_sentences(LONG_TEXT)[0].encode())
    assert len(t.sessions) == 2 and np.array_equal(np.concatenate(got), first)


def test_balanced_stream_fails_over_before_audio_only():
    down, up = FakeStreamTransport([unavailable()]), FakeStreamTransport()
    c = BalancedChatTTSClient(["a:1", "b:1"], transports=[down, up], sleep=Sleeps())
    out = list(c.stream("hi", split=False))
    assert np.array_equal(np.concatenate(out), FakeModel.audio_for(b"hi"))
    assert len(down.sessions) == 1 and down.sessions[0].closed == "cancel" and up.sessions[0].closed == "done"
    stats = {s["url"]: s for s in c.endpoint_stats()}
    assert not stats["a:1"]["up"] and stats["b:1"]["served"] == 1 and stats["b:1"]["outstanding"] == 0
    c.wait_for_probes(1.0)

    a, b = FakeStreamTransport([chunks(1)[:1] + [unavailable()]]), FakeStreamTransport()
    c = BalancedChatTTSClient(["a:1", "b:1"], transports=[a, b], sleep=Sleeps())
    with pytest.raises(ChatTTSError, match="a:1"):  # audio was yielded: never re-sent
        list(c.stream("hi", split=False))
    assert b.sessions == [] and all(s["outstanding"] == 0 for s in c.endpoint_stats())


def test_async_stream_with_an_in_memory_transport():
    async def main():
        t = AsyncFakeStreamTransport([None, chunks(1)[:1] + [ChatTTSError("INTERNAL", "broke")], chunks(3) + ["hang"],
                                      chunks(3), [unavailable()], chunks(2)])  # fmt: skip
        sleeps = AsyncSleeps()
        async with AsyncChatTTSClient("x:1", transport=t, backoff_s=0.5, sleep=sleeps) as c:
            whole = [x async for x in c.stream("Hello", split=False)]
            with pytest.raises(ChatTTSError, match="broke"):
                async for _ in c.stream("hi", split=False):
                    pass
            async with contextlib.aclosing(c.stream("hi", split=False)) as it:
                async for _ in it:
                    break
            cancelled_at_once = t.sessions[2].closed
            it = c.stream("hi", split=False)
            async for _ in it:
                break
            del it
            gc.collect()
            for _ in range(5):  # asyncio closes an abandoned async generator on a later loop turn
                await asyncio.sleep(0)
            retried = [x async for x in c.stream("hi", split=False)]
        return t, whole, cancelled_at_once, retried, sleeps

    t, whole, cancelled_at_once, retried, sleeps = asyncio.run(main())
    assert np.array_equal(np.concatenate(whole), FakeModel.audio_for(b"Hello"))
    assert [s.closed for s in t.sessions] == ["done", "cancel", "cancel", "cancel", "cancel", "done"]
    assert cancelled_at_once == "cancel" and len(retried) == 2 and sleeps == [0.5]


def test_async_task_cancel_cancels_the_request():
    async def main():
        t = AsyncFakeStreamTransport([chunks(1)[:1] + ["hang"]])
        c = AsyncChatTTSClient("x:1", transport=t)

        async def consume():
            async for _ in c.stream("hi", split=False):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return t

    assert asyncio.run(main()).sessions[0].closed == "cancel"


# --- pieces ---------------------------------------------------------------------------------------
def test_sse_parser_handles_any_split_crlf_comments_and_a_last_event_without_blank_line():
    body = b': hello\r\ndata: {"a": 1}\r\n\r\ndata:{"b":\ndata: 2}\n\nevent: x\ndata: {"c": 3}'
    for step in (1, 2, 3, 7, len(body)):
        p, events = SSEParser(), []
        for i in range(0, len(body), step):
            events += p.feed(body[i : i + step])
        events += p.close()
        assert [json.loads(e) for e in events] == [{"a": 1}, {"b": 2}, {"c": 3}], step
    long = b"data: " + json.dumps({"AUDIO": list(range(100000))}).encode() + b"\n\n"
    p = SSEParser()
    events = [e for i in range(0, len(long), 997) for e in p.feed(long[i : i + 997])]
    assert len(events) == 1 and len(json.loads(events[0])["AUDIO"]) == 100000


def test_json_body_of_generate_stream_has_every_input_as_scalar_or_list():
    options = {n.lower(): sample_value(n) for n in OPTIONAL}
    body = json.loads(json.dumps(to_json_inputs(build_inputs("你好", options))))
    assert body["TEXT"] == "你好" and set(body) == {"TEXT", *OPTIONAL}
    for name in OPTIONAL:
        value, datatype = body[name], input_datatype(name)
        if list(C.ENSEMBLE_INPUTS[name][1]) == [-1]:
            assert np.array_equal(np.asarray(value, np.float32), sample_value(name))
        elif datatype == "BYTES":
            assert value == "abc"
        elif datatype == "BOOL":
            assert value is True
        elif datatype.startswith("INT"):
            assert value == 7 and isinstance(value, int)
        else:
            assert value == 0.25
    x = np.float32(0.1)  # float32 values survive the JSON round trip exactly
    sent = json.loads(json.dumps(to_json_inputs(build_inputs("a", {"temperature": x}))))
    assert np.float32(sent["TEMPERATURE"]) == x


def test_stream_error_status_from_the_message():
    assert stream_error_status("server busy: 4 streams in flight, retry later") == "UNAVAILABLE"
    assert stream_error_status("server is shutting down, retry on another instance") == "UNAVAILABLE"
    assert stream_error_status("Exceeds maximum queue size") == "UNAVAILABLE"
    assert stream_error_status("Request for unknown model: 'x' is not found") == "NOT_FOUND"
    assert stream_error_status("internal error: CUDA out of memory") == "INTERNAL"
    assert stream_error_status("request cancelled") == "CANCELLED"
    assert stream_error_status("DEADLINE_EXCEEDED: too slow") == "DEADLINE_EXCEEDED"
    assert stream_error_status("[INTERNAL] x") == "INTERNAL"
    assert stream_error_status("TEXT is longer than 500 characters") == "INVALID_ARGUMENT"


def test_wav_stream_writer_equals_save_wav_and_is_removed_on_failure(tmp_path):
    audio = np.random.default_rng(1).uniform(-1.1, 1.1, 1001).astype(np.float32)
    for fmt in ("pcm16", "float32"):
        path = tmp_path / f"s-{fmt}.wav"
        with WavStreamWriter(path, fmt=fmt) as w:
            w.write(audio[:10])
            head = path.read_bytes()
            assert head[:4] == b"RIFF" and struct.unpack("<I", head[4:8])[0] == 0xFFFFFFFF  # unknown size yet
            w.write(audio[10:10])
            w.write(audio[10:])
            assert w.samples == audio.size
        assert path.read_bytes() == save_wav(tmp_path / f"w-{fmt}.wav", audio, fmt=fmt).read_bytes()
    with wave.open(str(tmp_path / "s-pcm16.wav")) as r:
        assert (r.getnchannels(), r.getframerate(), r.getnframes()) == (1, C.SAMPLE_RATE, audio.size)
    with pytest.raises(RuntimeError):
        with WavStreamWriter(tmp_path / "x.wav") as w:
            w.write(audio)
            raise RuntimeError("stream failed")
    assert not (tmp_path / "x.wav").exists()
    with pytest.raises(ValueError):
        WavStreamWriter(tmp_path / "y.wav", fmt="mp3")
    assert not (tmp_path / "y.wav").exists()
    with WavStreamWriter(tmp_path / "empty.wav") as w:
        pass
    assert read_wav(tmp_path / "empty.wav")[0].size == 0


# --- fake servers speaking the real protocols -----------------------------------------------------
class FakeStreamModel(FakeModel):
    """FakeModel's audio in CHUNK-sample chunks. TEXT markers: MIDFAIL (one chunk, then an error),
    HANG (one chunk, then wait for the client to cancel), STALL (one chunk, then 2 s of silence),
    EMPTYFINAL (the final response carries no samples)."""

    def reset(self):
        super().reset()
        with self.lock:
            self.cancelled, self.params, self.bodies = [], [], []
        self.cancel_event = threading.Event()

    def plan(self, inputs, datatypes):
        result = self.handle(inputs, datatypes)
        if isinstance(result, tuple):
            return [("error", STREAM_MESSAGES.get(result[0], result[1]))]
        text = inputs["TEXT"][0, 0]
        pieces = [result[i : i + CHUNK] for i in range(0, result.size, CHUNK)]
        for marker, then in ((b"MIDFAIL", ("error", "internal error: decoder failed")), (b"HANG", ("hang",)),
                             (b"STALL", ("stall", 2.0))):  # fmt: skip
            if marker in text:
                return [("chunk", pieces[0], False), then]
        steps = [("chunk", p, False) for p in pieces]
        if b"EMPTYFINAL" in text:
            return steps + [("chunk", np.zeros(0, np.float32), True)]
        return steps[:-1] + [("chunk", pieces[-1], True)]

    def was_cancelled(self, text: bytes):
        with self.lock:
            self.cancelled.append(text)
        self.cancel_event.set()


class _StreamServicer(GrpcServicer):
    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name in ("chattts", STREAM_MODEL))

    def ModelStreamInfer(self, request_iterator, context):
        for request in request_iterator:
            if request.model_name != STREAM_MODEL:
                yield service_pb2.ModelStreamInferResponse(
                    error_message=f"Request for unknown model: '{request.model_name}' is not found")
                continue
            inputs = {t.name: decode_tensor(t.datatype, list(t.shape), raw)
                      for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)}  # fmt: skip
            empty_final = request.parameters["triton_enable_empty_final_response"].bool_param
            with self.model.lock:
                self.model.params.append(empty_final)
            steps = self.model.plan(inputs, {t.name: t.datatype for t in request.inputs})
            if any(step[0] == "hang" for step in steps):
                # gRPC may drop the response generator without resuming it once the client cancels
                # (a write that fails is not retried): the RPC's termination callback sees every cancel
                hang = {"timed_out": False}
                text = inputs["TEXT"][0, 0]
                context.add_callback(lambda hang=hang, text=text: hang["timed_out"] or self.model.was_cancelled(text))
            for step in steps:
                if step[0] == "error":
                    yield service_pb2.ModelStreamInferResponse(error_message=step[1])
                    break
                if step[0] == "hang":
                    deadline = time.monotonic() + 10
                    while context.is_active() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    hang["timed_out"] = context.is_active()
                    return
                if step[0] == "stall":
                    time.sleep(step[1])
                    return
                _, audio, final = step
                response = service_pb2.ModelInferResponse(model_name=STREAM_MODEL, id=request.id)
                if not (final and audio.size == 0 and empty_final):  # Triton's empty final: no outputs
                    response.outputs.add(name="AUDIO", datatype="FP32", shape=[1, audio.size])
                    response.raw_output_contents.append(audio.astype("<f4").tobytes())
                response.parameters["triton_final_response"].bool_param = final
                yield service_pb2.ModelStreamInferResponse(infer_response=response)


def _json_input(name, value):
    datatype = input_datatype(name)
    if list(C.ENSEMBLE_INPUTS[name][1]) == [-1]:
        return np.asarray([value], np.float32)
    if datatype == "BYTES":
        return np.array([[value.encode()]], dtype=object)
    return np.array([[value]])


def _stream_http_handler(model: FakeStreamModel):
    class Handler(fake_http_handler(model)):
        def do_GET(self):
            if self.path == f"/v2/models/{STREAM_MODEL}/ready":
                return self._reply(200, b"")
            return super().do_GET()

        def _chunk(self, data: bytes):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _event(self, obj):
            self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def do_POST(self):
            if not self.path.endswith("/generate_stream"):
                return super().do_POST()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != f"/v2/models/{STREAM_MODEL}/generate_stream":
                msg = json.dumps({"error": f"Request for unknown model: '{self.path.split('/')[3]}' is not found"})
                return self._reply(404, msg.encode(), [("Content-Type", "application/json")])
            with model.lock:
                model.bodies.append(body)
            inputs = {k: _json_input(k, v) for k, v in body.items()}
            steps = model.plan(inputs, {k: input_datatype(k) for k in inputs})
            self.send_response(400 if steps[0][0] == "error" else 200)  # as Triton 2.51: 400 whatever the code
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for step in steps:
                if step[0] == "error":
                    self._event({"error": step[1]})
                    break
                if step[0] == "hang":  # writes fail once the client has hung up
                    try:
                        for _ in range(500):
                            time.sleep(0.02)
                            self._chunk(b": ping\n\n")
                    except OSError:
                        model.was_cancelled(inputs["TEXT"][0, 0])
                    self.close_connection = True
                    return
                if step[0] == "stall":
                    time.sleep(step[1])
                    self.close_connection = True
                    return
                self._event({"AUDIO": step[1].tolist(), "model_name": STREAM_MODEL, "model_version": "1"})
            self._chunk(b"")

    return Handler


class FakeStreamServers(FakeServers):
    def __init__(self):
        super().__init__(FakeStreamModel(), _StreamServicer, _stream_http_handler)


@pytest.fixture(scope="module")
def servers():
    s = FakeStreamServers()
    yield s
    s.stop()


@pytest.fixture
def fake(servers):
    servers.model.reset()
    return servers


# --- the real sessions on the wire ------------------------------------------------------------------
@PROTOCOLS
def test_stream_on_the_wire_equals_the_unary_audio(fake, protocol):
    ref = np.linspace(-0.5, 0.5, 40, dtype=np.float32)
    options = dict(seed=7, temperature=0.3, refine_text=False, top_k=5, speaker_audio=ref, speaker_text="参考")
    with ChatTTSClient(fake.url(protocol), protocol=protocol) as c:
        out = list(c.stream("Hello 你好", split=False, **options))
        again = list(c.stream("Hello EMPTYFINAL", split=False))  # the connection / channel is reused
        unary = c.synthesize("Hello 你好", split=False, **options)
    assert len(out) > 2 and all(x.dtype == np.float32 and x.ndim == 1 for x in out)
    assert np.array_equal(np.concatenate(out), unary)
    assert np.array_equal(np.concatenate(again), FakeModel.audio_for(b"Hello EMPTYFINAL"))
    sent = fake.model.requests[0]
    assert {k: v.tolist() for k, v in sent.items()} == {
        k: v.tolist() for k, v in build_inputs("Hello 你好", options).items()
    }
    if protocol == "grpc":
        assert fake.model.params == [True, True]  # enable_empty_final_response
    else:
        assert fake.model.bodies[0] == json.loads(json.dumps(to_json_inputs(build_inputs("Hello 你好", options))))


@PROTOCOLS
def test_wire_errors_map_to_statuses_and_unavailable_is_retried(fake, protocol):
    sleeps = Sleeps()
    with ChatTTSClient(fake.url(protocol), protocol=protocol, retries=2, backoff_s=0.25, sleep=sleeps) as c:
        with pytest.raises(ChatTTSError) as bad:
            list(c.stream("BAD text", split=False))
        fake.model.script = ["UNAVAILABLE"]
        retried = list(c.stream("hi", split=False))
        got = []
        with pytest.raises(ChatTTSError) as mid:
            for x in c.stream("MIDFAIL", split=False):
                got.append(x)
    assert bad.value.status == "INVALID_ARGUMENT" and "text contains BAD" in bad.value.message
    assert np.array_equal(np.concatenate(retried), FakeModel.audio_for(b"hi")) and sleeps == [0.25]
    assert mid.value.status == "INTERNAL" and "decoder failed" in mid.value.message and len(got) == 1
    assert len(fake.model.requests) == 4  # BAD once, hi twice, MIDFAIL once (not re-sent after audio)
    with ChatTTSClient(fake.url(protocol), protocol=protocol, stream_model="nope", retries=0) as c:
        with pytest.raises(ChatTTSError) as e:
            list(c.stream("hi", split=False))
    assert e.value.status == "NOT_FOUND" and "nope" in e.value.message


@PROTOCOLS
def test_breaking_out_early_cancels_on_the_server(fake, protocol):
    with ChatTTSClient(fake.url(protocol), protocol=protocol) as c:
        t0 = time.monotonic()
        for _ in c.stream("HANG on", split=False):
            break
        assert time.monotonic() - t0 < 3
        assert fake.model.cancel_event.wait(5) and fake.model.cancelled == [b"HANG on"]
        assert len(list(c.stream("still usable", split=False))) > 1


@PROTOCOLS
def test_chunk_timeout_is_deadline_exceeded_not_a_hang(fake, protocol):
    with ChatTTSClient(fake.url(protocol), protocol=protocol, retries=3, sleep=Sleeps()) as c:
        t0 = time.monotonic()
        got = []
        with pytest.raises(ChatTTSError) as e:
            for x in c.stream("STALL", split=False, chunk_timeout_s=0.3):
                got.append(x)
    assert e.value.status == "DEADLINE_EXCEEDED" and "no audio chunk within 0.3 s" in e.value.message
    assert len(got) == 1 and time.monotonic() - t0 < 1.9 and len(fake.model.requests) == 1


@PROTOCOLS
def test_unreachable_server_is_unavailable_after_retries(protocol):
    sleeps = Sleeps()
    with ChatTTSClient(f"127.0.0.1:{free_port()}", protocol=protocol, retries=1, sleep=sleeps) as c:
        with pytest.raises(ChatTTSError) as e:
            list(c.stream("hi", split=False, chunk_timeout_s=5))
    assert e.value.status == "UNAVAILABLE" and "gave up after 2" in e.value.message and len(sleeps) == 1


@PROTOCOLS
def test_async_stream_on_the_wire(fake, protocol):
    async def main():
        async with AsyncChatTTSClient(fake.url(protocol), protocol=protocol, retries=0) as c:
            out = [x async for x in c.stream("Hello", seed=1, split=False)]
            with pytest.raises(ChatTTSError) as mid:
                async for _ in c.stream("MIDFAIL", split=False):
                    pass
            with pytest.raises(ChatTTSError) as slow:
                async for _ in c.stream("STALL", split=False, chunk_timeout_s=0.3):
                    pass
            async with contextlib.aclosing(c.stream("HANG", split=False)) as chunks:
                async for _ in chunks:
                    break
            cancelled = await asyncio.get_running_loop().run_in_executor(None, fake.model.cancel_event.wait, 5)
            return out, mid.value, slow.value, cancelled

    out, mid, slow, cancelled = asyncio.run(main())
    assert len(out) > 2 and np.array_equal(np.concatenate(out), FakeModel.audio_for(b"Hello"))
    assert mid.status == "INTERNAL" and slow.status == "DEADLINE_EXCEEDED" and cancelled


# --- command line ------------------------------------------------------------------------------------
@PROTOCOLS
@pytest.mark.parametrize("fmt", ["pcm16", "float32"])
def test_cli_stream_writes_the_wav_the_non_stream_cli_writes(fake, protocol, fmt, tmp_path, capsys):
    common = ["--url", fake.url(protocol), "--protocol", protocol, "--format", fmt, "--seed", "3"]
    assert cli.main(["Hello there", "-o", str(tmp_path / "a.wav"), "-q", *common]) == 0
    assert cli.main(["Hello there", "-o", str(tmp_path / "s.wav"), "--stream", *common]) == 0
    assert (tmp_path / "s.wav").read_bytes() == (tmp_path / "a.wav").read_bytes()
    assert "first chunk after" in capsys.readouterr().out


def test_cli_stream_failure_deletes_the_partial_wav(fake, tmp_path, capsys):
    out = tmp_path / "x.wav"
    rc = cli.main(["MIDFAIL", "-o", str(out), "--stream", "--url", fake.grpc_url, "--no-split"])
    assert rc == 1 and "[INTERNAL]" in capsys.readouterr().err and not out.exists()
    rc = cli.main(["STALL", "-o", str(out), "--stream", "--url", fake.http_url, "--protocol", "http", "--no-split",
                   "--chunk-timeout", "0.3"])  # fmt: skip
    assert rc == 1 and "DEADLINE_EXCEEDED" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--file", "t.txt", "--out-dir", "d", "--stream"], "--stream goes with TEXT"),
        (["hi", "-o", "a.wav", "--chunk-timeout", "5"], "--chunk-timeout"),
        (["hi", "-o", "a.wav", "--stream", "--chunk-timeout", "0"], "--chunk-timeout"),
    ],
)
def test_cli_stream_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# --- end to end: the real chattts_stream model -------------------------------------------------------
E2E_TEXT = "Streaming speech arrives chunk by chunk."
LONG = {"max_new_tokens": 150, "min_new_tokens": 150}  # several chunks (first after 8 + 53 frames)
SHORT = {"max_new_tokens": 20, "min_new_tokens": 20}


@pytest.fixture(scope="module")
def served_stream(request):
    served = request.getfixturevalue("served_tiny")
    if not (Path(served.model_repository) / STREAM_MODEL).is_dir():
        pytest.skip(f"the served repository has no {STREAM_MODEL} model (server side of streaming not exported)")
    return served


def url_of(served, protocol):
    return served.grpc_url if protocol == "grpc" else served.http_url


def close(a, b, tol=1e-3):
    return a.shape == b.shape and float(np.abs(a - b).max(initial=0.0)) <= tol


def metric(served, name):
    with urllib.request.urlopen(served.metrics_url, timeout=5) as r:
        values = [float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                  if line.startswith(name + "{") and f'model="{STREAM_MODEL}"' in line]  # fmt: skip
    return sum(values) if values else None


@pytest.mark.e2e
@PROTOCOLS
def test_e2e_stream_equals_synthesize(served_stream, protocol):
    with ChatTTSClient(url_of(served_stream, protocol), protocol=protocol) as c:
        t0 = time.monotonic()
        chunks = []
        for x in c.stream(E2E_TEXT, seed=7, split=False, **LONG):
            chunks.append((time.monotonic() - t0, x))
        audio = c.synthesize(E2E_TEXT, seed=7, split=False, **LONG)
    assert len(chunks) > 1 and all(x.size > 0 for _, x in chunks)
    assert chunks[0][0] < chunks[-1][0]  # audio came before the end of the generation
    assert close(np.concatenate([x for _, x in chunks]), audio)


@pytest.mark.e2e
def test_e2e_grpc_http_and_async_streams_agree(served_stream):
    def sync(protocol):
        with ChatTTSClient(url_of(served_stream, protocol), protocol=protocol) as c:
            return np.concatenate(list(c.stream(E2E_TEXT, seed=5, split=False, **SHORT)))

    async def aio(protocol):
        async with AsyncChatTTSClient(url_of(served_stream, protocol), protocol=protocol) as c:
            return np.concatenate([x async for x in c.stream(E2E_TEXT, seed=5, split=False, **SHORT)])

    ref = sync("grpc")
    assert ref.size > 0
    assert close(sync("http"), ref) and close(asyncio.run(aio("grpc")), ref) and close(asyncio.run(aio("http")), ref)


@pytest.mark.e2e
@PROTOCOLS
def test_e2e_breaking_early_cancels_without_hanging(served_stream, protocol):
    endless = {"max_new_tokens": 2000, "min_new_tokens": 2000}
    with ChatTTSClient(url_of(served_stream, protocol), protocol=protocol) as c:
        t0 = time.monotonic()
        for _ in c.stream(E2E_TEXT, seed=3, split=False, **endless):
            break
        assert time.monotonic() - t0 < 120
        t1 = time.monotonic()
        # the gauge is the service's stats, refreshed every STATS_PERIOD_S: a value read sooner may be from
        # before the stream started (0 while it still runs, seen as a CI flake), so read only fresher ones
        time.sleep(2 * STATS_PERIOD_S)
        while metric(served_stream, "chattts_streams") not in (0, None) and time.monotonic() - t1 < 20:
            time.sleep(0.2)
        assert metric(served_stream, "chattts_streams") in (0, None)  # the server let the stream go
        assert len(list(c.stream(E2E_TEXT, seed=3, split=False, **SHORT))) >= 1


@pytest.mark.e2e
def test_e2e_long_text_streams_sentence_after_sentence(served_stream):
    text = "The first sentence. Then a second one."
    s1, s2 = split_sentences(text)
    with ChatTTSClient(served_stream.grpc_url) as c:
        streamed = np.concatenate(list(c.stream(text, seed=5, **SHORT)))
        first = c.synthesize(s1, seed=5, **SHORT)
        second = c.synthesize(s2, seed=5, speaker_audio=first, speaker_text=s1, **SHORT)
        with pytest.raises(ChatTTSError) as e:
            list(c.stream("a" * (C.LIMITS.max_text_chars + 1), split=False))
    assert close(streamed, np.concatenate([first, second]))
    assert e.value.status == "INVALID_ARGUMENT"


@pytest.mark.e2e
def test_e2e_cli_stream_writes_the_wav_of_the_non_stream_cli(served_stream, tmp_path):
    def run(*extra):
        cmd = [sys.executable, "-m", "client", E2E_TEXT, "--url", served_stream.grpc_url, "--seed", "9", "--format",
               "float32", "--max-new-tokens", "150", "--min-new-tokens", "150", *extra]  # fmt: skip
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    run("-o", str(tmp_path / "a.wav"))
    summary = run("-o", str(tmp_path / "s.wav"), "--stream")
    (a, rate_a), (s, rate_s) = read_wav(tmp_path / "a.wav"), read_wav(tmp_path / "s.wav")
    assert rate_a == rate_s == C.SAMPLE_RATE and a.size > 0 and close(s, a)
    assert "first chunk after" in summary
    raw = (tmp_path / "s.wav").read_bytes()  # sizes patched at the end
    data_size = struct.unpack("<I", raw[-4 * s.size - 4 : -4 * s.size])[0]
    assert struct.unpack("<I", raw[4:8])[0] == len(raw) - 8 and data_size == 4 * s.size
