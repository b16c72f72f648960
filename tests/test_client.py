"""Client unit tests; no Triton needed.

What goes over the wire is checked with small in-process fake servers that speak the real protocols
(gRPC GRPCInferenceService from tritonclient's own protos; KServe v2 HTTP with the binary tensor
extension), so the real tritonclient transports, error mapping and retries run, not stand-ins.
The contract itself comes from chattts_triton.config; nothing here restates it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import socket
import struct
import threading
import time
import wave
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from chattts_triton import config as C
from chattts_triton.model.text import split_text
from client import (
    AsyncChatTTSClient,
    ChatTTSClient,
    ChatTTSError,
    ChatTTSInputError,
    ChatTTSUnavailableError,
    WavError,
    cli,
    load_reference_audio,
    read_wav,
    save_wav,
    split_sentences,
)
from client.audio import to_pcm16
from client.contract import OPTION_INPUTS, build_inputs, input_datatype
from client.errors import normalize_status, to_chattts_error

OPTIONAL = [n for n, (_, _, required) in C.ENSEMBLE_INPUTS.items() if not required]
HTTP_CODES = {"UNAVAILABLE": 503, "INVALID_ARGUMENT": 400, "INTERNAL": 500, "NOT_FOUND": 404}


def sample_value(name: str):
    """A valid Python value for any contract input, by its datatype and dims."""
    datatype, dims = input_datatype(name), C.ENSEMBLE_INPUTS[name][1]
    if list(dims) == [-1]:
        return np.linspace(-0.5, 0.5, 37, dtype=np.float32)
    return {"BYTES": "abc", "BOOL": True}.get(datatype, 7 if datatype.startswith("INT") else 0.25)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- a fake model behind both fake servers -------------------------------------------------------
def decode_tensor(datatype: str, shape, raw: bytes) -> np.ndarray:
    if datatype == "BYTES":
        items, pos = [], 0
        while pos < len(raw):
            (n,) = struct.unpack_from("<I", raw, pos)
            items.append(raw[pos + 4 : pos + 4 + n])
            pos += 4 + n
        return np.array(items, dtype=object).reshape(shape)
    return np.frombuffer(raw, dtype=triton_to_np_dtype(datatype)).reshape(shape)


class FakeModel:
    """Audio derived from TEXT (and SPEAKER_AUDIO); 'BAD' in TEXT is INVALID_ARGUMENT. `script` holds
    per-request overrides consumed in order: a status name to fail with, or ('sleep', seconds)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.requests, self.datatypes, self.script = [], [], []

    @staticmethod
    def audio_for(text: bytes, n: int = 0) -> np.ndarray:
        rng = np.random.default_rng(zlib.crc32(text))
        return rng.uniform(-1, 1, 200 + 10 * len(text) + n).astype(np.float32)

    def handle(self, inputs: dict, datatypes: dict):
        with self.lock:
            self.requests.append(inputs)
            self.datatypes.append(datatypes)
            action = self.script.pop(0) if self.script else None
        if isinstance(action, tuple) and action[0] == "sleep":
            time.sleep(action[1])
            action = None
        if action is not None:
            return action, f"scripted {action}"
        text = inputs["TEXT"][0, 0]
        if b"BAD" in text:
            return "INVALID_ARGUMENT", "text contains BAD"
        extra = inputs["SPEAKER_AUDIO"].shape[1] if "SPEAKER_AUDIO" in inputs else 0
        return self.audio_for(text, extra)


class GrpcServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, model: FakeModel):
        self.model = model

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name == "chattts")

    def ModelInfer(self, request, context):
        inputs = {
            t.name: decode_tensor(t.datatype, list(t.shape), raw)
            for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)
        }
        result = self.model.handle(inputs, {t.name: t.datatype for t in request.inputs})
        if isinstance(result, tuple):
            context.abort(getattr(grpc.StatusCode, result[0]), result[1])
        out = service_pb2.ModelInferResponse.InferOutputTensor(name="AUDIO", datatype="FP32", shape=[1, result.size])
        return service_pb2.ModelInferResponse(
            model_name=request.model_name, outputs=[out], raw_output_contents=[result.astype("<f4").tobytes()]
        )


