"""The Wyoming server (`python -m gateway.wyoming`), driven by the `wyoming` package's own client (AsyncTcpClient):
over a stand-in gRPC client (the protocol, Home Assistant's streaming and compatibility rules, errors, hostile
input), then in front of a real tritonserver (`served_tiny`) as a subprocess, its audio compared with the same
calls over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from chattts_triton.config import BUILTIN_VOICE_SEEDS, SAMPLE_RATE, samples_for_codes
from chattts_triton.launcher.tritonserver import free_port, set_parent_death_signal
from client.errors import ChatTTSError
from gateway.audio import SAMPLE_RATES, out_length, resample, to_int16
from gateway.wyoming import MAX_EVENT_BYTES, Settings, WyomingServer, build_parser, settings_from_args

ROOT = Path(__file__).resolve().parents[1]
FIRST = "This is the first sentence of the reply."  # long enough to be spoken on its own (not held for the next)
SECOND = "And here is the second one."
PAUSE = int(0.2 * SAMPLE_RATE)


class FakeClient:
    """`stream` as AsyncChatTTSClient's: each piece `chunks` chunks of `chunk` samples whose value tells the piece
    apart; a voice named "bad" is refused as the server refuses an unknown VOICE."""

    def __init__(self, chunk=480, chunks=3, delay=0.01):
        self.chunk, self.chunks, self.delay = chunk, chunks, delay
        self.calls, self.cancelled = [], []

    def stream(self, text, *, split, voice_from_first, on_spoken_text, chunk_timeout_s, **options):
        self.calls.append((text, options))
        n = len(self.calls)

        async def gen():
            try:
                if options.get("voice") == "bad":
                    raise ChatTTSError("INVALID_ARGUMENT", "unknown VOICE 'bad'; known: alloy, echo")
                on_spoken_text(text)
                for _ in range(self.chunks):
                    await asyncio.sleep(self.delay)
                    yield np.full(self.chunk, n / 10, np.float32)
            except asyncio.CancelledError:
                self.cancelled.append(text)
                raise

        return gen()

    def expected(self, pieces: int, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
        """The 16-bit audio of `pieces` pieces joined with the pause, as the server should send it."""
        parts = []
        for n in range(1, pieces + 1):
            parts += (([np.zeros(PAUSE, np.float32)] if n > 1 else [])
                      + [np.full(self.chunk * self.chunks, n / 10, np.float32)])
        return to_int16(resample(np.concatenate(parts), sample_rate))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@contextlib.asynccontextmanager
async def serving(client, **settings):
    """A Wyoming server in this loop over `client`; yields a function that opens a connection to it."""
    port = free_port()
    server = WyomingServer(Settings(**settings), "127.0.0.1", port, client_factory=lambda: client)
    await server.tcp.start(server.handler)
    try:
        yield lambda: AsyncTcpClient("127.0.0.1", port, read_timeout=10)
    finally:
        await server.tcp.stop()


async def read_until(conn: AsyncTcpClient, *kinds) -> list[Event]:
    """Events up to and including the first of one of `kinds`; a None at the end if the server closed first."""
    events = []
    while True:
        event = await conn.read_event()
        events.append(event)
        if event is None or any(k.is_type(event.type) for k in kinds):
            return events


def audio_of(events: list[Event | None], rate: int = SAMPLE_RATE) -> np.ndarray:
    chunks = [AudioChunk.from_event(e) for e in events if e is not None and AudioChunk.is_type(e.type)]
    assert all((c.rate, c.width, c.channels) == (rate, 2, 1) for c in chunks)
    return np.frombuffer(b"".join(c.audio for c in chunks), "<i2")


def types(events) -> list[str | None]:
    return [None if e is None else e.type for e in events]


def squeeze(kinds: list[str | None]) -> list[str | None]:
    """Runs of the same event type as one (audio-chunk, audio-chunk, ... → audio-chunk)."""
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


# --- describe
# ------------------------------------------------------------------------------------------------------------
def test_describe_answers_info_with_one_streaming_tts_program_and_the_builtin_voices():
    async def go():
        async with serving(FakeClient()) as connect, connect() as conn:
            await conn.write_event(Describe().event())
            return Info.from_event(await conn.read_event())

    info = run(go())
    (program,) = info.tts
    assert program.installed and program.supports_synthesize_streaming and program.version
    assert program.attribution.url.endswith("2noise/ChatTTS")
    assert [v.name for v in program.voices] == sorted(BUILTIN_VOICE_SEEDS)
    assert all(v.installed and set(v.languages) == {"en", "zh"} for v in program.voices)
    assert str(BUILTIN_VOICE_SEEDS["alloy"]) in program.voices[0].description


def test_describe_lists_the_configured_voice_store_as_the_speech_gateway_does(tmp_path, monkeypatch):
    """The store the setting names (here an SQLite one; a shared one the same way): a voice another process adds is
    listed at the next describe, and one removed is gone; an unreadable store is an error event."""
    from chattts_triton.runtime import voices as V

    monkeypatch.delenv("CHATTTS_VOICE_STORE", raising=False)
    url = f"sqlite://{tmp_path}/voices.db"
    writer = V.open_voice_store(url)

    async def describe(**settings) -> Event:
        async with serving(FakeClient(), **settings) as connect, connect() as conn:
            await conn.write_event(Describe().event())
            return await conn.read_event()

    writer.put("narrator", {"seed": 42, "description": "calm"})
    voices = Info.from_event(run(describe(voice_store=url))).tts[0].voices
    assert [v.name for v in voices] == sorted([*BUILTIN_VOICE_SEEDS, "narrator"])
    assert {v.name: v.description for v in voices}["narrator"] == "narrator (calm)"
    V.delete_voice(writer, "alloy")
    assert "alloy" not in [v.name for v in Info.from_event(run(describe(voice_store=url))).tts[0].voices]
    monkeypatch.setenv("CHATTTS_VOICE_STORE", url)  # the environment's store, without a flag or a repository
    assert "narrator" in [v.name for v in Info.from_event(run(describe())).tts[0].voices]
    (tmp_path / "broken.json").write_text("{broken")
    event = run(describe(voice_store=f"file://{tmp_path}/broken.json"))
    assert Error.is_type(event.type) and "cannot be read" in Error.from_event(event).text
    a = build_parser().parse_args(["--voice-store", url])
    assert settings_from_args(build_parser(), a).voice_store == url


def test_describe_without_streaming_says_so_and_a_ping_gets_its_pong():
    async def go():
        async with serving(FakeClient(), streaming=False) as connect, connect() as conn:
            await conn.write_event(Describe().event())
            info = Info.from_event(await conn.read_event())
            await conn.write_event(Ping(text="x").event())
            return info, await conn.read_event()

    info, pong = run(go())
    assert not info.tts[0].supports_synthesize_streaming
    assert Pong.is_type(pong.type) and Pong.from_event(pong).text == "x"


# --- synthesize
# --------------------------------------------------------------------------------------------------------
def test_synthesize_sends_audio_start_chunks_and_stop_with_the_voice_the_seed_schedule_and_the_options():
    client = FakeClient()

    async def go():
        async with serving(client, seed=40, samples_per_chunk=500, options={"prompt": "[speed_3]"}) as connect, \
                connect() as conn:
            await conn.write_event(Synthesize(text=f"{FIRST} {SECOND}",
                                              voice=SynthesizeVoice(name="nova", speaker="x")).event())
            return await read_until(conn, AudioStop)

    events = run(go())
    assert squeeze(types(events)) == ["audio-start", "audio-chunk", "audio-stop"]
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (SAMPLE_RATE, 2, 1)
    assert max(len(AudioChunk.from_event(e).audio) for e in events[1:-1]) == 2 * 500
    assert np.array_equal(audio_of(events), client.expected(2))
    assert client.calls == [(FIRST, {"voice": "nova", "prompt": "[speed_3]", "seed": 40}),
                            (SECOND, {"voice": "nova", "prompt": "[speed_3]", "seed": 41})]


@pytest.mark.parametrize("rate", [r for r in SAMPLE_RATES if r != SAMPLE_RATE])
@pytest.mark.parametrize("streamed", [False, True])
def test_audio_at_another_rate_is_the_whole_audio_resampled_to_its_exact_length(rate, streamed):
    client = FakeClient()

    async def go():
        async with serving(client, sample_rate=rate) as connect, connect() as conn:
            if not streamed:
                await conn.write_event(Synthesize(text=f"{FIRST} {SECOND}").event())
                return await read_until(conn, AudioStop)
            await conn.write_event(SynthesizeStart().event())
            for token in (FIRST, " ", SECOND):
                await conn.write_event(SynthesizeChunk(text=token).event())
            await conn.write_event(SynthesizeStop().event())
            return await read_until(conn, SynthesizeStopped)

    events = run(go())
    assert AudioStart.from_event(events[0]).rate == rate
    audio, expected = audio_of(events, rate), client.expected(2, rate)
    assert audio.size == expected.size == out_length(2 * client.chunk * client.chunks + PAUSE, rate)
    # libsoxr's stream resampler gives the whole array's samples, chunk boundaries or not
    assert np.abs(audio.astype(np.int32) - expected).max() <= 1


def test_synthesize_without_a_voice_name_uses_the_default_voice():
    client = FakeClient()

    async def go():
        async with serving(client, voice="echo") as connect, connect() as conn:
            await conn.write_event(Synthesize(text=FIRST).event())
            await read_until(conn, AudioStop)
            await conn.write_event(Synthesize(text=FIRST, voice=SynthesizeVoice(language="zh")).event())
            await read_until(conn, AudioStop)

    run(go())
    assert [options["voice"] for _, options in client.calls] == ["echo", "echo"]


def test_a_seed_number_names_a_voice_and_several_syntheses_share_one_connection():
    client = FakeClient()

    async def go():
        async with serving(client) as connect, connect() as conn:
            out = []
            for voice in ("2222", "shimmer"):
                await conn.write_event(Synthesize(text=FIRST, voice=SynthesizeVoice(name=voice)).event())
                out.append(await read_until(conn, AudioStop))
            return out

    first, second = run(go())
    assert [options["voice"] for _, options in client.calls] == ["2222", "shimmer"]
    assert audio_of(first).size == audio_of(second).size == client.chunk * client.chunks


# --- streamed synthesis
# ------------------------------------------------------------------------------------------------
def test_streamed_audio_starts_when_the_first_sentence_is_complete_and_the_compatibility_synthesize_is_not_spoken():
    client = FakeClient()

    async def go():
        async with serving(client, idle_flush_s=None) as connect, connect() as conn:
            await conn.write_event(SynthesizeStart(voice=SynthesizeVoice(name="fable")).event())
            for token in (FIRST[:10], FIRST[10:], " And here"):
                await conn.write_event(SynthesizeChunk(text=token).event())
            before_stop = await read_until(conn, AudioChunk)  # nothing more is sent until the first audio is here
            await conn.write_event(SynthesizeChunk(text=" is the second one.").event())
            # Home Assistant's order: the whole text again (for servers that do not stream), then the stop
            await conn.write_event(Synthesize(text=f"{FIRST} {SECOND}", voice=SynthesizeVoice(name="fable")).event())
            await conn.write_event(SynthesizeStop().event())
            return before_stop, await read_until(conn, SynthesizeStopped)

    before_stop, after = run(go())
    assert types(before_stop) == ["audio-start", "audio-chunk"]
    events = before_stop + after
    assert squeeze(types(events)) == ["audio-start", "audio-chunk", "audio-stop", "synthesize-stopped"]
    assert [text for text, _ in client.calls] == [FIRST, SECOND]  # each once
    assert np.array_equal(audio_of(events), client.expected(2))


def test_a_stream_without_chunks_speaks_the_synthesize_it_carries_once():
    client = FakeClient()

    async def go():
        async with serving(client) as connect, connect() as conn:
            await conn.write_event(SynthesizeStart().event())
            await conn.write_event(Synthesize(text=FIRST).event())
            await conn.write_event(Synthesize(text=FIRST).event())
            await conn.write_event(SynthesizeStop().event())
            return await read_until(conn, SynthesizeStopped)

    events = run(go())
    assert [text for text, _ in client.calls] == [FIRST]
    assert audio_of(events).size == client.chunk * client.chunks


def test_an_empty_stream_ends_with_synthesize_stopped_and_no_audio():
    async def go():
        async with serving(FakeClient()) as connect, connect() as conn:
            await conn.write_event(SynthesizeStart().event())
            await conn.write_event(SynthesizeStop().event())
            return await read_until(conn, SynthesizeStopped)

    assert types(run(go())) == ["synthesize-stopped"]


def test_text_left_idle_in_a_stream_is_spoken_before_the_stop():
    client = FakeClient()

    async def go():
        async with serving(client, idle_flush_s=0.1) as connect, connect() as conn:
            await conn.write_event(SynthesizeStart().event())
            await conn.write_event(SynthesizeChunk(text="An unfinished thought").event())
            first = await read_until(conn, AudioChunk)
            await conn.write_event(SynthesizeStop().event())
            return first + await read_until(conn, SynthesizeStopped)

    events = run(go())
    assert [text for text, _ in client.calls] == ["An unfinished thought"]
    assert squeeze(types(events)) == ["audio-start", "audio-chunk", "audio-stop", "synthesize-stopped"]


def test_a_client_gone_in_the_middle_of_a_stream_cancels_its_pieces():
    client = FakeClient(chunks=1000, delay=0.01)

    async def go():
        async with serving(client) as connect:
            async with connect() as conn:
                await conn.write_event(SynthesizeStart().event())
                await conn.write_event(SynthesizeChunk(text=FIRST + " ").event())
                await read_until(conn, AudioChunk)
            for _ in range(100):
                if client.cancelled:
                    return
                await asyncio.sleep(0.05)

    run(go())
    assert client.cancelled == [FIRST]


# --- errors
# ------------------------------------------------------------------------------------------------------------
def test_a_failed_piece_of_a_stream_is_an_error_event_and_the_stream_still_ends_with_synthesize_stopped():
    async def go():
        async with serving(FakeClient()) as connect, connect() as conn:
            await conn.write_event(SynthesizeStart(voice=SynthesizeVoice(name="bad")).event())
            await conn.write_event(SynthesizeChunk(text=FIRST).event())
            await conn.write_event(SynthesizeStop().event())
            events = await read_until(conn, SynthesizeStopped)
            await conn.write_event(Describe().event())  # the connection goes on
            return events, await conn.read_event()

    events, answer = run(go())
    assert types(events) == ["error", "synthesize-stopped"]
    error = Error.from_event(events[0])
    assert error.code == "INVALID_ARGUMENT" and "unknown VOICE 'bad'" in error.text
    assert Info.is_type(answer.type)


def test_a_failed_synthesize_is_an_error_event_then_the_end_of_the_connection_and_the_server_goes_on():
    async def go():
        async with serving(FakeClient()) as connect:
            async with connect() as conn:
                await conn.write_event(Synthesize(text=FIRST, voice=SynthesizeVoice(name="bad")).event())
                failed = await read_until(conn, AudioStop)
            async with connect() as conn:
                await conn.write_event(Synthesize(text=FIRST).event())
                return failed, await read_until(conn, AudioStop)

    failed, ok = run(go())
    assert types(failed) == ["error", None]  # Home Assistant's plain synthesis reads until audio-stop or the end
    assert Error.from_event(failed[0]).code == "INVALID_ARGUMENT"
    assert types(ok)[-1] == "audio-stop"


@pytest.mark.parametrize("text, code", [("", "text-empty"), ("   ", "text-empty"), ("x" * 5000, "text-too-long")])
def test_a_synthesize_without_text_to_speak_or_past_the_limit_is_refused_by_name(text, code):
    client = FakeClient()

    async def go():
        async with serving(client) as connect, connect() as conn:
            await conn.write_event(Synthesize(text=text).event())
            return await read_until(conn, AudioStop)

    events = run(go())
    assert types(events) == ["error", None] and Error.from_event(events[0]).code == code
    assert client.calls == []


def test_a_stream_past_the_text_limit_refuses_the_chunk_and_speaks_the_rest():
    client = FakeClient()

    async def go():
        async with serving(client, max_text_chars=60) as connect, connect() as conn:
            await conn.write_event(SynthesizeStart().event())
            await conn.write_event(SynthesizeChunk(text=FIRST).event())
            await conn.write_event(SynthesizeChunk(text=" " + "y" * 40).event())
            await conn.write_event(SynthesizeStop().event())
            return await read_until(conn, SynthesizeStopped)

    events = run(go())
    errors = [Error.from_event(e) for e in events if Error.is_type(e.type)]
    assert [e.code for e in errors] == ["text-too-long"] and "60 characters" in errors[0].text
    assert [text for text, _ in client.calls] == [FIRST]
    assert types(events)[-2:] == ["audio-stop", "synthesize-stopped"]


@pytest.mark.parametrize("event, words", [
    (Event("synthesize", {"text": 5}), "'text' must be a string"),
    (Event("synthesize", {}), "'text' must be a string"),
    (Event("synthesize", {"text": "hi", "voice": "alloy"}), "'voice' must be an object"),
    (Event("synthesize", {"text": "hi", "voice": {"name": 3}}), "'voice.name' must be a string"),
    (Event("synthesize-chunk", {"text": "hi"}), "outside a stream"),
    (Event("synthesize-stop"), "outside a stream"),
])
def test_a_malformed_event_is_an_error_event_naming_the_field_and_the_connection_goes_on(event, words):
    async def go():
        async with serving(FakeClient()) as connect, connect() as conn:
            await conn.write_event(Event("no-such-event-type", {"x": 1}))  # ignored, as another program's events are
            await conn.write_event(event)
            error = await conn.read_event()
            await conn.write_event(Describe().event())
            return error, await conn.read_event()

    error, answer = run(go())
    assert Error.is_type(error.type) and words in Error.from_event(error).text
    assert Info.is_type(answer.type)


@pytest.mark.parametrize("raw, words", [
    (b"this is not json\n", "not JSON"),
    (b"\xff\xfe\n", "not JSON"),
    (b"[1, 2]\n", "not a JSON object"),
    (b'{"data": {}}\n', "without a 'type'"),
    (b'{"type": "synthesize", "data": [1]}\n', "'data' must be an object"),
    (json.dumps({"type": "synthesize", "data_length": MAX_EVENT_BYTES + 1}).encode() + b"\n", "data_length"),
    (json.dumps({"type": "audio-chunk", "payload_length": 1 << 40}).encode() + b"\n", "payload_length"),
    (json.dumps({"type": "synthesize", "data_length": 3}).encode() + b"\n[1]", "data that is not a JSON object"),
    (b"x" * (1 << 17), "longer than"),
])
def test_garbage_on_the_wire_gets_an_error_event_and_a_closed_connection_and_the_server_goes_on(raw, words):
    async def go():
        async with serving(FakeClient()) as connect:
            conn = connect()
            await conn.connect()
            conn._writer.write(raw)
            events = await read_until(conn)  # until the server closes
            await conn.disconnect()
            async with connect() as again:
                await again.write_event(Describe().event())
                return events, await again.read_event()

    events, answer = run(go())
    assert types(events) == ["error", None] and words in Error.from_event(events[0]).text
    assert Info.is_type(answer.type)


def test_a_fault_of_the_server_is_an_internal_error_event_that_ends_only_its_connection(monkeypatch):
    from gateway import wyoming

    def broken(settings):
        raise RuntimeError("a bug")

    async def go():
        async with serving(FakeClient()) as connect:
            async with connect() as conn:
                monkeypatch.setattr(wyoming, "info", broken)
                await conn.write_event(Describe().event())
                events = await read_until(conn)
                monkeypatch.undo()
            async with connect() as conn:
                await conn.write_event(Describe().event())
                return events, await conn.read_event()

    events, answer = run(go())
    assert types(events) == ["error", None] and Error.from_event(events[0]).code == "internal"
    assert Info.is_type(answer.type)


# --- command line
# ------------------------------------------------------------------------------------------------------
def parse(*argv) -> Settings:
    p = build_parser()
    return settings_from_args(p, p.parse_args(list(argv)))


def test_options_take_the_contract_types_and_prompt_defaults_to_speed_5():
    s = parse("--option", "temperature=0.2", "--option", "max_new_tokens=20", "--option", "prompt=[oral_2]",
              "--seed", "7")
    assert s.options == {"prompt": "[oral_2]", "temperature": 0.2, "max_new_tokens": 20} and s.seed == 7
    assert parse().options == {"prompt": "[speed_5]"} and parse().seed is None
    assert parse("--idle-flush-s", "0").idle_flush_s is None


@pytest.mark.parametrize("argv, words", [
    (["--option", "nope=1"], "KEY one of"),
    (["--option", "seed=1"], "--seed"),
    (["--option", "temperature=hot"], "not a number"),
    (["--option", "top_k=0.5"], "top_k"),
    (["--sample-rate", "12345"], "--sample-rate"),
    (["--sample-rate", "96000"], "--sample-rate"),
    (["--port", "0"], "--port"),
    (["--samples-per-chunk", "0"], "--samples-per-chunk"),
    (["--repo", "/nonexistent"], "manifest.json"),
])
def test_bad_flags_are_refused_by_name(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert words in capsys.readouterr().err


# --- against a real tritonserver
# ------------------------------------------------------------------------------------------
TOKENS = 20
N = samples_for_codes(TOKENS)
SEED = 11


@contextlib.contextmanager
def wyoming_process(served_tiny, log: Path, *flags: str):
    """`python -m gateway.wyoming` in front of `served_tiny` (forced lengths, a fixed seed); yields its port."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.wyoming", "--grpc-url", served_tiny.grpc_url, "--port", str(port),
             "--repo", str(served_tiny.model_repository), "--seed", str(SEED), "--idle-flush-s", "0",
             "--option", f"max_new_tokens={TOKENS}", "--option", f"min_new_tokens={TOKENS}", *flags],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=set_parent_death_signal)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        code = proc.wait(30)
    assert code == 0, log.read_text()  # SIGTERM: the wyoming server stops its connections and ends


