"""The speech gateway without Triton: the request body and its errors, the speed table, the text split, the
encoders (decoded back by FFmpeg), and the HTTP application served by uvicorn with a stand-in synthesizer
(authentication, overload, timeouts, health, metrics). Against the real server: tests/test_gateway_e2e.py."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import urllib.error
import urllib.request
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chattts_triton.config import LIMITS, SAMPLE_RATE
from chattts_triton.launcher.tritonserver import free_port
from client.errors import ChatTTSError
from gateway import api
from gateway.app import Settings, create_app
from gateway.audio import CONTENT_TYPES, FORMATS, StreamEncoder, decode, encode, to_int16
from gateway.synth import Job, SynthesisError, Synthesizer, split_text, synthesis_error

OK = {"model": "chattts", "input": "Hello world.", "voice": "alloy"}


# --- the body --------------------------------------------------------------------------------------
def parse(**fields) -> api.SpeechRequest:
    return api.parse(json.dumps({**OK, **fields}).encode())


@pytest.mark.parametrize("fields, param, words", [
    ({"input": 5}, "input", "valid string"),
    ({"input": ""}, "input", "empty"),
    ({"input": "  \n"}, "input", "empty"),
    ({"input": "x" * (api.MAX_INPUT_CHARS + 1)}, "input", "limit of 4096"),
    ({"input": "x" * (LIMITS.max_text_chars + 1), "split": False}, "input", "split false"),
    ({"voice": 7}, "voice", "valid string"),
    ({"voice": " "}, "voice", "empty"),
    ({"voice": {"name": "x"}}, "voice", "id"),
    ({"response_format": "ogg"}, "response_format", "'mp3', 'opus', 'aac', 'flac', 'wav', 'pcm', 'ulaw', 'alaw', "
                                                    "'wav_ulaw' or 'wav_alaw'"),
    ({"speed": 0.1}, "speed", "greater than or equal to 0.25"),
    ({"speed": 4.5}, "speed", "less than or equal to 4"),
    ({"speed": "1.0"}, "speed", "valid number"),
    ({"stream_format": "chunks"}, "stream_format", "'audio' or 'sse'"),
    ({"model": "whisper-1"}, "model", "does not exist"),
    ({"seed": 1.5}, "seed", "valid integer"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"temperature": 0}, "temperature", "greater than 0"),
    ({"top_p": 2}, "top_p", "less than or equal to 1"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"max_new_tokens": 5, "min_new_tokens": 9}, "min_new_tokens", "must not exceed"),
    ({"prompt": "[speed_2]", "speed": 1.5}, "speed", "not both"),
    ({"sample_rate": 12345}, "sample_rate", "one of 8000, 16000, 22050, 24000, 44100, 48000"),
    ({"sample_rate": "8000"}, "sample_rate", "valid integer"),
    ({"sample_rate": 8000.0}, "sample_rate", "valid integer"),
    ({"response_format": "opus", "sample_rate": 22050}, "sample_rate", "not an Opus rate"),
])
def test_bad_fields_are_400s_naming_the_field(fields, param, words):
    with pytest.raises(api.APIError) as e:
        parse(**fields)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param", [(b"not json", None), (b"[1, 2]", None), (b'{"model": "chattts"}', "input"),
                                         (b'{"model": "chattts", "input": "x"}', "voice")])
def test_malformed_and_incomplete_bodies(body, param):
    with pytest.raises(api.APIError) as e:
        api.parse(body)
    assert e.value.status == 400 and e.value.param == param


def test_a_good_body_becomes_contract_options():
    req = parse(voice={"id": "nova"}, speed=2.0, seed=9, temperature=0.5, top_k=3, instructions="cheerful",
                unknown_future_field=1, model="tts-1")
    assert api.contract_options(req) == {"voice": "nova", "prompt": "[speed_8]", "temperature": 0.5, "top_k": 3}
    assert api.contract_options(parse(prompt="[oral_2]"))["prompt"] == "[speed_5][oral_2]"
    assert api.contract_options(parse(prompt="[speed_1][oral_2]"))["prompt"] == "[speed_1][oral_2]"
    assert parse(speed=1).speed == 1.0  # an integer is a number


@pytest.mark.parametrize("stream", [False, True])
def test_every_synthesis_option_is_a_body_field_that_reaches_the_request_tensors(stream):
    """A field added to SynthesisOptions is a body field that reaches Triton with nothing written in the gateway: each
    field but the voice's (`voice` gives those) from a body, through its Job and the Synthesizer's client, into the
    request's tensors, whole and streamed (a recording transport; no server)."""
    from client import AsyncChatTTSClient
    from client.contract import OPTION_FIELDS, OPTION_INPUTS, encode_input
    from tests.test_client_options import EVERY, AsyncRecorder

    assert sorted(api.BODY_OPTIONS + api.VOICE_FIELDS) == sorted(OPTION_FIELDS)
    given = {f: EVERY[f] for f in api.BODY_OPTIONS}
    job = asyncio.run(api.speech_job(parse(**given)))
    recorder = AsyncRecorder()
    synth = Synthesizer("127.0.0.1:1")

    async def run():
        synth._client = AsyncChatTTSClient("127.0.0.1:1", transport=recorder)
        if stream:
            return [part async for part in synth.stream(job)]
        return await synth.synthesize(job)

    asyncio.run(run())
    expected = {OPTION_INPUTS[f]: encode_input(OPTION_INPUTS[f], v) for f, v in given.items()}
    expected["PROMPT"] = encode_input("PROMPT", "[speed_5]" + given["prompt"])  # `speed` is the prompt's speed token
    expected.update(TEXT=encode_input("TEXT", OK["input"]), VOICE=encode_input("VOICE", OK["voice"]))
    [sent] = recorder.sent
    assert set(sent) == set(expected)
    for name, arr in expected.items():
        assert sent[name].dtype == arr.dtype and np.array_equal(sent[name], arr), name


def test_speed_table_is_monotone_and_follows_the_logarithm():
    assert (api.speed_token(1.0) == "[speed_5]" and api.speed_token(0.25) == "[speed_0]"
            and api.speed_token(4.0) == "[speed_9]")
    speeds = np.geomspace(0.25, 4.0, 400)
    steps = [int(api.speed_token(float(s))[7]) for s in speeds]
    assert steps == sorted(steps) and set(steps) == set(range(10))
    for s, n in zip(speeds, steps, strict=True):   # N = 5 + 2.5 log2(speed), rounded
        exact = min(9.0, max(0.0, 5 + 2.5 * math.log2(s)))
        assert abs(n - exact) <= 0.5 + 1e-9, s
    rows = api.speed_table()
    assert len(rows) == 10 and rows[0][0] == 0.25 and rows[5][2] == "[speed_5]" and rows[5][0] < 1.0 < rows[5][1]


# --- splitting and errors ----------------------------------------------------------------------------
# sentences long enough to be a piece of their own (split_for_synthesis joins pieces under ≈ 1.4 s)
S1 = "The first sentence is long enough to stand alone here."
S2 = "The second sentence is also long enough to stand alone."
S3 = "第三句很长，足够独立成为一段语音了吧。"


def test_split_text_pieces():
    assert split_text(f"{S1} {S2} {S3}") == [S1, S2, S3]
    assert split_text("One. Two. Three.") == ["One. Two. Three."]  # short sentences join: one request, not three
    assert split_text(f"{S1}\n\n{S2}\n") == [S1, S2]
    assert split_text(f"{S1}\n...\n!!\n{S2}") == [f"{S1}\n...\n!!", S2]  # nothing to say: kept with the previous
    long = ("word " * 900).strip()  # 4499 characters, no sentence end
    pieces = split_text(long)
    assert all(len(p) <= LIMITS.max_text_chars for p in pieces) and " ".join(pieces) == long


