"""Named voices: the registry in the model repository (chattts_triton.voices), VOICE in preprocess and in the
stream model, the command line, and the export's built-in voices. Checked against upstream ChatTTS's own
`Chat.sample_random_speaker()` after `torch.manual_seed(seed)`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chattts_triton.config import BUILTIN_VOICE_SEEDS, FULL_ARCH, PREPROCESS, SAMPLE_RATE, VOICES, samples_for_codes
from chattts_triton.model import speaker as spk
from chattts_triton.model.text import InputError
from chattts_triton.runtime import voices as V
from chattts_triton.triton.repo_config import read_manifest

ROOT = Path(__file__).resolve().parents[1]


def hidden_of(repo: Path) -> int:
    return read_manifest(repo)["arch"]["gpt"]["hidden"]


@pytest.fixture
def repo_copy(tiny_repo, tmp_path) -> Path:
    """A writable repository: the weights linked, manifest and voices.json copied."""
    dst = tmp_path / "repo"
    shutil.copytree(tiny_repo, dst, copy_function=os.link)
    for name in ("manifest.json", VOICES):
        (dst / name).unlink()
        shutil.copy(tiny_repo / name, dst / name)
    return dst


# --- built-in voices and seeds -----------------------------------------------------------------------
def test_seed_voice_is_upstreams_sample_random_speaker_after_manual_seed():
    import logging

    import ChatTTS
    import torch
    from ChatTTS.config import Config
    from ChatTTS.model.speaker import Speaker

    chat = ChatTTS.Chat(logging.getLogger("upstream"))
    chat.speaker = Speaker(FULL_ARCH.gpt.hidden, Config().spk_stat)  # what Chat.load builds, without weights
    state = torch.get_rng_state()
    try:
        for seed in (2222, BUILTIN_VOICE_SEEDS["nova"]):
            torch.manual_seed(seed)
            assert V.seed_voice("x", seed, FULL_ARCH.gpt.hidden).speaker == chat.sample_random_speaker()
    finally:
        torch.set_rng_state(state)


def test_export_writes_the_builtin_voices(tiny_repo):
    voices = V.read_voices(tiny_repo / VOICES)
    assert (sorted(voices) == sorted(BUILTIN_VOICE_SEEDS)
            and {"alloy", "echo", "fable", "onyx", "nova", "shimmer"} <= set(voices))
    for name, v in voices.items():
        assert v.builtin and v.seed == BUILTIN_VOICE_SEEDS[name]
        assert v.speaker == spk.sample_random_speaker(v.seed, hidden_of(tiny_repo))


def test_reexport_keeps_added_voices_and_remakes_seed_voices_for_the_new_size(tmp_path):
    old = tmp_path / VOICES
    sample = spk.encode_prompt(np.ones((4, 5), np.int64))
    V.write_voices(old, {"big": V.seed_voice("big", 7, FULL_ARCH.gpt.hidden),
                         "ref": V.Voice("ref", sample=sample, text="hello"),
                         "wrong": V.Voice("wrong", speaker=spk.sample_random_speaker(1, FULL_ARCH.gpt.hidden))})
    voices, notes = V.carried_over(old, 64)
    assert sorted(voices) == ["big", "ref"] and voices["big"].speaker == spk.sample_random_speaker(7, 64)
    assert any("'wrong' dropped" in n for n in notes) and any("reference-audio" in n for n in notes)
    assert sorted(V.carried_over(tmp_path / "none.json", 64)[0]) == sorted(BUILTIN_VOICE_SEEDS)


# --- the registry -----------------------------------------------------------------------------------
def test_registry_resolves_names_and_seed_numbers_and_lists_the_known_on_a_miss(repo_copy):
    reg = V.VoiceRegistry(repo_copy, hidden_of(repo_copy))
    assert reg.resolve("alloy").speaker == spk.sample_random_speaker(BUILTIN_VOICE_SEEDS["alloy"], 64)
    assert reg.resolve("2222").speaker == spk.sample_random_speaker(2222, 64)
    with pytest.raises(InputError,
                       match=r"VOICE 'nope' is not a voice of this server; known: alloy, echo, fable, nova"):
        reg.resolve("nope")
    with pytest.raises(InputError, match="VOICE"):
        reg.resolve("99999999999999999999")  # a seed beyond 64 bits


def test_registry_follows_edits_of_the_file_and_serves_builtins_without_one(repo_copy):
    reg = V.VoiceRegistry(repo_copy, 64)
    assert "alloy" in reg.voices()
    with V.editing(repo_copy, 64) as voices:
        voices["narrator"] = V.seed_voice("narrator", 42, 64)
        del voices["alloy"]
    assert reg.resolve("narrator").seed == 42
    with pytest.raises(InputError, match="narrator"):
        reg.resolve("alloy")
    (repo_copy / VOICES).unlink()
    assert sorted(reg.voices()) == sorted(BUILTIN_VOICE_SEEDS)


def test_unusable_entries_and_a_corrupt_file_fail_the_requests_that_name_a_voice_only(repo_copy):
    wrong_size = spk.sample_random_speaker(1, FULL_ARCH.gpt.hidden)  # a full-size speaker on tiny weights
    V.write_voices(repo_copy / VOICES, {"big": V.Voice("big", speaker=wrong_size), "ok": V.seed_voice("ok", 3, 64)})
    reg = V.VoiceRegistry(repo_copy, 64)
    assert reg.resolve("ok").seed == 3
    with pytest.raises(InputError, match="'big' cannot be used with this model: .*768.*64"):
        reg.resolve("big")
    (repo_copy / VOICES).write_text("{not json", encoding="utf-8")
    with pytest.raises(V.VoiceFileError, match="cannot be read"):
        reg.resolve("ok")
    (repo_copy / VOICES).write_text(json.dumps({"format": 1, "voices": {"1234": {"seed": 1}}}), encoding="utf-8")
    with pytest.raises(V.VoiceFileError, match="not all digits"):
        reg.resolve("ok")


# --- mixes (model/mix.py) -------------------------------------------------------------------------------
def test_registry_resolves_a_mix_of_names_and_seeds_by_the_rule(repo_copy):
    from chattts_triton.model import mix as M

    reg = V.VoiceRegistry(repo_copy, 64)
    voice = reg.resolve("2222*0.7+nova*0.3")
    expected = M.mix([spk.decode_speaker(spk.sample_random_speaker(2222, 64), 64),
                      spk.decode_speaker(spk.sample_random_speaker(BUILTIN_VOICE_SEEDS["nova"], 64), 64)],
                     [0.7, 0.3], 64)
    assert np.array_equal(spk.decode_speaker(voice.speaker, 64), expected)
    assert voice.mix == "2222*0.7+nova*0.3" and voice.source == "mix 2222*0.7+nova*0.3" and voice.sample is None
    assert reg.resolve("2222(7)+nova(3)").speaker == voice.speaker  # Kokoro's form, the same weights
    assert reg.resolve("2222*0.7+nova*0.3") is voice  # made once per version of the file
    assert reg.resolve("2222*0.5+alloy*0.5").speaker == reg.resolve("2222").speaker  # alloy is seed 2222
    with V.editing(repo_copy, 64) as voices:  # an edit of a term's voice reaches its mixes
        voices["nova"] = V.seed_voice("nova", 1, 64)
    assert reg.resolve("2222*0.7+nova*0.3").speaker != voice.speaker


def test_reexport_mixes_a_stored_mix_again_for_a_new_size_from_its_recipe(tmp_path):
    old = tmp_path / VOICES
    full = V.VoiceRegistry(tmp_path, FULL_ARCH.gpt.hidden)  # no voices.json here: the built-ins
    stored = V.mix_voice("2222*0.7+nova*0.3", full.resolve, FULL_ARCH.gpt.hidden, "warm")
    broken = V.Voice("odd", speaker=stored.speaker, mix="2222*0.5+gone*0.5")
    V.write_voices(old, {**V.builtin_voices(FULL_ARCH.gpt.hidden), "warm": stored, "odd": broken})
    voices, notes = V.carried_over(old, 64)
    tiny = V.mix_voice("2222*0.7+nova*0.3", V.VoiceRegistry(tmp_path / "none", 64).resolve, 64)
    assert voices["warm"].speaker == tiny.speaker and voices["warm"].mix == "2222*0.7+nova*0.3"
    assert "odd" not in voices and any("'odd' dropped: its mix cannot be made again" in n for n in notes)
    same, _ = V.carried_over(old, FULL_ARCH.gpt.hidden)  # the same size: the stored speaker, as stored
    assert same["warm"].speaker == stored.speaker


@pytest.mark.parametrize("expr, words", [
    ("2222*0.7+nobody*0.3", "VOICE 'nobody' is not a voice of this server; known: alloy"),
    ("2222*-0.7+nova*0.3", "VOICE '2222*-0.7+nova*0.3': term 1 of the voice mix (2222): weight '-0.7'"),
    ("2222*nan+nova", "weight 'nan'"),
    ("2222+", "term 2 of the voice mix '2222+' is empty"),
    ("+".join(["2222"] * 1000), "1000 terms"),
    ("reader*0.5+nova*0.5", "'reader' is a voice of reference audio; a mix is made of speaker embeddings only"),
])
def test_bad_mixes_are_input_errors_naming_voice(repo_copy, expr, words):
    with V.editing(repo_copy, 64) as voices:
        voices["reader"] = V.Voice("reader", sample=spk.encode_prompt(np.ones((4, 5), np.int64)), text="hi")
    with pytest.raises(InputError) as e:
        V.VoiceRegistry(repo_copy, 64).resolve(expr)
    assert str(e.value).startswith("VOICE ") and words in str(e.value)


def test_a_mix_in_voice_gives_the_prompt_of_the_mixed_speaker(pre):
    mixed = pre.voices.resolve("alloy*0.7+nova*0.3").speaker
    assert same_prompt(pre.prepare({"TEXT": b("你好"), "VOICE": b("alloy*0.7+nova*0.3")}),
                       pre.prepare({"TEXT": b("你好"), "SPEAKER": b(mixed)}))
    assert not same_prompt(pre.prepare({"TEXT": b("你好"), "VOICE": b("alloy*0.7+nova*0.3")}),
                           pre.prepare({"TEXT": b("你好"), "VOICE": b("alloy")}))
    with pytest.raises(InputError, match="^VOICE .*weight"):
        pre.prepare({"TEXT": b("你好"), "VOICE": b("alloy*0+nova")})


def test_cli_stores_a_mix_as_a_voice_and_a_stored_mix_mixes_again(repo_copy):
    run = cli(repo_copy, "add", "blend", "--mix", "2222(2)+nova(1)", "--description", "two of alloy")
    assert run.returncode == 0, run.stderr
    stored = V.read_voices(repo_copy / VOICES)["blend"]
    reg = V.VoiceRegistry(repo_copy, 64)
    assert stored.speaker == reg.resolve("2222*2+nova*1").speaker and stored.mix == "2222*0.666667+nova*0.333333"
    assert "blend\tmix 2222*0.666667+nova*0.333333: two of alloy" in cli(repo_copy, "list").stdout
    assert json.loads(cli(repo_copy, "list", "--json").stdout)["blend"]["mix"] == stored.mix
    assert (reg.resolve("blend").speaker == stored.speaker
            and reg.resolve("blend*0.5+echo*0.5").mix == "blend*0.5+echo*0.5")
    bad = cli(repo_copy, "add", "junk", "--mix", "2222*-1+nova")
    assert bad.returncode == 1 and "weight '-1'" in bad.stderr and "junk" not in V.read_voices(repo_copy / VOICES)
    unknown = cli(repo_copy, "add", "junk", "--mix", "2222+ghost")
    assert unknown.returncode == 1 and "'ghost' is not a voice" in unknown.stderr


# --- reference audio, decoded as the CLI and the gateway do ---------------------------------------------
def tone_file(fmt: str, seconds: float = 1.0, rate: int = 16000, channels: int = 1) -> bytes:
    import io

    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 220 * t)
    buf = io.BytesIO()
    soundfile.write(buf, np.stack([x] * channels, 1) if channels > 1 else x, rate, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, rate, channels", [("WAV", 16000, 1), ("FLAC", 48000, 2), ("OGG", 44100, 1),
                                                 ("MP3", 22050, 1)])
def test_reference_audio_of_common_formats_is_24k_mono(fmt, rate, channels):
    import io

    wav = V.decode_reference_audio(io.BytesIO(tone_file(fmt, 1.0, rate, channels)))
    # stereo: FFmpeg sums at -3 dB
    assert wav.dtype == np.float32 and abs(wav.size - SAMPLE_RATE) <= 2048 and 0.2 < np.abs(wav).max() < 0.45


@pytest.mark.parametrize("data, words", [
    (b"", "not readable audio"),
    (b"hello, this is no audio at all " * 50, "not readable audio"),
    (b"\x89PNG\r\n\x1a\n" + bytes(2000), "not a recording in a common audio format"),
    (b"#EXTM3U\n#EXTINF:1,x\nhttp://127.0.0.1/a.wav\n", "not"),
])
def test_what_is_not_reference_audio_is_an_input_error(data, words):
    import io

    with pytest.raises(InputError) as e:
        V.decode_reference_audio(io.BytesIO(data), what="'voice.audio'")
    assert str(e.value).startswith("'voice.audio'") and words in str(e.value)


def test_reference_audio_longer_than_the_limit_stops_decoding_at_it():
    import io
    import time

    data = tone_file("FLAC", 600.0, 8000)  # ten minutes: small as FLAC, long decoded
    t = time.perf_counter()
    with pytest.raises(InputError, match="longer than 15 s"):
        V.decode_reference_audio(io.BytesIO(data))
    assert time.perf_counter() - t < 2.0
    assert V.decode_reference_audio(io.BytesIO(tone_file("WAV", 14.5))).size == int(14.5 * SAMPLE_RATE)


@pytest.mark.parametrize("name", ["", "12345", "-lead", "has space", "x" * 65, "名字"])
def test_bad_voice_names_are_refused(name):
    with pytest.raises(InputError, match="voice name"):
        V.check_name(name)


# --- VOICE in preprocess (chattts_preprocess and chattts_stream share PreprocessService) ----------------
@pytest.fixture(scope="module")
def pre(tiny_repo):
    import torch

    from chattts_triton.config import Arch
    from chattts_triton.runtime.preprocess import PreprocessService

    service = PreprocessService(tiny_repo / PREPROCESS / "1", Arch.from_json(read_manifest(tiny_repo)["arch"]),
                                torch.device("cpu"), "torchscript")
    yield service
    service.close()


def b(s: str) -> np.ndarray:
    return np.array([[s.encode()]], dtype=object)


def same_prompt(a, b_) -> bool:
    return all(np.array_equal(a[k], b_[k]) for k in a)


def test_voice_gives_the_prompt_of_its_speaker(pre):
    speaker = spk.sample_random_speaker(BUILTIN_VOICE_SEEDS["echo"], 64)
    by_voice = pre.prepare({"TEXT": b("你好"), "VOICE": b("echo")})
    assert same_prompt(by_voice, pre.prepare({"TEXT": b("你好"), "SPEAKER": b(speaker)}))
    assert same_prompt(pre.prepare({"TEXT": b("你好"), "VOICE": b("2222")}),
                       pre.prepare({"TEXT": b("你好"), "SPEAKER": b(spk.sample_random_speaker(2222, 64))}))
    assert by_voice["SPK_EMB"].size == 64 and not same_prompt(by_voice, pre.prepare({"TEXT": b("你好")}))


def test_voice_conflicts_with_an_explicit_input_for_what_it_holds(pre, tmp_path):
    with pytest.raises(InputError, match="give VOICE or SPEAKER, not both"):
        pre.prepare({"TEXT": b("hi"), "VOICE": b("alloy"), "SPEAKER": b(spk.sample_random_speaker(1, 64))})
    with pytest.raises(InputError, match="known: alloy"):
        pre.prepare({"TEXT": b("hi"), "VOICE": b("")})
    # a speaker voice with a reference sample of the request's own: upstream's spk_emb + spk_smp
    sample = spk.encode_prompt(np.full((4, 6), 3, np.int64))
    both = pre.prepare({"TEXT": b("hi"), "VOICE": b("alloy"), "SPEAKER_SAMPLE": b(sample), "SPEAKER_TEXT": b("ref")})
    assert both["AUDIO_PROMPT"].shape == (1, 6, 4) and both["SPK_EMB"].size == 64


def test_voice_from_reference_audio_equals_sending_that_audio(pre, repo_copy):
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    wav = (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    sample = V.encode_reference(repo_copy, wav)
    with V.editing(repo_copy, 64) as voices:
        voices["reader"] = V.Voice("reader", sample=sample, text="参考音频")
    from chattts_triton.runtime.preprocess import PreprocessService

    own = PreprocessService(repo_copy / PREPROCESS / "1", pre.arch, pre.encoder_path[2], "torchscript")
    try:
        by_voice = own.prepare({"TEXT": b("你好"), "VOICE": b("reader")})
        direct = own.prepare({"TEXT": b("你好"), "SPEAKER_AUDIO": wav.reshape(1, -1), "SPEAKER_TEXT": b("参考音频")})
        assert same_prompt(by_voice, direct) and by_voice["AUDIO_PROMPT"].shape[1] > 0
        with pytest.raises(InputError, match="give VOICE or SPEAKER_AUDIO"):
            own.prepare({"TEXT": b("hi"), "VOICE": b("reader"), "SPEAKER_AUDIO": wav.reshape(1, -1)})
    finally:
        own.close()


# --- command line -----------------------------------------------------------------------------------
def cli(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chattts_triton.voices", "--repo", str(repo), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_adds_lists_and_removes_voices(repo_copy, tmp_path):
    speaker_file = tmp_path / "speaker.txt"
    speaker_file.write_text(spk.sample_random_speaker(5, 64) + "\n", encoding="utf-8")
    wav = tmp_path / "ref.wav"
    import soundfile

    soundfile.write(wav, 0.2 * np.sin(np.linspace(0, 900, 16000)), 16000)  # 16 kHz: resampled to 24 kHz
    assert cli(repo_copy, "add", "narrator", "--seed", "2222", "--description", "calm").returncode == 0
    assert cli(repo_copy, "add", "mine", "--speaker", f"@{speaker_file}").returncode == 0
    run = cli(repo_copy, "add", "reader", "--audio", str(wav), "--text", "参考音频")
    assert run.returncode == 0, run.stderr
    listed = cli(repo_copy, "list").stdout
    assert "narrator\tseed 2222: calm" in listed and "mine\tspeaker string" in listed
    assert "reader\treference audio" in listed and "alloy\tseed 2222 (built-in)" in listed
    voices = V.read_voices(repo_copy / VOICES)
    assert voices["narrator"].speaker == spk.sample_random_speaker(2222, 64) and voices["reader"].text == "参考音频"
    assert spk.decode_prompt(voices["reader"].sample).shape[1] == pytest.approx(SAMPLE_RATE / 512, abs=2)

    refused = cli(repo_copy, "add", "narrator", "--seed", "1")
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert cli(repo_copy, "add", "narrator", "--seed", "1", "--force").returncode == 0
    bad = cli(repo_copy, "add", "junk", "--speaker", "not a speaker")
    assert bad.returncode == 1 and "base16384" in bad.stderr
    assert cli(repo_copy, "add", "x", "--audio", str(wav)).returncode == 2  # no transcript
    assert cli(repo_copy, "remove", "alloy").returncode == 0
    assert "alloy" not in V.read_voices(repo_copy / VOICES) and cli(repo_copy, "remove", "alloy").returncode == 1


# --- served ---------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_voice_over_grpc_and_http_and_in_the_stream_model(served_tiny, protocol):
    from client import ChatTTSClient, ChatTTSError

    fixed = dict(seed=4, max_new_tokens=20, min_new_tokens=20)
    url = served_tiny.grpc_url if protocol == "grpc" else served_tiny.http_url
    with ChatTTSClient(url, protocol=protocol) as c:
        by_name = c.synthesize("Hello world.", voice="onyx", **fixed)
        speaker = spk.sample_random_speaker(BUILTIN_VOICE_SEEDS["onyx"], hidden_of(served_tiny.model_repository))
        assert by_name.size == samples_for_codes(20)
        assert np.array_equal(by_name, c.synthesize("Hello world.", speaker=speaker, **fixed))
        assert np.concatenate(list(c.stream("Hello world.", voice="onyx", **fixed))).size == by_name.size
        for call in (c.synthesize, lambda *a, **k: list(c.stream(*a, **k))):
            with pytest.raises(ChatTTSError) as e:
                call("Hello.", voice="no-such-voice", **fixed)
            assert e.value.status == "INVALID_ARGUMENT" and "known: alloy, echo" in e.value.message
