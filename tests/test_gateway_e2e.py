"""The speech gateway (`python -m gateway`) in front of a real tritonserver (`served_tiny`: tiny weights on CPU),
called by OpenAI's own Python client and by Chromium: every format decoded back by FFmpeg and compared with
the audio the same call gives over gRPC, streams, server-sent events, long text, named voices, the error
bodies, and the browser playground."""

from __future__ import annotations

import base64
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from chattts_triton.config import SAMPLE_RATE, samples_for_codes
from chattts_triton.launcher.tritonserver import free_port, set_parent_death_signal
from client import ChatTTSClient
from gateway.audio import FORMATS, SAMPLE_RATES, check, decode, encode, out_length, to_int16

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 20
FIXED = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS}
N = samples_for_codes(TOKENS)
PAUSE = int(0.2 * SAMPLE_RATE)  # the gateway's default pause between pieces
SLACK = {"mp3": 2 * 1152, "aac": 2 * 1024}  # priming and padding a decoder of a stream (or of ADTS) keeps
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def gateway(served_tiny, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--grpc-url", served_tiny.grpc_url, "--port",
                                 str(port),
                                 "--repo", str(served_tiny.model_repository)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT,
                                preexec_fn=set_parent_death_signal)  # no gateway outlives an interrupted run
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not _healthy(url):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield url
    proc.terminate()
    code = proc.wait(30)  # uvicorn shuts down, then ends by the signal it got
    assert code in (0, -15) and "Application shutdown complete" in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def oai(gateway):
    import openai

    return openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def grpc(served_tiny):
    with ChatTTSClient(served_tiny.grpc_url) as c:
        yield c


def samples16(decoded: np.ndarray) -> np.ndarray:
    return np.round(decoded * 32768).astype(np.int16)