def fake_http_handler(model: FakeModel):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # tritonclient keeps connections alive

        def log_message(self, *args):
            pass

        def _reply(self, code: int, body: bytes, headers=()):
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            ok = self.path in ("/v2/health/ready", "/v2/models/chattts/ready")
            self._reply(200 if ok else 404, b"" if ok else b'{"error":"not found"}')

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v2/models/chattts/infer":
                return self._reply(404, b'{"error":"unknown model"}')
            n = int(self.headers.get("Inference-Header-Content-Length", len(body)))
            header, blob = json.loads(body[:n]), body[n:]
            inputs, datatypes = {}, {}
            for t in header["inputs"]:
                size = t.get("parameters", {}).get("binary_data_size")
                if size is None:
                    arr = np.array(t["data"], dtype=object if t["datatype"] == "BYTES" else None).reshape(t["shape"])
                else:
                    arr, blob = decode_tensor(t["datatype"], t["shape"], blob[:size]), blob[size:]
                inputs[t["name"]], datatypes[t["name"]] = arr, t["datatype"]
            result = model.handle(inputs, datatypes)
            if isinstance(result, tuple):
                return self._reply(HTTP_CODES[result[0]], json.dumps({"error": result[1]}).encode())
            data = result.astype("<f4").tobytes()
            out = {"name": "AUDIO", "datatype": "FP32", "shape": [1, result.size],
                   "parameters": {"binary_data_size": len(data)}}
            head = json.dumps({"model_name": "chattts", "outputs": [out]}).encode()
            self._reply(200, head + data, [("Inference-Header-Content-Length", str(len(head))),
                                           ("Content-Type", "application/octet-stream")])  # fmt: skip

    return Handler


class _QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that timed out and hung up is part of the tests


class FakeServers:
    """A gRPC and an HTTP stand-in of Triton on free ports, answering from one fake model."""

    def __init__(self, model=None, servicer=None, http_handler=None):
        self.model = model if model is not None else FakeModel()
        self.grpc = grpc.server(concurrent.futures.ThreadPoolExecutor(16))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server((servicer or GrpcServicer)(self.model), self.grpc)
        self.grpc_url = f"127.0.0.1:{self.grpc.add_insecure_port('127.0.0.1:0')}"
        self.grpc.start()
        self.http = _QuietHTTPServer(("127.0.0.1", 0), (http_handler or fake_http_handler)(self.model))
        self.http_url = f"127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def url(self, protocol: str) -> str:
        return self.grpc_url if protocol == "grpc" else self.http_url

    def stop(self):
        self.grpc.stop(grace=0)
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def fake(servers):
    servers.model.reset()
    return servers


class Sleeps(list):
    def __call__(self, seconds):
        self.append(seconds)


class AsyncSleeps(list):
    async def __call__(self, seconds):
        self.append(seconds)


PROTOCOLS = pytest.mark.parametrize("protocol", ["grpc", "http"])


# --- the contract ----------------------------------------------------------------------------
def test_every_contract_input_is_a_keyword_of_synthesize_and_a_cli_flag():
    expected = {n.lower() for n in OPTIONAL}
    assert set(OPTION_INPUTS) == expected
    for method in (ChatTTSClient.synthesize, AsyncChatTTSClient.synthesize):
        params = inspect.signature(method).parameters
        keywords = {k for k, p in params.items() if p.kind is p.KEYWORD_ONLY} - {"split",
                                                                                 "voice_from_first", "on_spoken_text"}
        assert keywords == expected, method.__qualname__
        assert all(params[k].default is None for k in expected)
    flags = {a.dest for a in cli.build_parser()._actions}
    assert expected <= flags


@pytest.mark.parametrize("name", list(C.ENSEMBLE_INPUTS))
def test_each_input_gets_its_contract_dtype_and_batch_shape(name):
    datatype, dims, _ = C.ENSEMBLE_INPUTS[name]
    value = sample_value(name)
    arrays = build_inputs("hi", {} if name == "TEXT" else {name.lower(): value})
    assert set(arrays) == ({"TEXT"} if name == "TEXT" else {"TEXT", name})
    arr = arrays[name]
    assert arr.dtype == np.dtype(triton_to_np_dtype(input_datatype(name)))
    if list(dims) == [-1]:
        assert arr.shape == (1, len(value)) and np.array_equal(arr[0], value)
    else:
        assert arr.shape == (1, 1)
    if datatype == "TYPE_STRING":
        assert arr[0, 0] == (b"hi" if name == "TEXT" else b"abc")