def test_server_errors_keep_their_message_and_field():
    err = synthesis_error(ChatTTSError("INVALID_ARGUMENT", "grpc://127.0.0.1:1 model 'chattts': in ensemble "
                                       "'chattts', VOICE 'x' is not a voice of this server; known: alloy"))
    assert (err.status, err.field) == ("INVALID_ARGUMENT", "VOICE") and err.message.startswith("VOICE 'x' is not")
    assert synthesis_error(ChatTTSError("INVALID_ARGUMENT",
                                        "INVALID_ARGUMENT: REFINE_TOP_P must be")).field == "REFINE_TOP_P"
    assert api.field_of("VOICE") == "voice" and api.field_of("TEXT") == "input" and api.field_of("TOP_P") == "top_p"


def test_seed_schedule():
    job = Job(["a", "b", "c"], {"voice": "alloy"}, seed=2**63 - 2)
    assert [job.piece_options(i)["seed"] for i in range(3)] == [2**63 - 2, 2**63 - 1, 0]
    assert job.piece_options(1)["voice"] == "alloy"


# --- audio -------------------------------------------------------------------------------------------
def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.4 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)


def samples16(decoded: np.ndarray) -> np.ndarray:
    return np.round(decoded * 32768).astype(np.int16)


# samples a decoder may add: encoder priming and the last frame's padding (a stream has no gapless header)
SLACK = {"mp3": 2 * 1152, "aac": 2 * 1024, "opus": 0, "flac": 0, "wav": 0, "pcm": 0, "ulaw": 0, "alaw": 0,
         "wav_ulaw": 0,
         "wav_alaw": 0}


@pytest.mark.parametrize("seconds", [0.03, 0.4, 1.3, 2.5])
@pytest.mark.parametrize("fmt", FORMATS)
def test_whole_files_decode_to_the_audio(fmt, seconds):
    x = tone(seconds)
    data = encode(fmt, x)
    y = decode(data, fmt)
    exact = fmt != "aac"  # MP3 (LAME header) and Opus (pre-skip) carry their exact length; ADTS cannot
    assert y.size == x.size if exact else 0 <= y.size - x.size <= SLACK["aac"]
    if fmt in ("pcm", "wav", "flac"):
        assert np.array_equal(samples16(y), to_int16(x))
    if fmt == "wav":
        import soundfile

        info = soundfile.info(__import__("io").BytesIO(data))
        assert (info.samplerate, info.channels, info.frames, info.subtype) == (SAMPLE_RATE, 1, x.size, "PCM_16")


@pytest.mark.parametrize("size", [0, 1, 7, 24000, 76544])
def test_int16_samples_are_the_plain_formulas_in_range_and_past_it(size):
    """to_int16 skips the clip for audio in range: the same samples as clip × 32767 rounded half to even, for
    float32 and float64, audio past ±1 clipped, NaN as the clip leaves it."""
    x = (1.3 * np.sin(np.arange(size) * 0.01)).astype(np.float32)
    cases = [x, np.clip(x, -0.9, 0.9), x.astype(np.float64),
             np.array([0.5 / 32767, 1.5 / 32767, -1.0, 1.0], np.float32)]
    for audio in cases:
        plain = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
        got = to_int16(audio)
        assert got.dtype == plain.dtype and np.array_equal(got, plain)
    with np.errstate(invalid="ignore"):
        nan = np.array([np.nan, 0.25], np.float32)
        assert np.array_equal(to_int16(nan), (np.clip(nan, -1.0, 1.0) * 32767.0).round().astype("<i2"))


def test_the_gateway_keeps_freed_audio_buffers_in_its_heap():
    """glibc accepts the thresholds tune_malloc sets (mallopt returns 0 for a value past its limits)."""
    from gateway.app import tune_malloc

    assert tune_malloc()


@pytest.mark.parametrize("fmt", FORMATS)
def test_streams_give_bytes_from_the_first_chunk_and_decode_to_the_audio(fmt):
    x = tone(1.0)
    enc = StreamEncoder(fmt)
    parts = [enc.push(x[i:i + 4096]) for i in range(0, x.size, 4096)]
    parts.append(enc.close())
    assert len(parts[0]) > 0 and sum(len(p) > 0 for p in parts[:-1]) >= len(parts) - 2  # audio as it comes
    y = decode(b"".join(parts), fmt)
    assert 0 <= y.size - x.size <= SLACK[fmt]
    if fmt in ("pcm", "wav", "flac"):
        assert np.array_equal(samples16(y), to_int16(x))
    else:  # lossy: the tone is still there (the best lag's correlation)
        lag = int(np.argmax(np.correlate(y[:6000], x[:2000], "valid")))
        seg = y[lag:lag + x.size]
        assert np.corrcoef(seg, x[:seg.size])[0, 1] > 0.9


# --- the application, with a stand-in synthesizer -----------------------------------------------------
class FakeSynth(Synthesizer):
    """The gateway's Synthesizer with its three Triton calls stood in for: every piece 0.5 s of tone (the first
    streamed in one chunk) after `delay_s`, or `error`; a piece holding BAD is refused as the server refuses an
    unknown control token, by chattts_preprocess too; `fail_piece` fails that piece with `fail_error` after the
    first piece's audio was sent. The sequencing (pieces, pauses, segments, preflight) is the real one."""

    def __init__(self, pause_ms: int = 0):
        super().__init__("127.0.0.1:1", pause_ms=pause_ms)
        self.error: SynthesisError | None = None
        self.fail_piece: int | None = None
        self.fail_error = SynthesisError("UNAVAILABLE", "server busy: 32 generations in flight, retry later")
        self.delay_s = 0.0
        self.chunk_delay_s = 0.0
        self.jobs: list[Job] = []
        self.is_ready = True
        self.cancelled = 0  # syntheses stopped before their end
        self.closed = 0  # streams ended, however
        self.checked: list[str] = []  # the pieces the preflight was asked about
        self.calls: list[str] = []  # the order of the calls: check i, stream, chunk, infer i

    def _refuse(self, text: str) -> None:
        if self.error:
            raise self.error
        if BAD in text:
            raise SynthesisError("INVALID_ARGUMENT", f"TEXT holds an unknown control token {BAD}", "TEXT")

    async def ready(self):
        return {"chattts": self.is_ready, "chattts_stream": True}

    async def _infer(self, job, i, spoken_text=False):
        self.calls.append(f"infer {i}")
        if i == 0:
            self.jobs.append(job)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self._refuse(job.pieces[i])
        if i == self.fail_piece:
            await asyncio.sleep(0.2)  # after the first piece's audio went out
            raise self.fail_error
        audio = tone(0.5)
        return (audio, spoken(job.pieces[i])) if spoken_text else audio

    async def _stream_first(self, job, on_spoken_text):
        self.calls.append("stream")
        self.jobs.append(job)
        try:
            await asyncio.sleep(self.delay_s)
            self._refuse(job.pieces[0])
            if on_spoken_text is not None:
                on_spoken_text(spoken(job.pieces[0]))
            self.calls.append("chunk")
            yield tone(0.5)
            await asyncio.sleep(self.chunk_delay_s)
        finally:
            self.closed += 1

    async def _check(self, job, i):
        self.calls.append(f"check {i}")
        self.checked.append(job.pieces[i])
        self._refuse(job.pieces[i])
        return spoken(job.pieces[i])

    async def close(self):
        pass


BAD = "[bad_token]"


def spoken(text: str) -> str:
    return f"spoken: {text}"


