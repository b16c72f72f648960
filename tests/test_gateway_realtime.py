"""WS /v1/audio/speech/stream (gateway.realtime): the protocol over a stand-in client (Starlette's test client), then
end to end: the gateway in front of a real tritonserver driven by the `websockets` package, its audio against the
same calls over gRPC, barge-in freeing the stream model's slots, telephone audio decoded back by FFmpeg."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from chattts_triton.config import SAMPLE_RATE, samples_for_codes
from gateway.app import Settings, create_app
from gateway.audio import decode, out_length, to_int16
from gateway.realtime import PATH, parse_settings
from tests.test_realtime import FakeClient, call_of

S1 = "The first sentence is long enough to stand alone here."
S2 = "The second sentence is also long enough to stand alone."
S3 = "第三句很长，足够独立成为一段语音了吧。"


class StubSynth:
    """What the realtime path uses of the gateway's Synthesizer: its client (here a stand-in)."""

    def __init__(self, fake: FakeClient):
        self.client = fake

    async def ready(self):
        return {"chattts": True, "chattts_stream": True}

    async def close(self):
        pass


def app_with(fake: FakeClient, **settings):
    return create_app(Settings(pause_ms=10, **settings), StubSynth(fake))


def receive_turn(ws):
    """Messages up to the turn's end: (JSON events, audio bytes)."""
    events, audio = [], bytearray()
    while True:
        msg = ws.receive()
        if msg.get("bytes") is not None:
            audio += msg["bytes"]
            continue
        ev = json.loads(msg["text"])
        events.append(ev)
        if ev["type"] in ("turn.done", "turn.cancelled"):
            return events, bytes(audio)


def tokens(text: str, n: int = 3):
    return [text[i:i + n] for i in range(0, len(text), n)]


def test_text_streamed_in_comes_back_as_ordered_audio_with_exact_segment_times():
    fake = FakeClient(chunk=480, chunks=3)
    with TestClient(app_with(fake)).websocket_connect(PATH) as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created" and created["session"]["response_format"] == "pcm"
        seed = created["session"]["seed"]
        for t in tokens(f"{S1} {S2} {S3}"):
            ws.send_json({"type": "text", "text": t})
        ws.send_json({"type": "flush"})
        events, audio = receive_turn(ws)
    ends = [e for e in events if e["type"] == "segment.end"]
    assert [e["text"] for e in ends] == [S1, S2, S3]
    assert [e["index"] for e in ends] == [0, 1, 2]
    assert [o["seed"] for _, o in fake.calls] == [seed, seed + 1, seed + 2]
    assert {o["voice"] for _, o in fake.calls} == {str(seed)}  # one voice: the seed's speaker
    pcm = np.frombuffer(audio, "<i2")
    pause = 240
    assert ends[0]["start_sample"] == 0 and ends[0]["end_sample"] == 1440
    for a, b in pairwise(ends):
        assert b["start_sample"] == a["end_sample"] + pause and b["end_sample"] - b["start_sample"] == 1440
    for e in ends:  # each segment holds its own piece's samples
        assert np.all(call_of(pcm[e["start_sample"]:e["end_sample"]] / 32767) == e["index"] + 1)
        assert e["end"] == round(e["end_sample"] / SAMPLE_RATE, 6) and e["spoken_text"] == e["text"].upper()
    done = events[-1]
    assert done == {"type": "turn.done", "turn": 0, "samples": pcm.size, "duration": round(pcm.size / SAMPLE_RATE, 6)}
    starts = [e for e in events if e["type"] == "segment.start"]
    assert [(s["index"], s["start_sample"]) for s in starts] == [(e["index"], e["start_sample"]) for e in ends]


def test_telephone_audio_carries_its_times_in_its_own_rate():
    fake = FakeClient(chunk=4800, chunks=2)
    with TestClient(app_with(fake)).websocket_connect(PATH) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"response_format": "ulaw", "sample_rate": 8000,
                                                            "voice": "alloy", "seed": 5}})
        updated = ws.receive_json()
        assert updated["type"] == "session.updated" and updated["session"]["seed"] == 5
        ws.send_json({"type": "text", "text": f"{S1} {S2}", "flush": True})
        events, audio = receive_turn(ws)
    ends = [e for e in events if e["type"] == "segment.end"]
    assert ends[1]["end_sample"] == out_length(2 * 9600 + 240, 8000) == len(audio) == events[-1]["samples"]
    assert ends[1]["start_sample"] == out_length(9600 + 240, 8000)
    decoded = decode(audio, "ulaw", 8000)
    assert decoded.size == len(audio) and 0.05 < np.abs(decoded[:3000]).mean()