def test_omitted_options_are_not_sent():
    assert set(build_inputs("hi")) == {"TEXT"}
    assert set(build_inputs("hi", {k: None for k in OPTION_INPUTS})) == {"TEXT"}
    assert set(build_inputs("hi", {"seed": 0, "refine_text": False})) == {"TEXT", "SEED", "REFINE_TEXT"}


@pytest.mark.parametrize(
    "options, match",
    [
        ({"seed": "3"}, "expected an int"),
        ({"seed": True}, "expected an int"),
        ({"top_k": 2**40}, "out of INT32 range"),
        ({"temperature": float("nan")}, "finite"),
        ({"temperature": "hot"}, "expected a number"),
        ({"refine_text": 1}, "expected a bool"),
        ({"speaker": b"raw"}, "expected a str"),
        ({"speaker_audio": [[0.1, 0.2], [0.3, 0.4]]}, "1-D"),
        ({"speaker_audio": []}, "non-empty"),
        ({"speaker_audio": [0.0, float("inf")]}, "NaN or infinite"),
    ],
)
def test_bad_option_values_are_clear_value_errors(options, match):
    with pytest.raises(ChatTTSInputError, match=match) as e:
        build_inputs("hi", options)
    assert isinstance(e.value, ValueError) and e.value.status == "INVALID_ARGUMENT"


def test_bad_text_and_unknown_options():
    for text in ("", "   \n "):
        with pytest.raises(ChatTTSInputError, match="empty"):
            build_inputs(text)
    with pytest.raises(ChatTTSInputError, match="str"):
        build_inputs(b"bytes")
    with pytest.raises(TypeError, match="unknown option.*'topp'"):
        build_inputs("hi", {"topp": 0.5})


def test_status_normalization():
    assert normalize_status("StatusCode.INVALID_ARGUMENT") == "INVALID_ARGUMENT"
    assert normalize_status("400") == "INVALID_ARGUMENT"
    assert normalize_status("503") == "UNAVAILABLE"
    assert normalize_status(None) == "CLIENT_ERROR"
    assert to_chattts_error(ConnectionRefusedError(111, "refused")).status == "UNAVAILABLE"
    assert to_chattts_error(TimeoutError("slow")).status == "DEADLINE_EXCEEDED"
    assert to_chattts_error(RuntimeError("bug")).status == "UNKNOWN"


# --- what goes over the wire -------------------------------------------------------------------
@PROTOCOLS
def test_request_on_the_wire_and_audio_back(fake, protocol):
    ref = np.linspace(-0.25, 0.25, 48, dtype=np.float32)
    with ChatTTSClient(fake.url(protocol), protocol=protocol) as c:
        audio = c.synthesize(
            "Hello there", seed=3, temperature=0.5, top_k=20, refine_text=True, use_decoder=False,
            speaker="spk", speaker_audio=ref, split=False,
        )  # fmt: skip
    (sent,), (types,) = fake.model.requests, fake.model.datatypes
    assert set(sent) == {"TEXT", "SEED", "TEMPERATURE", "TOP_K", "REFINE_TEXT", "USE_DECODER", "SPEAKER",
                         "SPEAKER_AUDIO"}
    assert types == {n: input_datatype(n) for n in sent}
    assert all(sent[n].shape == (1, 1) for n in sent if n != "SPEAKER_AUDIO")
    assert sent["TEXT"][0, 0] == b"Hello there" and sent["SPEAKER"][0, 0] == b"spk"
    assert sent["SEED"][0, 0] == 3 and sent["TOP_K"][0, 0] == 20 and sent["TEMPERATURE"][0, 0] == np.float32(0.5)
    assert sent["REFINE_TEXT"][0, 0] == True and sent["USE_DECODER"][0, 0] == False  # noqa: E712  numpy bools: == compares the value
    assert np.array_equal(sent["SPEAKER_AUDIO"], ref[None])
    assert audio.dtype == np.float32 and audio.ndim == 1 and audio.flags.writeable
    assert np.array_equal(audio, FakeModel.audio_for(b"Hello there", ref.size))