@pytest.fixture(scope="module")
def wyoming_port(served_tiny, tmp_path_factory):
    with wyoming_process(served_tiny, tmp_path_factory.mktemp("wyoming") / "wyoming.log") as port:
        yield port


@pytest.fixture(scope="module")
def grpc(served_tiny):
    from client import ChatTTSClient

    with ChatTTSClient(served_tiny.grpc_url) as c:
        yield c


def connect_to(port: int) -> AsyncTcpClient:
    return AsyncTcpClient("127.0.0.1", port, read_timeout=120)


def streamed(grpc, text: str, voice: str, seed: int) -> np.ndarray:
    return np.concatenate(list(grpc.stream(text, voice=voice, seed=seed, prompt="[speed_5]", max_new_tokens=TOKENS,
                                           min_new_tokens=TOKENS)))


@pytest.mark.e2e
def test_e2e_describe_lists_the_repository_voices(wyoming_port, served_tiny):
    from chattts_triton.runtime.voices import read_voices

    async def go():
        async with connect_to(wyoming_port) as conn:
            await conn.write_event(Describe().event())
            return Info.from_event(await conn.read_event())

    registry = served_tiny.model_repository / "voices.json"
    names = sorted(read_voices(registry)) if registry.exists() else sorted(BUILTIN_VOICE_SEEDS)
    assert [v.name for v in run(go()).tts[0].voices] == names