def check_decoded(fmt: str, decoded: np.ndarray, expected: np.ndarray, exact_length: bool) -> None:
    """Lossless formats carry the expected samples; lossy ones its length (exactly where the file says it)."""
    if fmt in ("pcm", "wav", "flac"):
        assert np.array_equal(samples16(decoded), to_int16(expected))
    elif exact_length and fmt != "aac":
        assert decoded.size == expected.size
    else:
        assert 0 <= decoded.size - expected.size <= SLACK.get(fmt, 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_speech_create_in_every_format_is_the_audio_of_the_same_grpc_call(oai, grpc, fmt):
    response = oai.audio.speech.create(model="chattts", voice="alloy", input="Hello world.", response_format=fmt,
                                       extra_body={**FIXED, "seed": 7, "stream": False})
    assert response.response.headers["x-chattts-seed"] == "7"
    expected = grpc.synthesize("Hello world.", voice="alloy", seed=7, prompt="[speed_5]", **FIXED)
    assert expected.size == N
    check_decoded(fmt, decode(response.content, fmt), expected, exact_length=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_speech_is_the_stream_of_the_same_grpc_call(oai, grpc, fmt):
    with oai.audio.speech.with_streaming_response.create(model="chattts", voice="nova", input="你好，世界。",
                                                          response_format=fmt,
                                                         extra_body={**FIXED, "seed": 3, "stream": True}) as r:
        parts = list(r.iter_bytes())
    expected = np.concatenate(list(grpc.stream("你好，世界。", voice="nova", seed=3, prompt="[speed_5]", **FIXED)))
    check_decoded(fmt, decode(b"".join(parts), fmt), expected, exact_length=False)


def test_sse_events_carry_the_stream(oai, grpc):
    with oai.audio.speech.with_streaming_response.create(model="chattts", voice="echo", input="Hello.",
                                                         response_format="pcm",
                                                          stream_format="sse", extra_body={**FIXED, "seed": 5}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta", "speech.segment"}
    assert [e["index"] for e in events if e["type"] == "speech.segment"] == [0]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    expected = np.concatenate(list(grpc.stream("Hello.", voice="echo", seed=5, prompt="[speed_5]", **FIXED)))
    assert np.array_equal(np.frombuffer(audio, "<i2"), to_int16(expected))


@pytest.mark.parametrize("stream", [False, True])
def test_long_text_is_spoken_in_pieces_with_one_voice_and_the_seed_schedule(oai, grpc, stream):
    text = "The first sentence. Then a second one. 最后是第三句。"
    with oai.audio.speech.with_streaming_response.create(model="chattts", voice="fable", input=text,
                                                         response_format="pcm",
                                                          extra_body={**FIXED, "seed": 40, "stream": stream}) as r:
        assert r.headers["x-chattts-pieces"] == "3"
        audio = np.frombuffer(r.read(), "<i2")
    assert audio.size == 3 * N + 2 * PAUSE
    pieces = ["The first sentence.", "Then a second one.", "最后是第三句。"]
    for i, piece in enumerate(pieces):
        got = audio[i * (N + PAUSE): i * (N + PAUSE) + N]
        if i == 0 and stream:  # the first piece is streamed by chattts_stream
            expected = np.concatenate(list(grpc.stream(piece, voice="fable", seed=40, prompt="[speed_5]", **FIXED)))
        else:
            expected = grpc.synthesize(piece, voice="fable", seed=40 + i, prompt="[speed_5]", **FIXED)
        # the same tokens; pieces batched together may round in the last bits (≤ 1e-5, test_e2e_serving): ≤ 1 LSB
        assert np.abs(got.astype(np.int32) - to_int16(expected)).max() <= 1, i
        if i:
            assert not audio[i * (N + PAUSE) - PAUSE: i * (N + PAUSE)].any()  # the pause


@pytest.mark.parametrize("body, param, words", [
    ({"voice": "no-such-voice"}, "voice", "known: alloy, echo, fable, nova, onyx, shimmer"),
    ({"input": ""}, "input", "empty"),
    ({"input": "x" * (10 << 20)}, "input", "larger than"),
    ({"response_format": "ogg"}, "response_format", "'mp3', 'opus'"),
    ({"speed": 4.01}, "speed", "less than or equal to 4"),
    ({"speed": "fast"}, "speed", "valid number"),
    ({"input": ["a"]}, "input", "valid string"),
    ({"input": "hi [not_a_token]"}, "input", "not_a_token"),
    ({"temperature": 500}, "temperature", "less than or equal to 100"),
])
def test_bad_bodies_get_openai_400s_naming_the_field(gateway, body, param, words):
    full = {"model": "chattts", "input": "Hello.", "voice": "alloy", "stream": False, **FIXED, **body}
    req = urllib.request.Request(gateway + "/v1/audio/speech", data=json.dumps(full).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def post(gateway: str, path: str, body: dict):
    """(status, headers, body) of one request, the whole body read (http.client: a cut body raises)."""
    host, port = gateway[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


HELD_OUT = "第一句话很好。第二句有问题[bad_token]。"


@pytest.mark.parametrize("fields", [{"response_format": "wav"}, {"response_format": "mp3"}, {"response_format": "pcm"},
                                    {"response_format": "pcm", "stream_format": "sse"}, {"stream": False}])
def test_text_a_later_piece_cannot_speak_is_a_400_naming_input_before_any_byte(gateway, fields):
    """The server's chattts_preprocess refuses the second piece's token; streamed, that comes before the first
    piece's audio as the same 400 a whole request gets."""
    body = {"model": "chattts", "input": HELD_OUT, "voice": "alloy", "stream": True, **FIXED, **fields}
    status, headers, data = post(gateway, "/v1/audio/speech", body)
    assert status == 400 and headers["Content-Type"] == "application/json", data[:200]
    error = json.loads(data)["error"]
    assert error["param"] == "input" and "bad_token" in error["message"]
    assert fields.get("stream") is False or "piece 2 of 2" in error["message"]


def _whole_and_streamed(fmt: str):
    whole = [(fmt, False)]
    streamed = [(fmt, True)] if fmt in ("pcm", "ulaw", "wav_alaw", "mp3", "opus") else []
    return whole + streamed


def same_raw(got: bytes, ref: bytes, fmt: str) -> bool:
    """Raw pcm / G.711 of the same audio: equal, or off by one step of the format (16-bit samples for pcm, one code
    for G.711) in at most one sample in a thousand, where the server's float audio differed in its last bits."""
    if len(got) != len(ref):
        return False
    dtype = np.int16 if fmt == "pcm" else np.uint8
    a, b = np.frombuffer(got, dtype).astype(np.int32), np.frombuffer(ref, dtype).astype(np.int32)
    diff = np.abs(a - b)
    return int(diff.max(initial=0)) <= 1 and np.count_nonzero(diff) <= max(1, a.size // 1000)


def same_audio(got: np.ndarray, ref: np.ndarray, fmt: str) -> bool:
    """`got` decodes the audio `ref` was encoded from. Two calls' float audio may differ in its last bits (a batch
    shared with another request): lossless formats then differ by at most one 16-bit step, and a lossy encoder's
    choices can flip, which leaves the same audio well within 0.7 of the reference's norm (measured up to 0.37 for
    Opus at 24 kHz on noise-like audio) while another utterance is ~1.4 from it."""
    if got.shape != ref.shape:
        return False
    if fmt in ("wav", "flac"):
        return float(np.abs(got.astype(np.float64) - ref).max()) <= 1.0 / 32768 + 1e-9
    return np.array_equal(got, ref) or float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12)) < 0.7


@pytest.mark.parametrize("rate", SAMPLE_RATES)
def test_every_rate_and_codec_is_the_audio_of_the_same_call_at_that_rate(gateway, grpc, rate):
    """Each format at `rate`, whole and (some) streamed, decoded back: as long as the 24 kHz audio of the same
    gRPC call converted to `rate` (out_length), and its audio (the same call's, encoded the same way)."""
    text, seed = "Hello world.", 17
    whole = grpc.synthesize(text, voice="alloy", seed=seed, prompt="[speed_5]", **FIXED)
    streamed = np.concatenate(list(grpc.stream(text, voice="alloy", seed=seed, prompt="[speed_5]", **FIXED)))
    tried = 0
    for fmt in FORMATS:
        try:
            check(fmt, rate)
        except ValueError:  # Opus at a rate it does not code: the 400 is tested below
            continue
        for fmt_, stream in _whole_and_streamed(fmt):
            body = {"model": "chattts", "input": text, "voice": "alloy", "seed": seed, "response_format": fmt_,
                    "sample_rate": rate, "stream": stream, **FIXED}
            status, _, data = post(gateway, "/v1/audio/speech", body)
            assert status == 200, (fmt_, stream, data[:200])
            expected = streamed if stream else whole
            got = decode(data, fmt_, rate)
            n = out_length(expected.size, rate)
            exact = fmt_ != "aac" and not (stream and fmt_ == "mp3")  # ADTS and MP3 streams carry no length
            assert (got.size == n) if exact else (0 <= got.size - n <= 2 * 1152), (fmt_, stream, got.size, n)
            if fmt_ in ("pcm", "ulaw", "alaw"):  # raw: the bytes of the same audio (a last-bit flip at most)
                assert same_raw(data, encode(fmt_, expected, rate), fmt_), (fmt_, stream)
            elif not stream:
                assert same_audio(got, decode(encode(fmt_, expected, rate), fmt_, rate), fmt_), fmt_
            tried += 1
    assert tried >= 12
    status, _, data = post(gateway, "/v1/audio/speech", {"model": "chattts", "input": text, "voice": "alloy",
                                                         "sample_rate": rate + 1, **FIXED})
    assert status == 400 and json.loads(data)["error"]["param"] == "sample_rate"


def test_sse_segments_and_the_captioned_response_time_each_piece_exactly(gateway):
    text = "The first sentence. Then a second one. 最后是第3句。"
    pieces = ["The first sentence.", "Then a second one.", "最后是第3句。"]
    base = {"model": "chattts", "input": text, "voice": "fable", "seed": 40, **FIXED}
    for rate in (24000, 8000):
        status, _, data = post(gateway, "/v1/audio/speech", {**base, "response_format": "pcm", "stream_format": "sse",
                                                             "sample_rate": rate})
        events = [json.loads(x[6:]) for x in data.decode().split("\n\n") if x.startswith("data: ")]
        assert status == 200 and events[-1]["type"] == "speech.audio.done"
        segments = [e for e in events if e["type"] == "speech.segment"]
        audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert [g["text"] for g in segments] == pieces and len(audio) // 2 == out_length(3 * N + 2 * PAUSE, rate)
        for i, g in enumerate(segments):
            start = i * (N + PAUSE)
            assert (g["start_sample"], g["end_sample"]) == (out_length(start, rate), out_length(start + N, rate))
            assert g["start"] == g["start_sample"] / rate and g["spoken_text"]
        assert "三" in segments[2]["spoken_text"]  # what the server read: the number in words
    status, headers, data = post(gateway, "/v1/audio/speech/captioned", {**base, "response_format": "wav",
                                                                         "sample_rate": 16000,
                                                                         "subtitle_format": "vtt"})
    reply = json.loads(data)
    assert status == 200 and reply["sample_rate"] == 16000 and reply["samples"] == out_length(3 * N + 2 * PAUSE, 16000)
    assert decode(base64.b64decode(reply["audio"]), "wav", 16000).size == reply["samples"]
    assert [(g["start_sample"], g["end_sample"]) for g in reply["segments"]] == [
        (out_length(i * (N + PAUSE), 16000), out_length(i * (N + PAUSE) + N, 16000)) for i in range(3)]
    assert reply["subtitles"].startswith("WEBVTT\n\n") and reply["subtitles"].count(" --> ") == 3


def test_unknown_voice_through_the_openai_client_and_the_stream_path(oai):
    import openai

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            oai.audio.speech.create(model="chattts", voice="nobody", input="hi", extra_body={"stream": stream, **FIXED})
        assert e.value.body["param"] == "voice" and "known: alloy" in e.value.body["message"]


def first_and_last_byte_s(gateway: str, body: dict) -> tuple:
    """Seconds from the request to its first audio byte and to its last."""
    host, port = gateway[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.read(1)
        first = time.perf_counter() - t0
        while r.read(65536):
            pass
        return first, time.perf_counter() - t0
    finally:
        conn.close()


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_first_audio_byte_leaves_with_the_first_chunk_not_with_the_whole_audio(gateway, fmt):
    """Streamed, a long utterance: the first audio byte leaves as the stream's first chunk arrives, long before the
    last one (a gateway that waited for the whole audio would send both together). How close it follows the first
    chunk (≤ 10 ms) is a figure of bench.gateway, not of a timed test."""
    n = 16 * TOKENS
    body = {"model": "chattts", "input": "Hello world.", "voice": "alloy", "response_format": fmt, "seed": 1,
            "max_new_tokens": n, "min_new_tokens": n}
    ratios = [first / last for first, last in (first_and_last_byte_s(gateway, body) for _ in range(3))]
    assert statistics.median(ratios) < 0.5, ratios


def test_health_voices_models_and_metrics(gateway, oai, served_tiny):
    for stream in (False, True):
        oai.audio.speech.create(model="chattts", voice="alloy", input="Hi.", response_format="pcm",
                                extra_body={**FIXED, "stream": stream})

    def get(path):
        with urllib.request.urlopen(gateway + path, timeout=30) as r:
            return r.read()

    health = json.loads(get("/health"))
    assert health == {"status": "ok", "triton": served_tiny.grpc_url,
                      "ready": {"chattts": True, "chattts_stream": True}}
    voices = {v["id"]: v for v in json.loads(get("/v1/audio/voices"))["voices"]}
    assert voices["alloy"]["source"] == "seed 2222" and voices["alloy"]["builtin"]
    assert {m["id"] for m in json.loads(get("/v1/models"))["data"]} >= {"chattts", "tts-1"}
    metrics = get("/metrics").decode()
    assert 'chattts_gateway_requests_total{format="pcm",mode="whole",status="200"}' in metrics
    assert 'chattts_gateway_requests_total{format="pcm",mode="stream",status="200"}' in metrics
    assert ('chattts_gateway_first_byte_seconds_bucket{format="pcm"' in metrics
            and "chattts_gateway_pieces_total" in metrics)


def test_playground_plays_streamed_audio_in_chromium(gateway):
    if not os.path.exists(CHROMIUM):  # CI installs it (.ci/run): there a missing browser is a failure
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"needs Debian's chromium at {CHROMIUM}: apt-get "
                                                               "install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            # random tiny weights seldom end an utterance: each request gets the tests' fixed length
            page.route("**/v1/audio/speech", lambda route: route.continue_(
                post_data=json.dumps({**json.loads(route.request.post_data), **FIXED})))
            page.goto(gateway + "/")
            page.wait_for_function("document.querySelectorAll('#voice option').length >= 6")  # from /v1/audio/voices
            page.fill("#input", "Hello from the playground. A second sentence.")
            page.select_option("#voice", "nova")
            for fmt in ("mp3", "pcm", "wav"):  # MSE stream, Web Audio stream, whole file
                page.select_option("#format", fmt)
                page.click("#play")
                page.wait_for_function("document.getElementById('status').textContent.startsWith('done') || "
                                       "document.getElementById('status').className === 'error'", timeout=120_000)
                status = page.inner_text("#status")
                assert status.startswith("done") and f"of {fmt}" in status, status
                page.wait_for_function("document.getElementById('audio').duration > 0 && "
                                       "isFinite(document.getElementById('audio').duration)", timeout=30_000)
            assert not errors
            page.fill("#input", "")
            page.click("#play")
            page.wait_for_function("document.getElementById('status').className === 'error'")
            assert "HTTP 400" in page.inner_text("#status") and "[input]" in page.inner_text("#status")
        finally:
            browser.close()


def test_two_worker_processes_share_the_port_and_their_metrics(served_tiny, tmp_path):
    """`--workers 2`: two gateway processes answer on one port, each request whole and right, and /metrics,
    whichever process answers it, counts the requests of both; SIGTERM ends them all."""
    import concurrent.futures

    port, folder, log = free_port(), tmp_path / "metrics", tmp_path / "gateway.log"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--grpc-url", served_tiny.grpc_url, "--port",
                                 str(port),
                                 "--workers", "2"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=set_parent_death_signal)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while len({p.stem.rsplit("_", 1)[-1] for p in folder.glob("*.db")}) < 2 or not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)

        def speak(i):
            body = json.dumps({"model": "chattts", "input": "Hi there.", "voice": "alloy", "response_format": "pcm",
                               "stream": False, "seed": i, **FIXED}).encode()
            req = urllib.request.Request(url + "/v1/audio/speech", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, len(r.read())

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(speak, range(8)))
        assert answers == [(200, 2 * N)] * 8
        for _ in range(4):  # any worker may answer: each must report both workers' requests
            with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                text = r.read().decode()
            line = next(x for x in text.splitlines()
                        if x.startswith('chattts_gateway_requests_total{format="pcm",mode="whole",status="200"}'))
            assert float(line.split()[-1]) == 8.0, line
    finally:
        proc.terminate()
        code = proc.wait(60)
    assert code in (0, -15), log.read_text()
    assert not list(folder.glob("gauge_live*.db"))  # the workers' in-flight gauges left the sum as they ended


def test_sigterm_lets_the_requests_in_flight_finish(served_tiny, tmp_path):
    """The gateway as it starts by default (two processes): SIGTERM while requests are in flight, as a rolling
    update sends it, and every one of them still gets its whole audio; then the gateway ends."""
    import concurrent.futures

    port, log = free_port(), tmp_path / "gateway.log"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--grpc-url", served_tiny.grpc_url, "--port",
                                 str(port)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=set_parent_death_signal)
    url, long = f"http://127.0.0.1:{port}", 400  # frames: long enough to be in flight when the signal comes
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)

        def speak(i):
            body = json.dumps({"model": "chattts", "input": "Hi there.", "voice": "alloy", "response_format": "pcm",
                               "stream": False, "seed": i, "max_new_tokens": long, "min_new_tokens": long}).encode()
            req = urllib.request.Request(url + "/v1/audio/speech", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, len(r.read())

        def inflight() -> float:
            with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                return float(next(x for x in r.read().decode().splitlines()
                                  if x.startswith("chattts_gateway_inflight")).split()[-1])

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(speak, i) for i in range(4)]
            while inflight() < 4:
                assert not any(a.done() for a in answers), "a request ended before all four were in flight"
                time.sleep(0.02)
            proc.terminate()
            got = [a.result() for a in answers]
        assert got == [(200, 2 * samples_for_codes(long))] * 4
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code in (0, -15) and "Application shutdown complete" in log.read_text(), log.read_text()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


# --- a voice in the request: mixes and reference audio (docs/gateway.md#voices) ------------------------
def tone_wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    import io

    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, 0.3 * np.sin(2 * np.pi * 180 * t) * np.sin(2 * np.pi * 3 * t), rate, format="WAV")
    return buf.getvalue()


