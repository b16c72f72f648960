"""The client and its command line against the real server (`served_tiny`: tiny weights on CPU)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from chattts_triton.config import LIMITS, SAMPLE_RATE, samples_for_codes
from client import AsyncChatTTSClient, ChatTTSClient, ChatTTSError, read_wav, split_sentences

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 20  # MIN = MAX new tokens: short utterances of a fixed length
FIXED = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS}
PROTOCOLS = pytest.mark.parametrize("protocol", ["grpc", "http"])


def url_of(served, protocol: str) -> str:
    return served.grpc_url if protocol == "grpc" else served.http_url


def check_audio(audio: np.ndarray, max_samples: int) -> None:
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert 0 < audio.size <= max_samples and np.isfinite(audio).all()


@PROTOCOLS
def test_cli_writes_a_valid_wav(served_tiny, protocol, tmp_path):
    out = tmp_path / "hello.wav"
    cmd = [sys.executable, "-m", "client", "Hello world.", "-o", str(out), "--url", url_of(served_tiny, protocol),
           "--protocol", protocol, "--seed", "1",
           "--max-new-tokens", str(TOKENS), "--min-new-tokens", str(TOKENS)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes()[:4] == b"RIFF" and out.read_bytes()[8:12] == b"WAVE"
    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getsampwidth()) == (1, SAMPLE_RATE, 2)
        assert 0 < w.getnframes() <= samples_for_codes(TOKENS)


def test_cli_server_error_exits_1(served_tiny, tmp_path):
    too_long = "a" * (LIMITS.max_text_chars + 1)
    run = subprocess.run(
        [sys.executable, "-m", "client", too_long, "-o", str(tmp_path / "x.wav"), "--url", served_tiny.grpc_url,
         "--no-split"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1 and "INVALID_ARGUMENT" in run.stderr and not (tmp_path / "x.wav").exists()


def test_cli_file_mode(served_tiny, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("你好。\n\nGood morning.\n", encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "-m", "client", "--file", str(texts), "--out-dir", str(tmp_path / "out"),
         "--url", served_tiny.grpc_url, "--max-new-tokens", str(TOKENS), "--min-new-tokens", str(TOKENS)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0001.wav", "0003.wav"]
    for p in (tmp_path / "out").iterdir():
        audio, rate = read_wav(p)
        assert rate == SAMPLE_RATE and audio.size > 0


@PROTOCOLS
def test_sync_client(served_tiny, protocol):
    with ChatTTSClient(url_of(served_tiny, protocol), protocol=protocol) as c:
        assert c.is_ready()
        a = c.synthesize("Hello world.", seed=7, **FIXED)
        b = c.synthesize("Hello world.", seed=7, **FIXED)
        check_audio(a, samples_for_codes(TOKENS))
        assert np.array_equal(a, b)  # SEED makes a request reproducible
        with pytest.raises(ChatTTSError) as e:
            c.synthesize("a" * (LIMITS.max_text_chars + 1), split=False)
        assert e.value.status == "INVALID_ARGUMENT"
        stats = c.inference_statistics("chattts")
        assert stats["model_stats"][0]["inference_count"] >= 2


@PROTOCOLS
def test_async_client_matches_sync_client(served_tiny, protocol):
    url = url_of(served_tiny, protocol)

    async def main():
        async with AsyncChatTTSClient(url, protocol=protocol) as c:
            assert await c.is_ready()
            one = await c.synthesize("Good morning.", seed=3, **FIXED)
            batch = await c.synthesize_batch(["你好。", "Thank you.", "Yes."], seed=3, **FIXED)
            return one, batch

    one, batch = asyncio.run(main())
    with ChatTTSClient(url, protocol=protocol) as c:
        assert np.array_equal(one, c.synthesize("Good morning.", seed=3, **FIXED))
    assert len(batch) == 3
    for audio in batch:
        check_audio(audio, samples_for_codes(TOKENS))


def test_long_text_is_synthesised_per_sentence_and_joined(served_tiny):
    text = "The first sentence stands on its own. Then a second one follows it. 最后是第三句话了。"
    sentences = split_sentences(text)
    assert len(sentences) == 3
    with ChatTTSClient(served_tiny.grpc_url) as c:
        joined = c.synthesize(text, seed=5, **FIXED)
        reference = c.synthesize(sentences[0], seed=5, **FIXED)
        pieces = c.synthesize_batch(sentences, seed=5, speaker_audio=reference, speaker_text=sentences[0], **FIXED)
    # lengths are fixed by MIN = MAX new tokens, so the joined audio is exactly the pieces end to end
    assert joined.size == sum(p.size for p in pieces)
    check_audio(joined, 3 * samples_for_codes(TOKENS))


@PROTOCOLS
def test_spoken_text_of_each_piece_reaches_the_caller(served_tiny, protocol):
    text = "我有3个苹果，价格是12.5元，增长了45%。Meet me at 10:30 on 2026-12-02, it costs $12.50."
    assert len(split_sentences(text)) == 2
    got, streamed = [], []
    with ChatTTSClient(url_of(served_tiny, protocol), protocol=protocol) as c:
        audio = c.synthesize(text, seed=2, on_spoken_text=got.append, **FIXED)
        chunks = list(c.stream(text, seed=2, on_spoken_text=streamed.append, **FIXED))
    assert audio.size > 0 and chunks
    assert got == streamed and len(got) == 2
    assert got[0] == "我有三个苹果，价格是十二点五元，增长了百分之四十五。"
    assert ("ten thirty" in got[1] and "twelve dollars and fifty cents" in got[1]
            and not any(ch.isdigit() for ch in got[1]))


def test_cli_shows_the_spoken_text(served_tiny, tmp_path):
    for extra in ([], ["--stream"]):
        cmd = [sys.executable, "-m", "client", "价格是12.5元。", "-o", str(tmp_path / "x.wav"), "--url",
               served_tiny.grpc_url,
               "--show-spoken-text", "--max-new-tokens", str(TOKENS), "--min-new-tokens", str(TOKENS), *extra]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert "spoken: 价格是十二点五元。" in run.stdout.splitlines()