def test_cancel_stops_the_turn_frees_every_piece_and_the_session_goes_on():
    fake = FakeClient(chunk=480, chunks=200, delay=0.01)
    with TestClient(app_with(fake)).websocket_connect(PATH) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"idle_flush_ms": 0}})  # the half sentence stays unspoken
        ws.receive_json()
        ws.send_json({"type": "text", "text": f"{S1} {S2} {S3} and half a sen"})
        assert ws.receive_json()["type"] == "segment.start"
        ws.receive_bytes()
        ws.send_json({"type": "cancel"})
        events, _ = receive_turn(ws)
        assert events[-1]["type"] == "turn.cancelled" and events[-1]["turn"] == 0
        deadline = time.monotonic() + 5  # turn.cancelled goes out at once; the calls end right after it
        while fake.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.running == 0 and len(fake.cancelled) == 2  # two in flight (the default); the third never started
        fake.chunks = 2
        ws.send_json({"type": "text", "text": "Next turn here.", "flush": True})
        events, audio = receive_turn(ws)
    assert [e["text"] for e in events if e["type"] == "segment.end"] == ["Next turn here."]
    assert events[-1]["type"] == "turn.done" and events[-1]["turn"] == 1 and len(audio) == 2 * 2 * 480


def test_a_piece_the_server_refuses_is_an_error_event_in_its_place_and_the_turn_goes_on():
    fake = FakeClient(fail_on="[bad_token]")
    with TestClient(app_with(fake)).websocket_connect(PATH) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"min_piece_frames": 0}})
        ws.receive_json()
        ws.send_json({"type": "text", "text": "第一句话很好。第二句有问题[bad_token]。第三句也很好。", "flush": True})
        events, _ = receive_turn(ws)
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [("segment.start", 0), ("segment.end", 0), ("error", 1), ("segment.start", 2), ("segment.end", 2),
                     ("turn.done", None)]
    err = events[2]
    assert err["error"]["param"] == "text" and err["error"]["type"] == "invalid_request_error"
    assert "[bad_token]" in err["text"]


@pytest.mark.parametrize("message, param", [
    ("not json", None),
    ('["a list"]', "type"),
    ('{"type": "speak"}', "type"),
    ('{"type": "text", "text": 5}', "text"),
    ('{"type": "text", "text": "' + "a" * 5000 + '"}', "text"),
    ('{"type": "session.update", "session": {"sample_rate": 11025}}', "sample_rate"),
    ('{"type": "session.update", "session": {"response_format": "opus", "sample_rate": 44100}}', "sample_rate"),
    ('{"type": "session.update", "session": {"response_format": "wma"}}', "response_format"),
    ('{"type": "session.update", "session": {"temperature": "hot"}}', "temperature"),
    ('{"type": "session.update", "session": {"model": "whisper-1"}}', "model"),
    ('{"type": "session.update", "session": {"voice": " "}}', "voice"),
    ('{"type": "session.update", "session": {"min_new_tokens": 9, "max_new_tokens": 3}}', "min_new_tokens"),
    ('{"type": "session.update", "session": "pcm"}', "session"),
])
def test_a_bad_message_is_an_error_naming_the_field_and_the_session_goes_on(message, param):
    fake = FakeClient()
    with TestClient(app_with(fake)).websocket_connect(PATH) as ws:
        ws.receive_json()
        ws.send_text(message)
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["param"] == param, err
        ws.send_json({"type": "text", "text": S1, "flush": True})
        events, audio = receive_turn(ws)
    assert events[-1]["type"] == "turn.done" and len(audio) > 0


def test_a_binary_frame_and_an_update_inside_a_turn_are_refused():
    with TestClient(app_with(FakeClient(chunks=50))).websocket_connect(PATH) as ws:
        ws.receive_json()
        ws.send_bytes(b"\x00\x01")
        assert ws.receive_json()["error"]["param"] == "type"
        ws.send_json({"type": "text", "text": "half a sentence"})
        ws.send_json({"type": "session.update", "session": {"sample_rate": 8000}})
        err = ws.receive_json()
        assert err["type"] == "error" and "between turns" in err["error"]["message"]