@pytest.mark.e2e
def test_e2e_synthesize_is_the_stream_of_the_same_grpc_call(wyoming_port, grpc):
    async def go():
        async with connect_to(wyoming_port) as conn:
            await conn.write_event(Synthesize(text="Hello world.", voice=SynthesizeVoice(name="nova")).event())
            return await read_until(conn, AudioStop)

    audio = audio_of(run(go()))
    assert audio.size == N
    assert np.abs(audio.astype(np.int32) - to_int16(streamed(grpc, "Hello world.", "nova", SEED))).max() <= 1


@pytest.mark.e2e
def test_e2e_streamed_audio_arrives_before_the_stop_once_the_first_sentence_is_complete(wyoming_port, grpc):
    async def go():
        async with connect_to(wyoming_port) as conn:
            await conn.write_event(SynthesizeStart(voice=SynthesizeVoice(name="echo")).event())
            for word in (FIRST + " And here").split(" "):
                await conn.write_event(SynthesizeChunk(text=word + " ").event())
            first = await read_until(conn, AudioChunk)  # idle flush is off: the complete sentence alone started it
            await conn.write_event(SynthesizeChunk(text="is the second one.").event())
            await conn.write_event(Synthesize(text=f"{FIRST} {SECOND}").event())
            await conn.write_event(SynthesizeStop().event())
            return first, await read_until(conn, SynthesizeStopped)

    first, rest = run(go())
    assert types(first) == ["audio-start", "audio-chunk"]
    audio = audio_of(first + rest)
    assert audio.size == 2 * N + PAUSE  # two pieces: the compatibility synthesize spoke nothing
    assert np.abs(audio[:N].astype(np.int32) - to_int16(streamed(grpc, FIRST, "echo", SEED))).max() <= 1
    assert not audio[N:N + PAUSE].any()
    assert np.abs(audio[N + PAUSE:].astype(np.int32) - to_int16(streamed(grpc, SECOND, "echo", SEED + 1))).max() <= 1