@PROTOCOLS
def test_unavailable_is_retried_with_exponential_backoff(fake, protocol):
    fake.model.script = ["UNAVAILABLE", "UNAVAILABLE"]
    sleeps = Sleeps()
    with ChatTTSClient(fake.url(protocol), protocol=protocol, retries=3, backoff_s=0.5, sleep=sleeps) as c:
        audio = c.synthesize("hi")
    assert len(fake.model.requests) == 3 and sleeps == [0.5, 1.0]
    assert np.array_equal(audio, FakeModel.audio_for(b"hi"))


@PROTOCOLS
def test_invalid_argument_is_raised_at_once_with_status_and_message(fake, protocol):
    sleeps = Sleeps()
    with ChatTTSClient(fake.url(protocol), protocol=protocol, retries=5, sleep=sleeps) as c:
        with pytest.raises(ChatTTSError) as e:
            c.synthesize("BAD text")
    assert e.value.status == "INVALID_ARGUMENT" and "text contains BAD" in str(e.value)
    assert len(fake.model.requests) == 1 and sleeps == []


@PROTOCOLS
def test_other_server_errors_are_not_retried(fake, protocol):
    fake.model.script = ["INTERNAL"]
    with ChatTTSClient(fake.url(protocol), protocol=protocol, retries=5, sleep=Sleeps()) as c:
        with pytest.raises(ChatTTSError) as e:
            c.synthesize("hi")
    assert e.value.status == "INTERNAL" and len(fake.model.requests) == 1


@PROTOCOLS
def test_gives_up_after_the_retries(fake, protocol):
    fake.model.script = ["UNAVAILABLE"] * 3
    sleeps = Sleeps()
    with ChatTTSClient(fake.url(protocol), protocol=protocol, retries=2, backoff_s=1.0, max_backoff_s=1.5,
                       sleep=sleeps) as c:
        with pytest.raises(ChatTTSUnavailableError, match=r"gave up after 3 attempt"):
            c.synthesize("hi")
    assert len(fake.model.requests) == 3 and sleeps == [1.0, 1.5]  # capped


@PROTOCOLS
def test_unreachable_server_is_unavailable_after_retries(protocol):
    sleeps = Sleeps()
    c = ChatTTSClient(f"127.0.0.1:{free_port()}", protocol=protocol, retries=2, sleep=sleeps)
    assert not c.is_ready()
    with pytest.raises(ChatTTSUnavailableError) as e:
        c.synthesize("hi")
    c.close()
    assert "127.0.0.1" in str(e.value) and len(sleeps) == 2


@PROTOCOLS
def test_timeout_is_deadline_exceeded_and_not_retried(fake, protocol):
    fake.model.script = [("sleep", 1.5)]
    with ChatTTSClient(fake.url(protocol), protocol=protocol, timeout_s=0.3, retries=3, sleep=Sleeps()) as c:
        t0 = time.monotonic()
        with pytest.raises(ChatTTSError) as e:
            c.synthesize("hi")
    assert e.value.status == "DEADLINE_EXCEEDED" and time.monotonic() - t0 < 1.4
    assert len(fake.model.requests) == 1


@PROTOCOLS
def test_async_client_on_the_wire_retries_and_errors(fake, protocol):
    async def main():
        sleeps = AsyncSleeps()
        async with AsyncChatTTSClient(fake.url(protocol), protocol=protocol, backoff_s=0.25, sleep=sleeps) as c:
            assert await c.is_ready()
            fake.model.script = ["UNAVAILABLE"]
            audio = await c.synthesize("Hello", seed=9, split=False)
            with pytest.raises(ChatTTSError) as e:
                await c.synthesize("BAD")
            batch = await c.synthesize_batch(["a", "BAD b", "c"], return_exceptions=True, max_new_tokens=5)
        return audio, e.value, batch, sleeps

    audio, err, batch, sleeps = asyncio.run(main())
    assert np.array_equal(audio, FakeModel.audio_for(b"Hello")) and sleeps == [0.25]
    assert fake.model.requests[0]["SEED"][0, 0] == 9 and set(fake.model.requests[0]) == {"TEXT", "SEED"}
    assert err.status == "INVALID_ARGUMENT" and len(fake.model.requests) == 6  # 2 + 1 + 3, BAD never retried
    assert np.array_equal(batch[0], FakeModel.audio_for(b"a")) and np.array_equal(batch[2], FakeModel.audio_for(b"c"))
    assert isinstance(batch[1], ChatTTSError) and batch[1].status == "INVALID_ARGUMENT"
    assert all(r["MAX_NEW_TOKENS"][0, 0] == 5 for r in fake.model.requests[3:])