class Served:
    def __init__(self, settings: Settings):
        import uvicorn

        self.synth = FakeSynth()
        self.port = free_port()
        self.app = create_app(settings, self.synth)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, path: str, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None):
        """(status, headers, body bytes)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()


def error_of(body: bytes) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_api_keys_are_checked_on_the_api_not_on_health_or_the_playground():
    with Served(Settings(api_keys=("k1", "k2"), stream_default=False)) as s:
        status, _, body = s.request("/v1/audio/speech", OK)
        assert status == 401 and error_of(body)["code"] == "missing_api_key"
        status, headers, body = s.request("/v1/audio/speech", OK, {"Authorization": "Bearer nope"})
        assert status == 401 and error_of(body)["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
        assert s.request("/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
        status, headers, body = s.request("/v1/audio/speech", {**OK, "response_format": "wav"},
                                          {"Authorization": "Bearer k2"})
        assert status == 200 and headers["Content-Type"] == "audio/wav" and decode(body).size == SAMPLE_RATE // 2
        assert s.request("/health")[0] == 200 and s.request("/")[0] == 200


def test_openai_client_gets_openai_errors():
    import openai

    with Served(Settings(stream_default=False, max_body_bytes=1 << 20)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:  # 10 MB of input: refused, the connection intact
            client.audio.speech.create(model="chattts", voice="alloy", input="x" * (10 << 20))
        assert e.value.body["param"] == "input" and "larger than" in e.value.body["message"]
        s.synth.error = SynthesisError("INVALID_ARGUMENT",
                                       "VOICE 'zz' is not a voice of this server; known: alloy", "VOICE")
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(model="chattts", voice="zz", input="hi")
        assert e.value.body["param"] == "voice" and "known: alloy" in e.value.body["message"]
        s.synth.error = SynthesisError("UNAVAILABLE", "server busy: 32 generations in flight, retry later")
        with pytest.raises(openai.InternalServerError) as e:
            client.audio.speech.create(model="chattts", voice="alloy", input="hi")
        assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "1"
        s.synth.error = SynthesisError("DEADLINE_EXCEEDED", "timed out")
        with pytest.raises(openai.APIStatusError) as e:
            client.audio.speech.create(model="chattts", voice="alloy", input="hi", extra_body={"stream": True})
        assert e.value.status_code == 504 and e.value.body["code"] == "timeout"


def test_overload_and_timeouts_of_the_gateway_itself():
    with Served(Settings(max_concurrency=2, timeout_s=0.5, stream_default=False)) as s:
        s.synth.delay_s = 0.3
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(s.request("/v1/audio/speech", OK)[0]))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [200, 200, 429, 429]
        s.synth.delay_s = 2.0
        status, _, body = s.request("/v1/audio/speech", OK)
        assert status == 504 and "longer than 0.5 s" in error_of(body)["message"]
        metrics = s.request("/metrics")[2].decode()
        assert 'chattts_gateway_requests_total{format="mp3",mode="whole",status="429"} 2.0' in metrics
        assert 'chattts_gateway_requests_total{format="mp3",mode="whole",status="200"} 2.0' in metrics


def test_pieces_seeds_headers_health_and_listings():
    with Served(Settings(stream_default=False)) as s:
        status, headers, _ = s.request("/v1/audio/speech", {**OK, "input": f"{S1} {S2} {S3}", "seed": 11})
        job = s.synth.jobs[-1]
        assert status == 200 and job.pieces == [S1, S2, S3] and job.seed == 11
        assert headers["X-ChatTTS-Seed"] == "11" and headers["X-ChatTTS-Pieces"] == "3"
        s.request("/v1/audio/speech", {**OK, "input": f"{S1} {S2}", "split": False})
        assert s.synth.jobs[-1].pieces == [f"{S1} {S2}"]
        voices = json.loads(s.request("/v1/audio/voices")[2])["voices"]
        assert [v["id"] for v in voices][:2] == ["alloy", "echo"] and voices[0]["source"] == "seed 2222"
        assert [m["id"] for m in json.loads(s.request("/v1/models")[2])["data"]][0] == "chattts"
        status, _, body = s.request("/v1/models/nope")
        assert status == 404 and error_of(body)["code"] == "model_not_found"
        assert s.request("/v1/nowhere")[0] == 404
        s.synth.is_ready = False
        status, _, body = s.request("/health")
        assert status == 503 and json.loads(body)["ready"]["chattts"] is False


def test_streaming_is_the_default_except_for_flac():
    with Served(Settings()) as s:
        for fmt in ("mp3", "flac", "wav"):
            assert s.request("/v1/audio/speech", {**OK, "response_format": fmt})[0] == 200
        s.request("/v1/audio/speech", {**OK, "response_format": "flac", "stream": True})
        metrics = s.request("/metrics")[2].decode()
        for fmt, mode in (("mp3", "stream"), ("flac", "whole"), ("wav", "stream"), ("flac", "stream")):
            assert f'chattts_gateway_requests_total{{format="{fmt}",mode="{mode}",status="200"}} 1.0' in metrics


@pytest.mark.parametrize("fmt", ["mp3", "pcm"])
def test_streamed_and_sse_responses(fmt):
    import base64

    with Served(Settings()) as s:
        status, headers, body = s.request("/v1/audio/speech", {**OK, "input": f"{S1} {S2}", "response_format": fmt})
        assert status == 200 and headers["Content-Type"] == CONTENT_TYPES[fmt]
        # two pieces of 0.5 s (the fake's pause: none)
        assert 0 <= decode(body, fmt).size - (SAMPLE_RATE + 0) <= 2 * 1152
        status, headers, body = s.request("/v1/audio/speech", {**OK, "response_format": fmt, "stream_format": "sse"})
        events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
        assert headers["Content-Type"].startswith("text/event-stream") and events[-1] == {"type": "speech.audio.done"}
        audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert {e["type"] for e in events[:-1]} == {"speech.audio.delta", "speech.segment"}
        assert decode(audio, fmt).size >= SAMPLE_RATE // 2


# --- documentation and make ---------------------------------------------------------------------------
def test_docs_speed_table_is_the_mapping():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "gateway.md").read_text(encoding="utf-8")
    for lo, hi, token in api.speed_table():
        assert f"| {lo:.3g} – {min(hi, 4.0):.3g} | `{token}` |" in doc


def test_make_gateway_runs_the_gateway_against_the_given_server():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-n", "gateway", "GRPC_URL=10.0.0.5:9001", "GATEWAY_PORT=9090", "REPO=/nonexistent"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if "-m gateway" in x)
    assert line.split("-m gateway", 1)[1].split() == ["--grpc-url", "10.0.0.5:9001", "--host", "127.0.0.1",
                                                      "--port", "9090"]


def _leave_early(port: int, body: dict, read: int) -> None:
    """Send a request, read `read` bytes of the answer (0: none), then close the connection."""
    import socket

    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        got = b""
        while len(got) < read:
            got += sock.recv(65536)


def _eventually(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.02)


# --- errors before the first byte, clean ends after it ----------------------------------------------------
HELD_OUT = "第一句话很好。第二句有问题[bad_token]。"  # two pieces: the second refused by the server


def metric(text: str, line_start: str) -> float:
    line = next((x for x in text.splitlines() if x.startswith(line_start)), None)
    return 0.0 if line is None else float(line.split()[-1])


@pytest.mark.parametrize("fmt, fields", [("wav", {}), ("mp3", {}), ("pcm", {}), ("ulaw", {"sample_rate": 8000}),
                                          ("pcm", {"stream_format": "sse"}), ("mp3", {"stream_format": "sse"})])
def test_text_a_later_piece_cannot_speak_is_a_400_naming_input_before_any_byte(fmt, fields):
    with Served(Settings()) as s:
        status, headers, body = s.request("/v1/audio/speech", {**OK, "input": HELD_OUT, "response_format": fmt,
                                                               "stream": True, **fields})
        err = error_of(body)
        assert status == 400 and headers["Content-Type"] == "application/json"
        assert err["param"] == "input" and "piece 2 of 2" in err["message"] and BAD in err["message"]
        assert s.synth.checked == [split_text(HELD_OUT)[1]]  # the preflight asked about the pieces after the first
        metrics = s.request("/metrics")[2].decode()
        assert metric(metrics, "chattts_gateway_stream_aborts_total") == 0.0 and s.app.state.gateway.inflight == 0


def test_one_piece_is_not_checked_apart_and_every_later_piece_is():
    with Served(Settings()) as s:
        assert s.request("/v1/audio/speech", {**OK, "response_format": "pcm"})[0] == 200
        assert s.synth.checked == []
        assert s.request("/v1/audio/speech", {**OK, "input": f"{S1} {S2} {S3}", "response_format": "pcm"})[0] == 200
        assert s.synth.checked == [S2, S3]


def test_a_stream_checks_first_and_sends_the_other_pieces_after_the_first_chunk():
    with Served(Settings()) as s:
        assert s.request("/v1/audio/speech", {**OK, "input": f"{S1} {S2} {S3}", "response_format": "pcm"})[0] == 200
        assert s.synth.calls == ["check 1", "check 2", "stream", "chunk", "infer 1", "infer 2"]


def test_a_refused_later_piece_answers_without_waiting_for_the_first_chunk_and_stops_it():
    with Served(Settings()) as s:
        s.synth.delay_s = 5.0  # the first chunk is slow
        t0 = time.monotonic()
        status, _, body = s.request("/v1/audio/speech", {**OK, "input": HELD_OUT, "response_format": "pcm"})
        assert status == 400 and error_of(body)["param"] == "input" and time.monotonic() - t0 < 2.0
        _eventually(lambda: s.synth.closed == 1 and s.app.state.gateway.inflight == 0)  # the stream was cancelled


def test_a_refused_first_piece_is_still_its_own_400():
    with Served(Settings()) as s:
        status, _, body = s.request("/v1/audio/speech", {**OK, "input": f"Bad {BAD} at once here. {S2}",
                                                         "response_format": "pcm"})
        assert status == 400 and error_of(body)["param"] == "input" and BAD in error_of(body)["message"]


async def _asgi_post(app, path: str, body: dict):
    """(status, body) of one request through the ASGI app itself, called as a server calls it: whatever the app
    raises comes out of here."""
    data = json.dumps(body).encode()
    sent: list[dict] = []
    received = asyncio.Event()
    incoming = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive():
        if incoming:
            return incoming.pop()
        await received.wait()  # the client stays until the response is complete
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            received.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    assert received.is_set(), "the response did not end"
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("error, reason", [
    (SynthesisError("UNAVAILABLE", "server busy: 32 generations in flight, retry later"), "unavailable"),
    (SynthesisError("DEADLINE_EXCEEDED", "timed out"), "deadline_exceeded"),
    (RuntimeError("a fault of the gateway's own"), "internal"),
])
@pytest.mark.parametrize("fmt, mode", [("wav", "stream"), ("mp3", "stream"), ("pcm", "stream"), ("pcm", "sse")])
def test_a_failure_after_the_first_byte_ends_the_body_cleanly_and_is_counted(fmt, mode, error, reason):
    import base64

    synth = FakeSynth()
    synth.fail_piece, synth.fail_error = 1, error
    app = create_app(Settings(), synth)
    body = {**OK, "input": f"{S1} {S2}", "response_format": fmt, "stream": True,
            **({"stream_format": "sse"} if mode == "sse" else {})}
    status, data = asyncio.run(_asgi_post(app, "/v1/audio/speech", body))  # raises if the app raised
    assert status == 200
    if mode == "sse":
        events = [json.loads(x[6:]) for x in data.decode().split("\n\n") if x.startswith("data: ")]
        assert events[-1]["type"] == "error" and "speech.audio.done" not in [e["type"] for e in events]
        assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
        data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert [e["index"] for e in events if e["type"] == "speech.segment"] == [0]  # the piece that was sent
    assert 0 <= decode(data, fmt).size - SAMPLE_RATE // 2 <= SLACK[fmt]  # the first piece, as a whole file
    gw = app.state.gateway
    metrics = gw.metrics.exposition().decode()
    assert metric(metrics, f'chattts_gateway_stream_aborts_total{{reason="{reason}"}}') == 1.0
    assert metric(metrics, f'chattts_gateway_requests_total{{format="{fmt}",mode="{mode}",status="aborted"}}') == 1.0
    assert gw.inflight == 0 and synth.closed == 1


def test_a_failed_stream_over_a_socket_reads_to_its_end():
    """Through uvicorn: the body ends as HTTP says (no IncompleteRead), a whole WAV of the first piece."""
    with Served(Settings()) as s:
        s.synth.fail_piece = 1
        status, _, body = s.request("/v1/audio/speech", {**OK, "input": f"{S1} {S2}", "response_format": "wav"})
        assert status == 200 and decode(body, "wav").size == SAMPLE_RATE // 2
        metrics = s.request("/metrics")[2].decode()
        assert metric(metrics, 'chattts_gateway_stream_aborts_total{reason="unavailable"}') == 1.0


# --- timings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [24000, 8000, 44100])
def test_sse_segments_are_each_pieces_exact_place_in_the_audio_after_its_audio(rate):
    import base64

    from gateway.audio import out_length

    with Served(Settings()) as s:
        s.synth.pause = np.zeros(4800, np.float32)  # 0.2 s
        status, _, body = s.request("/v1/audio/speech", {**OK, "input": f"{S1} {S2} {S3}", "response_format": "pcm",
                                                         "stream_format": "sse", "sample_rate": rate})
    events = [json.loads(x[6:]) for x in body.decode().split("\n\n") if x.startswith("data: ")]
    assert status == 200 and events[-1]["type"] == "speech.audio.done"
    segments, received = [], 0
    for e in events:
        if e["type"] == "speech.audio.delta":
            received += len(base64.b64decode(e["audio"])) // 2
        elif e["type"] == "speech.segment":
            # sent once its audio was (the resampler's delay)
            assert received >= e["end_sample"] - out_length(2400, rate)
            segments.append(e)
    piece, pause = SAMPLE_RATE // 2, 4800  # the stand-in's piece and the pause, at 24 kHz
    assert [seg["text"] for seg in segments] == [S1, S2, S3]
    assert [seg["spoken_text"] for seg in segments] == [spoken(S1), spoken(S2), spoken(S3)]
    for i, seg in enumerate(segments):
        start = i * (piece + pause)
        assert (seg["index"], seg["start_sample"], seg["end_sample"]) == (i, out_length(start, rate),
                                                                          out_length(start + piece, rate))
        assert seg["start"] == seg["start_sample"] / rate and seg["end"] == seg["end_sample"] / rate
    audio = decode(b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"), "pcm")
    assert audio.size == out_length(3 * piece + 2 * pause, rate)
    for a, b in pairwise(segments):  # the pause between two pieces is silence, the pieces are not
        assert np.abs(audio[a["end_sample"] + rate // 100: b["start_sample"] - rate // 100]).max() < 1e-3
        assert np.abs(audio[a["start_sample"]: a["end_sample"]]).max() > 0.3


@pytest.mark.parametrize("fmt, rate", [("wav", 24000), ("mp3", 24000), ("wav_ulaw", 8000), ("flac", 48000)])
def test_captioned_speech_is_the_audio_with_each_pieces_segment_and_subtitles(fmt, rate):
    import base64
    import re

    from gateway.audio import out_length

    text = f"{S1} {S2} Third & last [uv_break] piece, long enough to stand alone <here>."
    with Served(Settings()) as s:
        s.synth.pause = np.zeros(4800, np.float32)
        replies = {}
        for sub in (None, "srt", "vtt"):
            status, headers, body = s.request("/v1/audio/speech/captioned", {
                **OK, "input": text, "response_format": fmt, "sample_rate": rate, "seed": 5,
                **({"subtitle_format": sub} if sub else {})})
            assert status == 200 and headers["Content-Type"] == "application/json" and headers["X-ChatTTS-Seed"] == "5"
            replies[sub] = json.loads(body)
        metrics = s.request("/metrics")[2].decode()
    r = replies[None]
    assert (r["content_type"], r["response_format"], r["sample_rate"], r["seed"]) == (CONTENT_TYPES[fmt], fmt, rate, 5)
    assert "subtitles" not in r and r["samples"] == out_length(3 * 12000 + 2 * 4800, rate)
    audio = decode(base64.b64decode(r["audio"]), fmt, rate)
    assert 0 <= audio.size - r["samples"] <= SLACK[fmt]
    pieces = split_text(text)
    assert [g["text"] for g in r["segments"]] == pieces and [g["spoken_text"] for g in r["segments"]] == [
        spoken(p) for p in pieces]
    assert [(g["start_sample"], g["end_sample"]) for g in r["segments"]] == [
        (out_length(i * 16800, rate), out_length(i * 16800 + 12000, rate)) for i in range(3)]
    srt, vtt = replies["srt"]["subtitles"], replies["vtt"]["subtitles"]
    cues = srt.strip().split("\n\n")
    assert len(cues) == 3
    for n, (cue, g) in enumerate(zip(cues, r["segments"], strict=True), 1):
        number, times, words = cue.split("\n")
        start, end = re.fullmatch(r"(\d\d:\d\d:\d\d,\d{3}) --> (\d\d:\d\d:\d\d,\d{3})", times).groups()
        assert int(number) == n and start == _clock(g["start"], ",") and end == _clock(g["end"], ",")
    assert words == "Third & last piece, long enough to stand alone <here>."  # no control token in a subtitle
    assert vtt.startswith("WEBVTT\n\n") and "-->" in vtt and "," not in vtt.split("\n")[2]
    assert "Third &amp; last piece, long enough to stand alone &lt;here&gt;." in vtt
    assert f"{_clock(r['segments'][1]['start'], '.')} --> {_clock(r['segments'][1]['end'], '.')}\n{S2}" in vtt
    assert f'chattts_gateway_requests_total{{format="{fmt}",mode="captioned",status="200"}} 3.0' in metrics


def _clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def test_subtitle_clock_past_an_hour_and_a_piece_with_nothing_to_show():
    from gateway.captions import subtitles

    segs = [{"text": "[laugh]", "start": 0.0, "end": 1.0},
            {"text": "a\n\nb", "start": 3723.4567, "end": 3725.0}]
    assert subtitles(segs, "srt") == "1\n01:02:03,457 --> 01:02:05,000\na b\n"
    assert subtitles(segs, "vtt") == "WEBVTT\n\n01:02:03.457 --> 01:02:05.000\na b\n"


def test_captioned_errors_are_openai_errors_naming_the_field():
    with Served(Settings()) as s:
        status, _, body = s.request("/v1/audio/speech/captioned", {**OK, "subtitle_format": "ass"})
        assert status == 400 and error_of(body)["param"] == "subtitle_format"
        s.synth.error = SynthesisError("INVALID_ARGUMENT", "VOICE 'zz' is not a voice of this server", "VOICE")
        status, _, body = s.request("/v1/audio/speech/captioned", OK)
        assert status == 400 and error_of(body)["param"] == "voice"


def test_a_client_that_leaves_stops_its_synthesis_and_its_stream():
    with Served(Settings(stream_default=False)) as s:
        gw = s.app.state.gateway
        s.synth.delay_s = 5.0
        _leave_early(s.port, OK, 0)  # gone before the audio exists
        _eventually(lambda: s.synth.cancelled == 1 and gw.inflight == 0)
        s.synth.delay_s, s.synth.chunk_delay_s = 0.0, 5.0
        _leave_early(s.port, {**OK, "input": f"{S1} {S2} {S3}", "stream": True, "response_format": "pcm"}, 1)
        _eventually(lambda: s.synth.closed == 1 and gw.inflight == 0)  # gone mid-stream
        metrics = s.request("/metrics")[2].decode()
        assert 'status="499"} 1.0' in metrics and 'mode="stream",status="aborted"} 1.0' in metrics


def test_command_line_binds_loopback_unless_told_and_guards_a_public_host(tmp_path, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    from gateway.__main__ import api_keys, build_parser, is_loopback

    a = build_parser().parse_args([])
    assert a.host == "127.0.0.1" and is_loopback(a.host) and is_loopback("::1") and not is_loopback("0.0.0.0")
    keys = tmp_path / "keys"
    keys.write_text("k2\n\nk3\n")
    monkeypatch.setenv("CHATTTS_GATEWAY_API_KEYS", "k4, k5")
    assert api_keys(build_parser().parse_args(["--api-key", "k1", "--api-key-file",
                                               str(keys)])) == ["k1", "k2", "k3", "k4", "k5"]
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in __import__("os").environ.items() if k != "CHATTTS_GATEWAY_API_KEYS"}
    run = subprocess.run([sys.executable, "-m", "gateway", "--host", "0.0.0.0", "--require-api-key"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--require-api-key" in run.stderr and "CHATTTS_GATEWAY_API_KEYS" in run.stderr


def test_command_line_keeps_idle_connections_longer_than_client_pools(monkeypatch):
    """uvicorn's own 5-s keep-alive can close a pooled connection as a client reuses it ("Server
    disconnected"): idle connections stay 75 s unless told; 0 is refused."""
    import uvicorn

    from gateway.__main__ import main

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    assert main([]) == 0 and seen["timeout_keep_alive"] == 75.0
    assert main(["--keep-alive-s", "5"]) == 0 and seen["timeout_keep_alive"] == 5.0
    with pytest.raises(SystemExit) as e:
        main(["--keep-alive-s", "0"])
    assert e.value.code == 2