@pytest.mark.e2e
def test_e2e_an_unknown_voice_is_an_error_event_in_a_stream_and_ends_a_plain_synthesize(wyoming_port):
    async def go():
        async with connect_to(wyoming_port) as conn:
            await conn.write_event(SynthesizeStart(voice=SynthesizeVoice(name="no-such-voice")).event())
            await conn.write_event(SynthesizeChunk(text=FIRST).event())
            await conn.write_event(SynthesizeStop().event())
            streamed_events = await read_until(conn, SynthesizeStopped)
            await conn.write_event(Synthesize(text=FIRST, voice=SynthesizeVoice(name="no-such-voice")).event())
            return streamed_events, await read_until(conn, AudioStop)

    in_stream, plain = run(go())
    assert types(in_stream) == ["error", "synthesize-stopped"]
    error = Error.from_event(in_stream[0])
    assert error.code == "INVALID_ARGUMENT" and "no-such-voice" in error.text and "alloy" in error.text
    assert types(plain) == ["error", None]


@pytest.mark.e2e
def test_e2e_a_server_at_16_khz_sends_the_grpc_stream_resampled(served_tiny, grpc, tmp_path):
    async def go(port):
        async with connect_to(port) as conn:
            await conn.write_event(Synthesize(text="Hello world.", voice=SynthesizeVoice(name="onyx")).event())
            return await read_until(conn, AudioStop)

    with wyoming_process(served_tiny, tmp_path / "wyoming.log", "--sample-rate", "16000") as port:
        events = run(go(port))
    assert AudioStart.from_event(events[0]).rate == 16000
    audio = audio_of(events, 16000)
    expected = to_int16(resample(streamed(grpc, "Hello world.", "onyx", SEED), 16000))
    assert audio.size == expected.size == out_length(N, 16000)
    assert np.abs(audio.astype(np.int32) - expected).max() <= 2


@pytest.mark.e2e
def test_e2e_wyoming_bench_measures_both_paths_without_a_failure(wyoming_port):
    """wyoming-bench (the community's Wyoming TTS benchmark, PyPI) against the server: every plain and streamed
    synthesis it makes succeeds."""
    pytest.importorskip("wyoming_bench", reason="wyoming-bench is not installed (requirements.txt pins it)")
    text = "The weather today is sunny and warm. Tomorrow it will rain, so bring an umbrella."
    r = subprocess.run([sys.executable, "-c", "import sys; from wyoming_bench.cli import main; sys.exit(main())",
                        "tts", f"127.0.0.1:{wyoming_port}", "--texts", text, "--rounds", "2", "--warmup", "1",
                        "--timeout", "120"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[non_streaming] ok=2 fail=0" in r.stdout and "[streaming] ok=2 fail=0" in r.stdout, r.stdout