# --- retry policy and splitting against an in-memory transport -----------------------------------
class FakeTransport:
    """Returns audio derived from TEXT; `errors` are raised first, in order, like tritonclient would."""

    def __init__(self, errors=(), barrier=None):
        self.errors = list(errors)
        self.calls = []
        self.lock = threading.Lock()
        self.barrier = barrier

    def infer(self, arrays):
        with self.lock:
            self.calls.append(arrays)
            error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        text = arrays["TEXT"][0, 0]
        if self.barrier is not None and "SPEAKER_AUDIO" in arrays:
            self.barrier.wait()  # every sentence of the batch must be in flight at once
            time.sleep(0.005 * (zlib.crc32(text) % 7))  # finish in some other order
        return FakeModel.audio_for(text)

    def close(self):
        pass


class SpokenTransport(FakeTransport):
    """A transport that also answers SPOKEN_TEXT when asked (the text upper-cased, to tell it from TEXT)."""

    def infer(self, arrays, spoken_text=False):
        audio = super().infer(arrays)
        return (audio, arrays["TEXT"][0, 0].decode().upper()) if spoken_text else audio


def test_spoken_text_of_each_piece_is_handed_over_in_order_and_only_when_asked():
    t = SpokenTransport(barrier=threading.Barrier(4, timeout=10))
    got = []
    with ChatTTSClient("x:1", transport=t, max_concurrency=8) as c:
        audio = c.synthesize(LONG_TEXT, seed=1, on_spoken_text=got.append)
        assert np.array_equal(audio, c.synthesize(LONG_TEXT, seed=1))  # the same audio either way
    assert got == [s.upper() for s in split_sentences(LONG_TEXT)]
    plain = FakeTransport()  # a transport that does not know the keyword: never given it unasked
    ChatTTSClient("x:1", transport=plain).synthesize("hello there", voice_from_first=False)
    assert len(plain.calls) == 1


def test_spoken_text_from_responses_and_stream_events():
    import tritonclient.grpc as grpcclient

    from client.contract import requested_outputs, spoken_text_from_json, spoken_text_from_result

    class Result:
        def __init__(self, value):
            self.value = value

        def as_numpy(self, name):
            return self.value if name == "SPOKEN_TEXT" else None

    assert spoken_text_from_result(Result(np.array([["五元".encode()]], dtype=object))) == "五元"
    assert spoken_text_from_result(Result(None)) is None
    assert spoken_text_from_json({"AUDIO": [], "SPOKEN_TEXT": "five"}) == "five"
    assert spoken_text_from_json({"AUDIO": [], "SPOKEN_TEXT": ["five"]}) == "five"
    assert spoken_text_from_json({"AUDIO": []}) is None
    assert [o.name() for o in requested_outputs(grpcclient)] == ["AUDIO"]
    assert [o.name() for o in requested_outputs(grpcclient, True)] == ["AUDIO", "SPOKEN_TEXT"]


def test_retry_policy_with_a_fake_transport():
    unavailable = InferenceServerException("Exceeds maximum queue size", status="StatusCode.UNAVAILABLE")
    t = FakeTransport([unavailable, unavailable])
    sleeps = Sleeps()
    c = ChatTTSClient("x:1", transport=t, retries=2, backoff_s=0.1, sleep=sleeps)
    assert np.array_equal(c.synthesize("hi"), FakeModel.audio_for(b"hi"))
    assert len(t.calls) == 3 and sleeps == [0.1, 0.2]

    invalid = InferenceServerException("bad seed", status="StatusCode.INVALID_ARGUMENT")
    t = FakeTransport([invalid])
    c = ChatTTSClient("x:1", transport=t, retries=2, sleep=sleeps)
    with pytest.raises(ChatTTSError, match=r"\[INVALID_ARGUMENT\].*bad seed"):
        c.synthesize("hi")
    assert len(t.calls) == 1

    t = FakeTransport([InferenceServerException("gone", status="503")] * 2)
    assert ChatTTSClient("x:1", protocol="http", transport=t, retries=1, sleep=Sleeps()).synthesize_batch(
        ["a"], return_exceptions=True
    )[0].status == "UNAVAILABLE"