def same_streamed(a: np.ndarray, b: np.ndarray, stream: bool, scale: float = 32767) -> bool:
    """Equal; streamed, within what two streams of the same tokens may differ by: a stream's chunks grow when
    generation runs ahead of the codec, and an exact window of other bounds rounds its last bits otherwise
    (docs/streaming.md: ≤ 1e-3 through Triton). Another speaker changes the audio far beyond that.
    scale: 1 for float audio, 32767 for 16-bit."""
    if not stream:
        return np.array_equal(a, b)
    return a.shape == b.shape and np.abs(a.astype(np.float64) - b.astype(np.float64)).max() <= 1e-3 * scale


def pcm(response) -> np.ndarray:
    return np.frombuffer(response.content if hasattr(response, "content") else response, "<i2")


@pytest.mark.parametrize("stream", [False, True])
def test_a_mix_is_the_mixed_speaker_embedding_over_grpc(oai, grpc, served_tiny, stream):
    """`voice: "2222*0.7+nova*0.3"` through OpenAI's client is the audio of the speaker the documented rule makes,
    sent as SPEAKER over gRPC; Kokoro's form with the same weights is the same voice; a term alone is another."""
    from chattts_triton.runtime import voices as V
    from chattts_triton.triton.repo_config import read_manifest

    repo = served_tiny.model_repository
    hidden = read_manifest(repo)["arch"]["gpt"]["hidden"]
    mixed = V.mix_voice("2222*0.7+nova*0.3", V.VoiceRegistry(repo, hidden).resolve, hidden).speaker
    body = {**FIXED, "seed": 7, "stream": stream}
    got = {v: pcm(oai.audio.speech.create(model="chattts", voice=v, input="Hello world.", response_format="pcm",
                                          extra_body=body)) for v in ("2222*0.7+nova*0.3", "2222(7) + nova(3)", "2222")}
    call = grpc.synthesize if not stream else lambda *a, **k: np.concatenate(list(grpc.stream(*a, **k)))
    expected = call("Hello world.", speaker=mixed, seed=7, prompt="[speed_5]", **FIXED)
    assert same_streamed(got["2222*0.7+nova*0.3"], to_int16(expected), stream)
    assert same_streamed(got["2222(7) + nova(3)"], got["2222*0.7+nova*0.3"], stream)
    assert not same_streamed(got["2222"], got["2222*0.7+nova*0.3"], stream)