def test_the_gateway_runs_two_processes_unless_told(monkeypatch):
    """The default is two worker processes (one event loop under load makes requests wait); --workers 1 serves
    from this process, its app built here."""
    import uvicorn

    from gateway.__main__ import main

    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append((app, kw)))
    assert main([]) == 0 and main(["--workers", "1"]) == 0
    (default_app, default), (one_app, one) = runs
    assert default_app == "gateway.app:app_from_env" and default["workers"] == 2 and default["factory"]
    assert not isinstance(one_app, str) and "workers" not in one


def test_command_line_with_workers_hands_every_setting_to_the_worker_processes(monkeypatch, tmp_path):
    """`--workers N`: uvicorn starts N processes from the app factory, which rebuild the parent's settings from
    the environment; their metrics meet in a folder of the run's own, removed at the end; 0 workers is refused."""
    import os

    import uvicorn

    from gateway.__main__ import main
    from gateway.app import SETTINGS_ENV, Settings, app_from_env
    from gateway.metrics import MULTIPROC_ENV

    seen = {}

    def run(app, **kw):
        seen.update(kw, app=app, settings=Settings.from_json(os.environ[SETTINGS_ENV]),
                    folder=os.environ[MULTIPROC_ENV])
        assert Path(seen["folder"]).is_dir()

    monkeypatch.setattr(uvicorn, "run", run)
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    monkeypatch.setenv("CHATTTS_GATEWAY_API_KEYS", "k1")
    assert main(["--workers", "3", "--grpc-url", "h:1", "--max-concurrency", "7", "--pause-ms", "0",
                 "--no-stream-default"]) == 0
    assert seen["app"] == "gateway.app:app_from_env" and seen["factory"] and seen["workers"] == 3
    assert seen["settings"] == Settings(grpc_url="h:1", api_keys=("k1",), max_concurrency=7, pause_ms=0,
                                        stream_default=False)
    assert not Path(seen["folder"]).exists()  # the run's own folder goes with it
    assert MULTIPROC_ENV not in os.environ and SETTINGS_ENV not in os.environ  # nor leaks into what starts later
    assert callable(app_from_env)
    with pytest.raises(SystemExit) as e:
        main(["--workers", "0"])
    assert e.value.code == 2