# sentences long enough not to be joined (chattts_triton.model.split.DEFAULT_MIN_FRAMES), short
# enough to fit one request
LONG_TEXT = ("The first sentence is long enough to stand alone. The second one is here as well. 第三句话也足够长了。"
             "And the fourth one closes the text. ")


def test_long_text_is_split_at_sentences_sent_concurrently_and_joined_in_order():
    sentences = split_sentences(LONG_TEXT)
    # as upstream
    assert sentences == [p.strip() for p in split_text(LONG_TEXT, drop_empty=True)] and len(sentences) == 4
    t = FakeTransport(barrier=threading.Barrier(len(sentences), timeout=10))
    with ChatTTSClient("x:1", transport=t, max_concurrency=8) as c:
        audio = c.synthesize(LONG_TEXT, seed=1)
    reference, *batch = t.calls
    assert reference["TEXT"][0, 0] == sentences[0].encode() and "SPEAKER_AUDIO" not in reference
    assert sorted(a["TEXT"][0, 0] for a in batch) == sorted(s.encode() for s in sentences)
    first_audio = FakeModel.audio_for(sentences[0].encode())
    for a in batch:  # upstream: spk_smp from the first sentence's audio, txt_smp = that sentence
        assert np.array_equal(a["SPEAKER_AUDIO"][0], first_audio)
        assert a["SPEAKER_TEXT"][0, 0] == sentences[0].encode() and a["SEED"][0, 0] == 1
    expected = np.concatenate([FakeModel.audio_for(s.encode()) for s in sentences])
    assert np.array_equal(audio, expected)


@PROTOCOLS
def test_long_text_over_the_real_transports(fake, protocol):
    sentences = split_sentences(LONG_TEXT)
    with ChatTTSClient(fake.url(protocol), protocol=protocol, max_concurrency=4) as c:
        audio = c.synthesize(LONG_TEXT)
        again = c.synthesize(LONG_TEXT)  # the pool and its per-thread HTTP clients are reused
    ref = FakeModel.audio_for(sentences[0].encode())
    expected = np.concatenate([FakeModel.audio_for(s.encode(), ref.size) for s in sentences])
    assert np.array_equal(audio, expected) and np.array_equal(again, expected)
    assert len(fake.model.requests) == 2 * (1 + len(sentences))


def test_newlines_split_first_blank_lines_are_dropped_and_very_short_pieces_joined():
    t = FakeTransport()
    text = "Line one is a sentence of its own. Still line one, a bit longer.\n\n  \nLine two is another one.\nOK."
    ChatTTSClient("x:1", transport=t).synthesize(text, voice_from_first=False)
    assert [a["TEXT"][0, 0] for a in t.calls] == [
        b"Line one is a sentence of its own.", b"Still line one, a bit longer.", b"Line two is another one.\nOK."]


def test_no_voice_reference_when_given_or_disabled():
    for options in ({"speaker_audio": np.ones(10, np.float32)}, {"speaker_sample": "smp"}, {"voice_from_first": False}):
        t = FakeTransport()
        ChatTTSClient("x:1", transport=t).synthesize(LONG_TEXT, **options)
        assert len(t.calls) == 4, options
    t = FakeTransport()
    ChatTTSClient("x:1", transport=t).synthesize(LONG_TEXT, split=False)
    assert len(t.calls) == 1 and t.calls[0]["TEXT"][0, 0] == LONG_TEXT.encode()


def test_bad_options_fail_before_anything_is_sent():
    t = FakeTransport()
    c = ChatTTSClient("x:1", transport=t)
    with pytest.raises(ChatTTSInputError):
        c.synthesize(LONG_TEXT, seed="1")
    with pytest.raises(TypeError):
        c.synthesize_batch(["a"], sead=1)
    with pytest.raises(ChatTTSInputError):
        c.synthesize_batch(["a", ""])
    assert t.calls == []