@pytest.mark.parametrize("stream", [False, True])
def test_a_voice_of_reference_audio_is_the_stored_kind_of_voice(oai, grpc, served_tiny, stream):
    """`voice: {"audio", "transcript"}` is the audio of the same recording encoded as the voices CLI stores it
    (SPEAKER_SAMPLE: the repository's DVAE encoder's codes) with its transcript, and of SPEAKER_AUDIO over gRPC."""
    import io

    from chattts_triton.runtime import voices as V

    data = tone_wav(1.5, 16000)
    wav = V.decode_reference_audio(io.BytesIO(data))
    stored = V.encode_reference(served_tiny.model_repository, wav)  # what `voices add --audio` writes
    voice = {"audio": base64.b64encode(data).decode("ascii"), "transcript": "参考音频"}
    body = {**FIXED, "seed": 9, "stream": stream}
    got = pcm(oai.audio.speech.create(model="chattts", voice="alloy", input="Hello world.", response_format="pcm",
                                      extra_body={**body, "voice": voice}))
    as_url = pcm(oai.audio.speech.create(model="chattts", voice="alloy", input="Hello world.", response_format="pcm",
                                         extra_body={**body, "voice": {**voice, "audio": "data:audio/wav;base64," +
                                                                                    voice["audio"]}}))
    call = grpc.synthesize if not stream else lambda *a, **k: np.concatenate(list(grpc.stream(*a, **k)))
    by_sample = call("Hello world.", speaker_sample=stored, speaker_text="参考音频", seed=9, prompt="[speed_5]",
                     voice_from_first=False, **FIXED)
    by_audio = call("Hello world.", speaker_audio=wav, speaker_text="参考音频", seed=9, prompt="[speed_5]",
                    voice_from_first=False, **FIXED)

    def same(a: np.ndarray, b: np.ndarray, scale: float) -> bool:
        return same_streamed(a, b, stream, scale)

    assert same(by_sample, by_audio, 1.0), "the server's codes of SPEAKER_AUDIO are not the voices CLI's"
    assert same(got, to_int16(by_audio), 32767), "the gateway's voice audio is not SPEAKER_AUDIO of the same file"
    assert same(as_url, got, 32767)
    as_ref = pcm(oai.audio.speech.create(model="chattts", voice="alloy", input="Hello world.", response_format="pcm",
                                         extra_body={**body, "ref_audio": voice["audio"], "ref_text": "参考音频"}))
    assert same(as_ref, got, 32767)  # vLLM-Omni's fields
    plain = call("Hello world.", seed=9, prompt="[speed_5]", voice_from_first=False, **FIXED)
    assert not same(to_int16(plain), got, 32767)  # the reference reached the GPT's prompt