def test_settings_travel_to_worker_processes_unchanged(tmp_path):
    from gateway.app import Settings

    s = Settings(grpc_url="x:2", repo=tmp_path, api_keys=("a", "b"), timeout_s=1.5, channels=3, max_concurrency=9,
                 piece_concurrency=2, pause_ms=50, stream_default=False, max_body_bytes=10)
    assert Settings.from_json(s.to_json()) == s and Settings.from_json(Settings().to_json()) == Settings()


def test_without_pyav_the_ffmpeg_formats_are_refused_naming_the_field(monkeypatch):
    """A host without PyAV (a GPU host carrying only the wheels it needs) serves what libsndfile and numpy
    write; a format that needs FFmpeg is a 400 naming response_format and what is available, not a 500."""
    import gateway.app as gapp

    monkeypatch.setattr(gapp, "pyav_available", lambda: False)
    with Served(Settings(stream_default=False)) as s:
        for body, ok in (({**OK, "response_format": "mp3"}, False), ({**OK, "response_format": "wav"}, True),
                         ({**OK, "response_format": "flac"}, True),
                         ({**OK, "response_format": "pcm", "stream": True}, True),
                         ({**OK, "response_format": "wav", "stream": True}, False)):
            status, _, data = s.request("/v1/audio/speech", body)
            if ok:
                assert status == 200, (body, data[:200])
            else:
                err = error_of(data)
                assert status == 400 and err["param"] == "response_format" and "PyAV" in err["message"], (body, err)
                assert "available: " in err["message"] and "mp3" not in err["message"].split("available: ")[1]