def test_settings_merge_and_a_new_session_draws_a_new_seed_unless_told():
    a = parse_settings({"voice": "nova", "seed": 3, "response_format": "ulaw", "sample_rate": 8000})
    b = parse_settings({"speed": 2.0}, a)
    assert (b.voice, b.response_format, b.sample_rate, b.speed, b.seed) == ("nova", "ulaw", 8000, 2.0, None)


def test_base64_audio_is_json_events():
    with TestClient(app_with(FakeClient(chunks=1))).websocket_connect(PATH) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"audio": "base64"}})
        ws.receive_json()
        ws.send_json({"type": "text", "text": S1, "flush": True})
        events, audio = receive_turn(ws)
    assert audio == b"" and [e["type"] for e in events] == ["segment.start", "audio", "segment.end", "turn.done"]
    import base64

    assert len(base64.b64decode(events[1]["audio"])) == 2 * 480


def test_api_keys_guard_the_websocket_by_header_or_query():
    app = app_with(FakeClient(), api_keys=("sekret",))
    client = TestClient(app)
    with pytest.raises(WebSocketDisconnect):
        with client.websocket_connect(PATH) as ws:
            ws.receive_json()
    with client.websocket_connect(PATH, headers={"Authorization": "Bearer sekret"}) as ws:
        assert ws.receive_json()["type"] == "session.created"
    with client.websocket_connect(PATH + "?api_key=sekret") as ws:
        assert ws.receive_json()["type"] == "session.created"


def test_the_realtime_counters_are_in_the_metrics():
    app = app_with(FakeClient(chunks=1))
    client = TestClient(app)
    with client.websocket_connect(PATH) as ws:
        ws.receive_json()
        ws.send_json({"type": "text", "text": S1, "flush": True})
        receive_turn(ws)
    text = client.get("/metrics").text
    assert 'chattts_gateway_ws_turns_total{outcome="done"} 1.0' in text
    assert "chattts_gateway_ws_first_audio_seconds_count 1.0" in text
    assert "chattts_gateway_ws_sessions 0.0" in text


# --- end to end: the gateway in front of a real tritonserver -------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
TOKENS = 20
FIXED = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS}


@pytest.fixture(scope="module")
def gateway_url(served_tiny, tmp_path_factory):
    from chattts_triton.launcher.tritonserver import free_port, set_parent_death_signal

    port = free_port()
    log = tmp_path_factory.mktemp("gateway-ws") / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--grpc-url", served_tiny.grpc_url, "--port",
                                 str(port),
                                 "--workers", "1"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=set_parent_death_signal)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield f"ws://127.0.0.1:{port}{PATH}", log
    proc.terminate()
    assert proc.wait(30) in (0, -15)
    assert "Traceback" not in log.read_text(), log.read_text()


async def ws_turn(url, settings, deltas, delay_s=0.0):
    import websockets

    async with websockets.connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": settings}))
        assert json.loads(await ws.recv())["type"] == "session.updated"
        for d in deltas:
            await ws.send(json.dumps({"type": "text", "text": d}))
            await asyncio.sleep(delay_s)
        await ws.send(json.dumps({"type": "flush"}))
        events, audio = [], bytearray()
        async for msg in ws:
            if isinstance(msg, bytes):
                audio += msg
                continue
            ev = json.loads(msg)
            events.append(ev)
            if ev["type"] == "turn.done":
                return events, bytes(audio)


@pytest.mark.e2e
def test_a_session_over_websockets_speaks_what_grpc_speaks_piece_by_piece(gateway_url, served_tiny):
    from client import ChatTTSClient

    url, _ = gateway_url
    settings = {"voice": "alloy", "seed": 11, "min_piece_frames": 0, **FIXED}
    events, audio = asyncio.run(ws_turn(url, settings, tokens(f"{S1} {S2} {S3}", 4)))
    ends = [e for e in events if e["type"] == "segment.end"]
    assert [e["text"] for e in ends] == [S1, S2, S3]
    pcm = np.frombuffer(audio, "<i2")
    n, pause = samples_for_codes(TOKENS), int(0.2 * SAMPLE_RATE)
    assert pcm.size == 3 * n + 2 * pause == events[-1]["samples"]
    with ChatTTSClient(served_tiny.grpc_url) as grpc:
        for i, e in enumerate(ends):
            expected = np.concatenate(list(grpc.stream(e["text"], voice="alloy", seed=11 + i, split=False, **FIXED)))
            # pieces run beside each other here and one at a time there: the codec's batches differ, a float's last bit
            # with them, so a 16-bit sample may round the other way
            got = pcm[e["start_sample"]:e["end_sample"]].astype(np.int32)
            assert got.size == expected.size and np.abs(got - to_int16(expected)).max() <= 1
            assert e["spoken_text"]