def _png_base64() -> str:
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(4000)).decode("ascii")


@pytest.mark.parametrize("voice, param, words", [
    ({"audio": "A" * (50 << 20), "transcript": "x"}, "voice.audio", "'voice.audio' may be at most"),  # 50 MB base64
    ({"audio": base64.b64encode(b"garbage, no audio here " * 100).decode(), "transcript": "x"}, "voice.audio",
     "not readable audio"),
    ({"audio": "data:image/png;base64," + _png_base64(), "transcript": "x"}, "voice.audio", "'image/png', not audio"),
    ({"audio": "data:audio/wav;base64," + _png_base64(), "transcript": "x"}, "voice.audio", "not a recording"),
    ({"audio": "%%% not base64 %%%", "transcript": "x"}, "voice.audio", "not base64"),
    ({"audio": base64.b64encode(tone_wav(20.0, 8000)).decode(), "transcript": "x"}, "voice.audio", "longer than 15 s"),
    ({"audio": base64.b64encode(tone_wav(0.05)).decode(), "transcript": "x"}, "voice.audio", "too short"),
    ({"audio": base64.b64encode(tone_wav(1.0)).decode(), "transcript": ""}, "voice.transcript", "empty"),
    ({"audio": "https://127.0.0.1:1/ref.wav", "transcript": "x"}, "voice.audio", "fetches nothing"),
    ("2222*-0.3+nova*0.7", "voice", "weight '-0.3'"),
    ("2222*nan+nova", "voice", "weight 'nan'"),
    ("2222*NaN+nova(1)", "voice", "weight 'NaN'"),
    ("2222*0+nova", "voice", "weight '0'"),
    ("2222++nova", "voice", "term 2 of the voice mix '2222++nova' is empty"),
    ("+".join(["nova"] * 1000), "voice", "1000 terms, more than 16"),
    ("2222*0.5+nobody*0.5", "voice", "'nobody' is not a voice of this server; known: alloy"),  # the server's check
])
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_voices_get_openai_400s_naming_the_field(oai, voice, param, words, stream):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        oai.audio.speech.create(model="chattts", voice="alloy", input="Hello.", response_format="pcm",
                                extra_body={**FIXED, "stream": stream, "voice": voice})
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