# --- a voice in the request: reference audio, mixes (docs/gateway.md#voices) ----------------------------
def wav_base64(seconds: float = 1.0, rate: int = 16000, fmt: str = "WAV") -> str:
    import base64
    import io

    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, 0.3 * np.sin(2 * np.pi * 220 * t), rate, format=fmt)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def test_a_voice_of_reference_audio_becomes_speaker_audio_and_speaker_text():
    b64 = wav_base64(1.0, 16000)
    req = parse(voice={"audio": b64, "transcript": "参考音频"})
    assert isinstance(req.voice, api.VoiceAudio) and api.voice_name(req) is None
    assert "voice" not in api.contract_options(req)
    job = asyncio.run(api.speech_job(req))
    wav = job.options["speaker_audio"]
    assert job.options["speaker_text"] == "参考音频" and wav.dtype == np.float32 and wav.size == SAMPLE_RATE
    import base64
    import io

    from chattts_triton.runtime.voices import decode_reference_audio

    assert np.array_equal(wav, decode_reference_audio(io.BytesIO(base64.b64decode(b64))))  # as the voices CLI reads it
    url = asyncio.run(api.speech_job(parse(voice={"audio": "data:audio/flac;base64," + wav_base64(1.0, 48000, "FLAC"),
                                                  "transcript": "x"})))
    assert abs(url.options["speaker_audio"].size - SAMPLE_RATE) <= 1
    # an SSML <voice> speaks in that voice, without the request's reference audio
    ssml_job = asyncio.run(api.speech_job(parse(voice={"audio": b64, "transcript": "hi"},
                                                input='<speak>One. <voice name="nova">Two.</voice></speak>')))
    assert np.array_equal(ssml_job.piece_options(0)["speaker_audio"], wav)
    assert ssml_job.piece_options(1)["voice"] == "nova" and ssml_job.piece_options(1)["speaker_audio"] is None
    from client.contract import build_inputs

    assert "SPEAKER_AUDIO" not in build_inputs("Two.", ssml_job.piece_options(1))


def speech_job_error(voice) -> api.APIError:
    with pytest.raises(api.APIError) as e:
        asyncio.run(api.speech_job(parse(voice=voice)))
    return e.value


@pytest.mark.parametrize("voice, param, words", [
    ({"audio": "!!!not base64!!!", "transcript": "x"}, "voice.audio", "not base64"),
    ({"audio": "", "transcript": "x"}, "voice.audio", "empty"),
    ({"audio": __import__("base64").b64encode(b"hello world, no audio " * 40).decode(), "transcript": "x"},
     "voice.audio",
     "not readable audio"),
    ({"audio": "data:image/png;base64,iVBORw0KGgo=", "transcript": "x"}, "voice.audio",
     "data URL of 'image/png', not audio"),
    ({"audio": "data:audio/wav,RIFF", "transcript": "x"}, "voice.audio", "must be base64"),
    ({"audio": "data:audio/wav;base64," + __import__("base64").b64encode(b"\x89PNG\r\n\x1a\n" + bytes(3000)).decode(),
      "transcript": "x"}, "voice.audio", "not a recording in a common audio format"),
    ({"audio": "WAVE", "transcript": "  "}, "voice.transcript", "empty"),
    ({"audio": "WAVE"}, "voice.transcript", "'voice.transcript' is a required property"),
    ({"transcript": "x", "audio": 5}, "voice.audio", "valid string"),
    ({"audio": "WAVE", "transcript": "x", "format": "wav"}, "voice.format", "Extra inputs"),
    ({"audio": "WAVE", "transcript": "x" * (LIMITS.max_text_chars + 1)}, "voice.transcript", "at most"),
])
def test_bad_voice_audio_is_a_400_naming_the_field(voice, param, words):
    e = speech_job_error(voice)
    assert e.status == 400 and e.param == param and words in e.message, e.message


def test_voice_audio_too_short_too_long_or_too_large_is_a_400_naming_voice_audio():
    e = speech_job_error({"audio": wav_base64(0.05), "transcript": "x"})
    assert e.param == "voice.audio" and "'voice.audio' is too short" in e.message
    e = speech_job_error({"audio": wav_base64(16.0, 8000), "transcript": "x"})
    assert e.param == "voice.audio" and "longer than 15 s" in e.message
    e = speech_job_error({"audio": "A" * (api.MAX_VOICE_AUDIO_BASE64 + 1), "transcript": "x"})
    assert e.param == "voice.audio" and e.code == "voice_audio_too_large"


@pytest.mark.parametrize("voice, words", [
    ("2222*-0.7+nova*0.3", "weight '-0.7'"),
    ("2222*nan+nova", "weight 'nan'"),
    ("2222+", "term 2 of the voice mix '2222+' is empty"),
    ("+".join(["nova"] * 1000), "1000 terms, more than 16"),
    ("nova(1", "is not NAME"),
])
def test_a_bad_mix_is_a_400_naming_voice_before_the_server_is_asked(voice, words):
    with pytest.raises(api.APIError) as e:
        parse(voice=voice)
    assert e.value.status == 400 and e.value.param == "voice" and words in e.value.message
    assert api.contract_options(parse(voice="2222*0.7+nova*0.3"))["voice"] == "2222*0.7+nova*0.3"  # the server mixes
    assert api.contract_options(parse(voice={"id": "a(2)+b(1)"}))["voice"] == "a(2)+b(1)"