def test_synthesize_batch_keeps_order_reports_progress_and_errors():
    invalid = InferenceServerException("no", status="StatusCode.INVALID_ARGUMENT")
    t = FakeTransport([invalid])  # the first request to arrive fails
    seen = []
    texts = ["one. two. three.", "b", "c"]  # items are not split (upstream infer(list))
    results = ChatTTSClient("x:1", transport=t, max_concurrency=1).synthesize_batch(
        texts, return_exceptions=True, on_result=lambda i, r: seen.append(i), top_p=0.5
    )
    assert sorted(seen) == [0, 1, 2] and len(t.calls) == 3
    assert isinstance(results[0], ChatTTSError)
    assert [np.array_equal(r, FakeModel.audio_for(x.encode()))
            for r, x in zip(results[1:], texts[1:], strict=True)] == [True, True]
    assert all(a["TOP_P"][0, 0] == np.float32(0.5) for a in t.calls)
    with pytest.raises(ChatTTSError):
        ChatTTSClient("x:1", transport=FakeTransport([invalid])).synthesize_batch(["a", "b"])
    assert ChatTTSClient("x:1", transport=FakeTransport()).synthesize_batch([]) == []


def test_async_long_text_matches_sync():
    class AsyncFake:
        def __init__(self):
            self.sync = FakeTransport()

        async def infer(self, arrays):
            await asyncio.sleep(0.001)
            return self.sync.infer(arrays)

        async def close(self):
            pass

    async def main():
        async with AsyncChatTTSClient("x:1", transport=AsyncFake()) as c:
            return await c.synthesize(LONG_TEXT, seed=2)

    expected = ChatTTSClient("x:1", transport=FakeTransport()).synthesize(LONG_TEXT, seed=2)
    assert np.array_equal(asyncio.run(main()), expected)


def test_constructor_errors():
    for kwargs in ({"protocol": "udp"}, {"url": "http://h:1"}, {"timeout_s": 0}, {"retries": -1},
                   {"max_concurrency": 0},
                   {"stream_model": ""}):  # fmt: skip
        with pytest.raises(ValueError):
            ChatTTSClient(**{"url": "h:1", **kwargs})
    c = ChatTTSClient("x:1", transport=FakeTransport())
    assert c.stream_model == "chattts_stream" and "chattts_stream" in c.stream_where
    assert ChatTTSClient(protocol="http", transport=FakeTransport()).url == "localhost:8000"


# --- WAV ----------------------------------------------------------------------------------------
def test_pcm16_wav_round_trip_with_stdlib_reader(tmp_path):
    audio = np.concatenate([np.linspace(-1, 1, 999, dtype=np.float32), [1.5, -1.5, 0.0]]).astype(np.float32)
    path = save_wav(tmp_path / "sub" / "a.wav", audio)
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2,
                                                                                          C.SAMPLE_RATE, audio.size)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert np.array_equal(pcm, to_pcm16(audio)) and pcm[-3:].tolist() == [32767, -32767, 0]
    back, rate = read_wav(path)
    assert rate == C.SAMPLE_RATE and np.abs(back[:999] - audio[:999]).max() < 2 / 32767  # read back as /32768


def test_float32_wav_round_trip_is_exact(tmp_path):
    audio = np.random.default_rng(0).uniform(-1.2, 1.2, 1001).astype(np.float32)
    path = save_wav(tmp_path / "f.wav", audio, fmt="float32", sample_rate=16000)
    back, rate = read_wav(path)
    assert rate == 16000 and back.dtype == np.float32 and np.array_equal(back, audio)
    wavfile = pytest.importorskip("scipy.io.wavfile")  # an independent reader
    rate, data = wavfile.read(path)
    assert rate == 16000 and np.array_equal(data, audio)