def ffmpeg_resample(samples16: np.ndarray, rate: int) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    frame = av.AudioFrame.from_ndarray(samples16.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = SAMPLE_RATE
    return np.concatenate([f.to_ndarray().reshape(-1) for f in resampler.resample(frame) + resampler.resample(None)])


@pytest.mark.e2e
def test_telephone_audio_over_websockets_decodes_to_the_same_speech(gateway_url):
    url, _ = gateway_url
    base = {"voice": "alloy", "seed": 3, "min_piece_frames": 0, **FIXED}
    _, wide = asyncio.run(ws_turn(url, base, [S1]))
    events, ulaw = asyncio.run(ws_turn(url, {**base, "response_format": "ulaw", "sample_rate": 8000}, [S1]))
    reference = np.frombuffer(wide, "<i2").astype(np.float32) / 32768
    phone = decode(ulaw, "ulaw", 8000)
    assert phone.size == out_length(reference.size, 8000) == events[-1]["samples"]
    down = ffmpeg_resample(np.frombuffer(wide, "<i2"), 8000)  # a resampler no one here wrote
    n = min(down.size, phone.size)
    assert abs(down.size - phone.size) < 16 and np.corrcoef(down[:n], phone[:n])[0, 1] > 0.95


@pytest.mark.e2e
def test_barge_in_over_websockets_stops_the_audio_and_frees_the_stream_models_slots(gateway_url, served_tiny):
    import websockets

    url, _ = gateway_url

    def stream_inflight() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{served_tiny.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("chattts_inflight_requests") and 'model="chattts_stream"' in line)

    async def main():
        async with websockets.connect(url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {
                "voice": "alloy", "min_piece_frames": 0, "max_new_tokens": 600, "min_new_tokens": 600}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "text", "text": f"{S1} {S2} {S3}"}))
            while not isinstance(await ws.recv(), bytes):
                pass
            # the gauge is published every INFLIGHT_PUBLISH_S by a thread of the model's process, which a loaded host
            # may run late: read it until it shows the stream (600 frames: it speaks for seconds yet)
            deadline = time.monotonic() + 2
            while not (busy := stream_inflight()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "cancel"}))
            last_audio = t0
            while True:
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    last_audio = time.perf_counter()
                elif json.loads(msg)["type"] == "turn.cancelled":
                    break
            deadline = time.monotonic() + 5
            while stream_inflight() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            freed = stream_inflight()
            await ws.send(json.dumps({"type": "text", "text": S1, "flush": True}))
            after = []
            async for msg in ws:
                if not isinstance(msg, bytes):
                    after.append(json.loads(msg)["type"])
                    if after[-1] == "turn.done":
                        break
            return busy, last_audio - t0, freed, after

    busy, stop_s, freed, after = asyncio.run(main())
    assert busy >= 1 and freed == 0
    assert stop_s < 0.5  # no audio once the cancel has arrived, but for what was already on its way
    assert after == ["segment.start", "segment.end", "turn.done"]


@pytest.mark.e2e
def test_the_documented_client_speaks_typed_text_and_prints_what_was_said(gateway_url):
    url, _ = gateway_url
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "realtime_client.py"), url],
                         input=f"{S1}\n".encode(), capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    assert len(out.stdout) > 0 and len(out.stdout) % 2 == 0  # 16-bit PCM
    assert S1 in out.stderr.decode() and "error" not in out.stderr.decode()


def test_text_far_ahead_of_the_audio_is_refused_until_the_audio_catches_up(monkeypatch):
    import gateway.realtime as rt

    monkeypatch.setattr(rt, "MAX_PIECES_AHEAD", 2)
    with TestClient(app_with(FakeClient(chunks=100, delay=0.05))).websocket_connect(PATH) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"min_piece_frames": 0}})
        ws.receive_json()
        for s in (S1, S2, S3, S1):
            ws.send_json({"type": "text", "text": s + " "})
        while (msg := ws.receive())["text"] is None or json.loads(msg["text"])["type"] != "error":
            pass
        err = json.loads(msg["text"])["error"]
        assert err["param"] == "text" and err["code"] == "too_far_ahead"