def test_the_body_limit_makes_room_for_voice_audio_only():
    with Served(Settings(stream_default=False, max_body_bytes=1 << 16)) as s:
        audio = wav_base64(10.0, 48000)  # ~1.3 MB of base64: over the plain limit
        status, _, _ = s.request("/v1/audio/speech", {**OK, "voice": {"audio": audio, "transcript": "x"}})
        assert status == 200 and s.synth.jobs[-1].options["speaker_audio"].size == 10 * SAMPLE_RATE
        status, _, body = s.request("/v1/audio/speech", {**OK, "input": "x" * 4000, "instructions": "y" * 200_000})
        assert status == 400 and error_of(body)["param"] == "input" and "larger than 65536" in error_of(body)["message"]
        sneaked = {**OK, "instructions": "y" * 200_000, "voice": {"audio": audio[:2000], "transcript": "x"}}
        status, _, body = s.request("/v1/audio/speech", sneaked)  # the audio's room is for the audio only
        assert status == 400 and error_of(body)["param"] == "input" and "larger than 65536" in error_of(body)["message"]
        huge = {**OK, "voice": {"audio": "A" * (50 << 20), "transcript": "x"}}  # 50 MB of base64
        status, _, body = s.request("/v1/audio/speech", huge)
        assert (status == 400 and error_of(body)["param"] == "voice.audio"
                and error_of(body)["code"] == "voice_audio_too_large")
        status, _, body = s.request("/v1/audio/speech",
                                    {**OK, "voice": {"audio": "bm9pc2Uh" * 1000, "transcript": "x"}})
        assert status == 400 and error_of(body)["param"] == "voice.audio"
        assert s.request("/health")[0] == 200


def test_vllm_omnis_ref_audio_and_ref_text_are_the_voice_and_its_errors_name_them():
    b64 = wav_base64(1.0, 16000)
    req = parse(ref_audio="data:audio/wav;base64," + b64, ref_text="参考音频")  # `voice` ("alloy") gives way
    assert isinstance(req.voice, api.VoiceAudio) and req.voice.transcript == "参考音频"
    job = asyncio.run(api.speech_job(req))
    assert job.options["speaker_text"] == "参考音频" and job.options["speaker_audio"].size == SAMPLE_RATE
    for fields, param, words in [
        ({"ref_audio": b64}, "ref_text", "'ref_text' is a required property"),
        ({"ref_text": "hi"}, "ref_audio", "'ref_text' goes with 'ref_audio'"),
        ({"ref_audio": b64, "ref_text": "hi", "voice": {"audio": b64, "transcript": "hi"}}, "ref_audio", "not both"),
        ({"ref_audio": 5, "ref_text": "hi"}, "ref_audio", "valid string"),
        ({"ref_audio": b64, "ref_text": " "}, "ref_text", "'ref_text' is empty"),
        ({"ref_audio": "https://example.com/ref.wav", "ref_text": "hi"}, "ref_audio", "fetches nothing"),
    ]:
        with pytest.raises(api.APIError) as e:
            parse(**fields)
        assert e.value.param == param and words in e.value.message, (fields, e.value.message)
    with pytest.raises(api.APIError) as e:
        asyncio.run(api.speech_job(parse(ref_audio=wav_base64(0.05), ref_text="hi")))
    assert e.value.param == "ref_audio" and "'ref_audio' is too short" in e.value.message
    with Served(Settings(stream_default=False, max_body_bytes=1 << 16)) as s:
        status, _, body = s.request("/v1/audio/speech", {**OK, "ref_audio": "A" * (20 << 20), "ref_text": "x"})
        assert status == 400 and error_of(body)["param"] == "ref_audio"


# --- dialogue (docs/gateway.md#dialogue) ------------------------------------------------------------------
DIALOGUE = {**OK, "input_format": "dialogue", "voices": {"A": "2222", "B": "nova*0.5+alloy*0.5"},
            "input": f"A: {S1} {S2}\n\nB: Hi there.\n  A：好的：10:30见。"}


def dialogue_job(**fields) -> Job:
    return asyncio.run(api.speech_job(api.parse(json.dumps({**DIALOGUE, **fields}).encode())))


def test_a_dialogue_speaks_each_line_in_its_voice_with_the_line_pause_between_lines():
    job = dialogue_job(seed=5)
    assert job.pieces == [S1, S2, "Hi there.", "好的：10:30见。"]  # a line's own colons are its text
    options = [job.piece_options(i) for i in range(len(job.pieces))]
    assert [o["voice"] for o in options] == ["2222", "2222", "nova*0.5+alloy*0.5", "2222"]
    assert [o["seed"] for o in options] == [5, 6, 7, 8] and all(o["prompt"] == "[speed_5]" for o in options)
    assert job.gaps_ms == [0, None, api.DIALOGUE_PAUSE_MS, api.DIALOGUE_PAUSE_MS, 0]  # a line's pieces: the usual pause
    assert dialogue_job(line_pause_ms=0).gaps_ms == [0, None, 0, 0, 0]
    assert dialogue_job(split=False).pieces == [f"{S1} {S2}", "Hi there.", "好的：10:30见。"]
    # the request's voice is not spoken, a voice of reference audio neither (nor decoded)
    job = dialogue_job(voice={"audio": "AAAA", "transcript": "x"})
    assert all(job.piece_options(i)["speaker_audio"] is None for i in range(4))
    # a plain text with colons is never a dialogue
    assert asyncio.run(api.speech_job(parse(input="A: hello there.\nB: and you."))).piece_extras is None