def test_wav_errors_and_reference_loading(tmp_path):
    (tmp_path / "junk.wav").write_bytes(b"not a wav file")
    with pytest.raises(WavError, match="RIFF"):
        read_wav(tmp_path / "junk.wav")
    with pytest.raises(ValueError, match="fmt"):
        save_wav(tmp_path / "x.wav", np.zeros(3), fmt="mp3")
    stereo = tmp_path / "stereo.wav"
    with wave.open(str(stereo), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(C.SAMPLE_RATE)
        w.writeframes(np.array([1000, 3000, -2000, 0], dtype="<i2").tobytes())
    ref = load_reference_audio(stereo)
    assert ref.shape == (2,) and np.allclose(ref, [2000 / 32768, -1000 / 32768])
    save_wav(tmp_path / "slow.wav", np.zeros(10), sample_rate=16000)
    with pytest.raises(WavError, match="24000 Hz"):
        load_reference_audio(tmp_path / "slow.wav")


# --- command line -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "either TEXT or --file"),
        (["hi"], "needs -o"),
        (["hi", "-o", "a.wav", "--file", "t.txt"], "either TEXT or --file"),
        (["--file", "t.txt"], "needs --out-dir"),
        (["hi", "-o", "a.wav", "--seed", "abc"], "invalid int"),
        (["hi", "-o", "a.wav", "--protocol", "udp"], "invalid choice"),
        (["hi", "-o", "a.wav", "--speaker-audio", "/nonexistent.wav"], "nonexistent"),
        (["hi", "-o", "a.wav", "--concurrency", "0"], "positive"),
        (["hi", "-o", "a.wav", "--url", "http://h:1"], "without a scheme"),
        (["--file", "t.txt", "--out-dir", "o", "--show-spoken-text"], "--show-spoken-text goes with TEXT"),
    ],
)
def test_cli_argument_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_unreachable_server_is_a_clear_error(tmp_path, capsys):
    rc = cli.main(["hi", "-o", str(tmp_path / "a.wav"), "--url", f"127.0.0.1:{free_port()}", "--retries", "0"])
    err = capsys.readouterr().err
    assert rc == 1 and "UNAVAILABLE" in err and "127.0.0.1" in err and not (tmp_path / "a.wav").exists()


@PROTOCOLS
def test_cli_text_to_wav_sends_the_flags(fake, protocol, tmp_path):
    out = tmp_path / "a.wav"
    rc = cli.main(["Hello", "-o", str(out), "--url", fake.url(protocol), "--protocol", protocol, "-q",
                   "--top-p", "0.5", "--no-refine-text", "--max-new-tokens", "20", "--format", "float32"])  # fmt: skip
    assert rc == 0
    (sent,) = fake.model.requests
    assert set(sent) == {"TEXT", "TOP_P", "REFINE_TEXT", "MAX_NEW_TOKENS"}
    assert sent["TOP_P"][0, 0] == np.float32(0.5) and sent["REFINE_TEXT"][0, 0] == False  # noqa: E712  numpy bools: == compares the value
    audio, rate = read_wav(out)
    assert rate == C.SAMPLE_RATE and np.array_equal(audio, FakeModel.audio_for(b"Hello"))


def test_cli_file_mode_writes_one_wav_per_line_and_reports_failures(fake, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("first line\n\nBAD second\nthird line\n", encoding="utf-8")
    rc = cli.main(["--file", str(texts), "--out-dir", str(tmp_path / "out"), "--url", fake.grpc_url])
    captured = capsys.readouterr()
    assert rc == 1 and "line 3: [INVALID_ARGUMENT]" in captured.err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0001.wav", "0004.wav"]
    pcm, _ = read_wav(tmp_path / "out" / "0004.wav")
    assert pcm.size == FakeModel.audio_for(b"third line").size
    assert "2 of 3 WAV files" in captured.out


def test_cli_reads_speaker_strings_and_reference_audio_from_files(fake, tmp_path):
    (tmp_path / "spk.txt").write_text("SPEAKER-STRING\n", encoding="utf-8")
    ref = np.linspace(-0.5, 0.5, 100, dtype=np.float32)
    save_wav(tmp_path / "ref.wav", ref, fmt="float32")
    rc = cli.main(["Hi", "-o", str(tmp_path / "a.wav"), "--url", fake.grpc_url, "-q", "--speaker",
                   f"@{tmp_path / 'spk.txt'}",
                   "--speaker-audio", str(tmp_path / "ref.wav"), "--speaker-text", "ref words"])  # fmt: skip
    assert rc == 0
    (sent,) = fake.model.requests
    assert sent["SPEAKER"][0, 0] == b"SPEAKER-STRING" and sent["SPEAKER_TEXT"][0, 0] == b"ref words"
    assert np.array_equal(sent["SPEAKER_AUDIO"][0], ref)