# --- dialogue; conditioning on the first piece (docs/gateway.md#dialogue, #one-speaker-across-pieces) -------------
SCRIPT = "A: The first line.\nB: 第二句台词。\nA: And the last one."
LINES = [("2222", "The first line."), ("nova*0.5+alloy*0.5", "第二句台词。"), ("2222", "And the last one.")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_dialogue_is_each_line_in_its_voice_with_the_line_pause(oai, grpc, stream):
    body = {**FIXED, "seed": 20, "stream": stream, "input_format": "dialogue", "line_pause_ms": 300,
            "voices": {"A": "2222", "B": "nova*0.5+alloy*0.5"}}
    with oai.audio.speech.with_streaming_response.create(model="chattts", voice="alloy", input=SCRIPT,
                                                          response_format="pcm", extra_body=body) as r:
        assert r.headers["x-chattts-pieces"] == "3"
        audio = np.frombuffer(r.read(), "<i2")
    gap = int(0.3 * SAMPLE_RATE)
    assert audio.size == 3 * N + 2 * gap
    for i, (voice, line) in enumerate(LINES):
        got = audio[i * (N + gap): i * (N + gap) + N]
        if i == 0 and stream:
            expected = np.concatenate(list(grpc.stream(line, voice=voice, seed=20, prompt="[speed_5]", **FIXED)))
        else:
            expected = grpc.synthesize(line, voice=voice, seed=20 + i, prompt="[speed_5]", **FIXED)
        assert np.abs(got.astype(np.int32) - to_int16(expected)).max() <= 1, i  # ≤ 1 LSB: batched pieces' rounding
        if i:
            assert not audio[i * (N + gap) - gap: i * (N + gap)].any()


@pytest.mark.parametrize("fields, param, words", [
    ({"voices": {"A": "2222"}}, "input", "speaker 'B' is not in 'voices' (known: A)"),
    ({"input": "A: Hello.\nB:"}, "input", "line 2 ('B:') has nothing to speak"),
    ({"input": "\n".join(["A: Hi."] * 65)}, "input", "more than 64 lines"),
    ({"input": "A: Hello.\nno label here"}, "input", "has no speaker label"),
    ({"input_format": "text"}, "voices", "'voices' goes with"),
    ({"voices": None}, "voices", "needs 'voices'"),
    ({"voices": {"A": "2222", "B": "a*-1+b"}}, "voices", "weight '-1'"),
    ({"voices": {"A": "2222", "B": "nobody"}}, "voices", "'nobody' is not a voice of this server"),  # the server's
    ({"line_pause_ms": 60_000}, "line_pause_ms", "less than or equal to 5000"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_dialogues_get_openai_400s_naming_the_field(oai, fields, param, words, stream):
    import openai

    body = {**FIXED, "stream": stream, "input_format": "dialogue", "voices": {"A": "2222", "B": "nova"}, **fields}
    text = body.pop("input", SCRIPT)
    with pytest.raises(openai.BadRequestError) as e:
        oai.audio.speech.create(model="chattts", voice="alloy", input=text, response_format="pcm", extra_body=body)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_condition_on_first_piece_reaches_the_gpt_as_the_first_pieces_audio(oai, grpc, stream):
    """With `condition_on_first_piece` the second piece is the gRPC call with the first piece's audio as SPEAKER_AUDIO
    and its SPOKEN_TEXT as SPEAKER_TEXT (upstream's spk_smp / txt_smp: the server encodes it with its DVAE encoder);
    without it, the plain call with the voice alone."""
    text, pieces = "The first sentence. Then a second one.", ["The first sentence.", "Then a second one."]
    body = {**FIXED, "seed": 30, "stream": stream}
    got = {on: pcm(oai.audio.speech.create(model="chattts", voice="echo", input=text, response_format="pcm",
                                           extra_body={**body, "condition_on_first_piece": on}))
           for on in (False, True)}
    assert got[True].size == got[False].size == 2 * N + PAUSE
    assert np.abs(got[True][:N].astype(np.int32) - got[False][:N]).max() <= 1  # the first piece is the same either way
    told: list = []
    if stream:
        first = np.concatenate(list(grpc.stream(pieces[0], voice="echo", seed=30, prompt="[speed_5]",
                                                on_spoken_text=told.append, **FIXED)))
    else:
        first = grpc.synthesize(pieces[0], voice="echo", seed=30, prompt="[speed_5]", split=False,
                                on_spoken_text=told.append, **FIXED)
    conditioned = grpc.synthesize(pieces[1], voice="echo", seed=31, prompt="[speed_5]", split=False,
                                  speaker_audio=first, speaker_text=told[0], **FIXED)
    plain = grpc.synthesize(pieces[1], voice="echo", seed=31, prompt="[speed_5]", split=False, **FIXED)
    assert np.abs(got[True][N + PAUSE:].astype(np.int32) - to_int16(conditioned)).max() <= 1
    assert np.abs(got[False][N + PAUSE:].astype(np.int32) - to_int16(plain)).max() <= 1
    assert not np.array_equal(to_int16(conditioned), to_int16(plain))  # the reference changed the GPT's prompt