@pytest.mark.parametrize("fields, param, words", [
    ({"voices": None}, "voices", "needs 'voices'"),
    ({"voices": {}}, "voices", "needs 'voices'"),
    ({"voices": {"A": 5}}, "voices", "valid string"),
    ({"voices": ["alloy"]}, "voices", "should be an object"),
    ({"voices": {"A": " ", "B": "x"}}, "voices", "'voices.A' is empty"),
    ({"voices": {"A:B": "alloy"}}, "voices", "speaker label is 1-64 characters"),
    ({"voices": {" ": "alloy"}}, "voices", "speaker label is 1-64 characters"),
    ({"voices": {"x" * 65: "alloy"}}, "voices", "speaker label is 1-64 characters"),
    ({"voices": {f"S{i}": "alloy" for i in range(17)}}, "voices", "17 speakers, more than 16"),
    ({"voices": {"A": "a++b", "B": "x"}}, "voices", "'voices.A': term 2"),
    ({"input": "A: Hello.\nHow are you?"}, "input", "line 2 ('How are you?') has no speaker label"),
    ({"input": "A: Hello.\nC: Who?"}, "input", "speaker 'C' is not in 'voices' (known: A, B)"),
    ({"input": "a: Hello."}, "input", "speaker 'a' is not in 'voices'"),
    ({"input": "A: Hello.\nB:"}, "input", "line 2 ('B:') has nothing to speak"),
    ({"input": "A: ...\nB: Hi."}, "input", "line 1 ('A: ...') has nothing to speak"),
    ({"input": "\n".join(["A: Hi."] * 65)}, "input", "more than 64 lines"),
    ({"input": "\n \n"}, "input", "'input' is empty"),
    ({"input": "<speak>A: hi</speak>"}, "input", "speaker '<speak>A' is not in 'voices'"),  # no SSML here
    ({"line_pause_ms": -1}, "line_pause_ms", "greater than or equal to 0"),
    ({"line_pause_ms": 5001}, "line_pause_ms", "less than or equal to 5000"),
    ({"line_pause_ms": "400"}, "line_pause_ms", "valid integer"),
    ({"input_format": "script"}, "input_format", "'text' or 'dialogue'"),
    ({"input_format": "text"}, "voices", "'voices' goes with \"input_format\": \"dialogue\""),
])
def test_a_bad_dialogue_is_a_400_naming_the_field(fields, param, words):
    with pytest.raises(api.APIError) as e:
        api.parse(json.dumps({**DIALOGUE, **fields}).encode())
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_a_dialogue_line_over_the_limit_with_split_false_is_a_400_naming_input():
    with pytest.raises(api.APIError) as e:
        dialogue_job(input="A: Hi.\nB: " + "word " * 450, split=False)
    assert e.value.param == "input" and "each line of the dialogue must be at most 2000" in e.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_dialogue_is_one_audio_whole_and_streamed_with_each_lines_segment(stream):
    import base64

    with Served(Settings(stream_default=stream)) as s:
        s.synth.pause = np.zeros(SAMPLE_RATE // 10, np.float32)  # --pause-ms 100, between a line's pieces
        status, headers, body = s.request("/v1/audio/speech",
                                          {**DIALOGUE, "response_format": "pcm", "line_pause_ms": 300})
        assert status == 200 and headers["X-ChatTTS-Pieces"] == "4"
        piece, pause, line = SAMPLE_RATE // 2, SAMPLE_RATE // 10, int(0.3 * SAMPLE_RATE)
        audio = np.frombuffer(body, "<i2")
        assert audio.size == 4 * piece + pause + 2 * line
        starts = [0, piece + pause, 2 * piece + pause + line, 3 * piece + pause + 2 * line]
        for a, b in pairwise(starts):
            assert audio[a:a + piece].any() and not audio[a + piece:b].any()
        s.synth.calls.clear()
        status, _, body = s.request("/v1/audio/speech", {**DIALOGUE, "response_format": "pcm", "stream_format": "sse"})
        events = [json.loads(x[6:]) for x in body.decode().split("\n\n") if x.startswith("data: ")]
        assert status == 200 and [e["text"] for e in events if e["type"] == "speech.segment"] == dialogue_job().pieces
        assert sum(len(base64.b64decode(e["audio"])) for e in events if e["type"] == "speech.audio.delta") == \
            2 * (4 * piece + pause + 2 * api.DIALOGUE_PAUSE_MS * SAMPLE_RATE // 1000)
        assert s.synth.calls[:3] == ["check 1", "check 2", "check 3"]  # every line checked before a stream starts
        status, _, body = s.request("/v1/audio/speech", {**DIALOGUE, "input": f"A: Fine.\nB: Bad {BAD} line here."})
        assert status == 400 and error_of(body)["param"] == "input" and BAD in error_of(body)["message"]


# --- one speaker across pieces; conditioning on the first piece -------------------------------------------
@pytest.mark.parametrize("voice", ["alloy", "2222", "2222*0.7+nova*0.3", {"id": "nova"}])
def test_every_piece_of_a_long_input_speaks_in_the_requests_voice(voice):
    """Only the seed differs between pieces: the speaker (a seed voice too) is the request's, fixed once for it. A
    request without a voice is refused (OpenAI's body requires one); a realtime session without one speaks in its seed's
    voice for every piece (tests/test_gateway_realtime.py)."""
    job = asyncio.run(api.speech_job(parse(input=f"{S1} {S2} {S3}", voice=voice)))
    options = [job.piece_options(i) for i in range(3)]
    assert len({json.dumps({k: v for k, v in o.items() if k != "seed"}, sort_keys=True) for o in options}) == 1
    assert options[0]["voice"] == (voice["id"] if isinstance(voice, dict) else voice)
    assert not job.condition_on_first and all("speaker_audio" not in o for o in options)  # off by default


@pytest.mark.parametrize("stream", [False, True])
def test_condition_on_first_piece_sends_the_first_pieces_audio_as_the_later_pieces_reference(stream):
    with Served(Settings(stream_default=stream)) as s:
        text = f"{S1} {S2} {S3}"
        assert s.request("/v1/audio/speech", {**OK, "input": text, "response_format": "pcm"})[0] == 200
        job = s.synth.jobs[-1]
        assert job.reference is None and all("speaker_audio" not in job.piece_options(i) for i in range(3))
        status, _, body = s.request("/v1/audio/speech", {**OK, "input": text, "response_format": "pcm",
                                                         "condition_on_first_piece": True})
        job = s.synth.jobs[-1]
        assert status == 200 and job.condition_on_first and len(body) == 2 * 3 * (SAMPLE_RATE // 2)
        audio, spoken_first = job.reference
        assert np.array_equal(to_int16(audio), np.frombuffer(body, "<i2")[:SAMPLE_RATE // 2])  # the first piece's audio
        assert spoken_first == spoken(S1)  # its SPOKEN_TEXT is the reference's transcript
        for i in (1, 2):
            o = job.piece_options(i)
            assert o["speaker_audio"] is audio and o["speaker_text"] == spoken(S1) and o["voice"] == "alloy"
        assert "speaker_audio" not in job.piece_options(0)
        if stream:  # the others wait for the whole first piece
            assert s.synth.calls[-3:] == ["chunk", "infer 1", "infer 2"]
        else:
            assert s.synth.calls[-3:] == ["infer 0", "infer 1", "infer 2"]


def test_condition_on_first_piece_only_where_a_piece_speaks_in_the_first_pieces_voice():
    job = dialogue_job(condition_on_first_piece=True)
    assert job.conditions
    job.set_reference(tone(1.0), "first")
    assert [job.conditioned(i) for i in range(4)] == [False, True, False, True]  # B's line keeps its own voice
    job = asyncio.run(api.speech_job(parse(input=f"{S1} {S2}", voice={"audio": wav_base64(), "transcript": "x"},
                                           condition_on_first_piece=True)))
    assert not job.conditions  # a voice of reference audio is already every piece's reference
    job = Job([S1, S2], {"voice": "alloy"}, condition_on_first=True)
    job.set_reference(tone(15.5), "too long")
    assert job.reference is None and not job.conditioned(1)  # past SPEAKER_AUDIO's 15 s: nothing conditioned
    job.set_reference(tone(0.05), "too short")
    assert job.reference is None


def test_a_conditioned_piece_in_a_voice_of_a_recording_is_sent_as_it_is():
    """A stored voice with reference audio refuses a second reference: the piece goes again without it."""
    sent: list[dict[str, Any]] = []

    class Client:
        async def infer_one(self, text, options, spoken_text=False):
            sent.append(options)
            if options.get("speaker_audio") is not None:
                raise ChatTTSError("INVALID_ARGUMENT",
                                   "in ensemble 'chattts', VOICE 'reader' holds a reference sample: "
                                   "give VOICE or SPEAKER_AUDIO, not both")
            return (tone(0.5), text) if spoken_text else tone(0.5)

    synth = Synthesizer("127.0.0.1:1")
    synth._client = Client()
    job = Job([S1, S2], {"voice": "reader"}, seed=1, condition_on_first=True)
    audio = asyncio.run(synth.synthesize(job))
    assert audio.size == SAMPLE_RATE + synth.pause.size
    assert [o.get("speaker_audio") is not None for o in sent] == [False, True, False]
    sent.clear()
    with pytest.raises(SynthesisError) as e:  # without the option that refusal is no one's to undo
        asyncio.run(synth.synthesize(Job([S1, S2], {"voice": "reader", "speaker_audio": tone(1.0)}, seed=1)))
    assert e.value.status == "INVALID_ARGUMENT" and e.value.field == "VOICE" and len(sent) == 2


def test_a_captioned_dialogue_places_each_line_after_its_pause():
    with Served(Settings()) as s:
        status, _, body = s.request("/v1/audio/speech/captioned", {**DIALOGUE, "response_format": "pcm",
                                                                   "line_pause_ms": 250})
    reply, piece, line = json.loads(body), SAMPLE_RATE // 2, SAMPLE_RATE // 4
    assert status == 200 and reply["samples"] == 4 * piece + 2 * line  # the stand-in's pause between pieces: none
    assert [(g["text"], g["start_sample"]) for g in reply["segments"]] == [
        (S1, 0), (S2, piece), ("Hi there.", 2 * piece + line), ("好的：10:30见。", 3 * piece + 2 * line)]
