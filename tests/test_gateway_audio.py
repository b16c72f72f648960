"""gateway.audio at every output rate and in every format, G.711 included, without a server: whole files and
streams decoded back by FFmpeg and libsndfile and compared with the 24 kHz audio, resampled by another library."""

import io
import struct
from fractions import Fraction

import numpy as np
import pytest
import soundfile

from chattts_triton.config import SAMPLE_RATE
from gateway.audio import (
    FORMATS,
    G711,
    OPUS_RATES,
    SAMPLE_RATES,
    StreamEncoder,
    check,
    decode,
    encode,
    out_length,
    resample,
    to_int16,
)

LOSSLESS = ("flac", "wav", "pcm")
# samples a decoder may add past out_length: priming and the last frame's padding where no header says the length
# (ADTS, and every stream but Opus's), and FFmpeg's LAME tag, which misses a few samples of padding at some lengths
WHOLE_SLACK = {"mp3": 576, "aac": 2 * 1024}
STREAM_SLACK = {"mp3": 2 * 1152, "aac": 2 * 1024}
COMBINATIONS = [(f, r) for f in FORMATS for r in SAMPLE_RATES if f != "opus" or r in OPUS_RATES]


def speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """A voice-like signal inside the telephone band: harmonics of a gliding pitch in syllable-like bursts, over a
    100 Hz → 3.4 kHz sweep."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = 150 + 60 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    voice = sum((0.5 / k) * np.sin(k * phase) * (1 + 0.5 * np.sin(2 * np.pi * (3 + k) * t)) for k in range(1, 16))
    bursts = np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 0.5
    sweep = np.sin(2 * np.pi * (100 * t + 3300 / (2 * seconds) * t * t))
    return (0.3 * voice * bursts / np.abs(voice).max() + 0.2 * sweep).astype(np.float32)


def ffmpeg_resampled(audio: np.ndarray, rate: int) -> np.ndarray:
    """The reference at `rate` by FFmpeg's resampler (libswresample), not the encoders' libsoxr."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    frame = av.AudioFrame.from_ndarray(audio.reshape(1, -1), format="flt", layout="mono")
    frame.sample_rate = SAMPLE_RATE
    return np.concatenate([f.to_ndarray().reshape(-1) for f in resampler.resample(frame) + resampler.resample(None)])


def snr_db(reference: np.ndarray, got: np.ndarray) -> float:
    n = min(reference.size, got.size)
    noise = np.sum((reference[:n].astype(np.float64) - got[:n]) ** 2)
    return float(10 * np.log10(np.sum(reference[:n].astype(np.float64) ** 2) / max(noise, 1e-30)))


def samples16(decoded: np.ndarray) -> np.ndarray:
    return np.round(decoded * 32768).astype(np.int32)


def within_g711(decoded16: np.ndarray, expected16: np.ndarray) -> bool:
    """G.711's quantisation: half a step of the sample's segment, at most 1/32 of its size plus the smallest step."""
    expected16 = expected16.astype(np.int32)
    return (decoded16.size == expected16.size and bool(np.all(np.abs(decoded16 - expected16) <= np.abs(expected16) / 32
                                                              + 16)))


def random_chunks(audio: np.ndarray, rng: np.random.Generator):
    """Chunks of 0 to 4000 samples (empty and single samples among them), as a stream may deliver."""
    i = 0
    while i < audio.size:
        k = int(rng.choice([0, 1, int(rng.integers(2, 4000))], p=[0.05, 0.05, 0.9]))
        yield audio[i:i + k]
        i += k


def stream(fmt: str, rate: int, audio: np.ndarray, seed: int = 0):
    enc = StreamEncoder(fmt, rate)
    parts = [enc.push(c) for c in random_chunks(audio, np.random.default_rng(seed))]
    parts.append(enc.close())
    return enc, b"".join(parts)


def check_content(fmt: str, rate: int, audio: np.ndarray, decoded: np.ndarray) -> None:
    """Lossless formats carry the resampled 16-bit samples, G.711 them within its quantisation, lossy codecs a
    close copy; and all of them the 24 kHz audio as FFmpeg's resampler makes it at that rate."""
    expected = resample(audio, rate)
    n = expected.size
    if fmt in LOSSLESS:
        assert np.array_equal(samples16(decoded), to_int16(expected))
        assert snr_db(ffmpeg_resampled(audio, rate), decoded) > 45
    elif fmt in G711:
        assert within_g711(samples16(decoded), to_int16(expected))
        assert snr_db(ffmpeg_resampled(audio, rate), decoded) > 30
    else:  # lossy: the signal is there at its level (the best lag's correlation: priming shifts a stream without a
        # header; Opus keeps the spectrum more than the waveform)
        lag = int(np.argmax(np.correlate(decoded[:n // 4 + 4096], expected[:n // 4], "valid")))
        seg = decoded[lag:lag + n]
        assert np.corrcoef(seg, expected[:seg.size])[0, 1] > 0.8
        assert abs(seg.std() / expected.std() - 1) < 0.1


@pytest.mark.parametrize("fmt,rate", COMBINATIONS)
def test_whole_files_at_every_rate_decode_to_the_audio_resampled(fmt, rate):
    x = speechlike(1.3, seed=rate)
    y = decode(encode(fmt, x, rate), fmt, rate)
    assert 0 <= y.size - out_length(x.size, rate) <= WHOLE_SLACK.get(fmt, 0)
    check_content(fmt, rate, x, y)


@pytest.mark.parametrize("fmt,rate", COMBINATIONS)
def test_streams_in_random_chunks_decode_to_the_whole_files_audio(fmt, rate):
    x = speechlike(1.1, seed=rate + 1)
    enc, data = stream(fmt, rate, x, seed=rate)
    n = out_length(x.size, rate)
    assert (enc.samples, enc.out_samples) == (x.size, n)
    y = decode(data, fmt, rate)
    assert 0 <= y.size - n <= STREAM_SLACK.get(fmt, 0)
    check_content(fmt, rate, x, y)
    if fmt in ("pcm", "ulaw", "alaw"):  # no header: the stream's bytes are the whole file's
        assert data == encode(fmt, x, rate)
    elif fmt in ("wav", "flac", "wav_ulaw", "wav_alaw"):  # a stream's header differs, its samples are the file's
        assert np.array_equal(y, decode(encode(fmt, x, rate), fmt, rate))


@pytest.mark.parametrize("rate", SAMPLE_RATES)
def test_streamed_resampling_is_continuous_and_equals_the_whole(rate):
    """Chunk sizes of every kind (single samples, empty chunks, long ones) give the whole resampling's samples,
    out_length of them, and out_samples tracks what was written."""
    rng = np.random.default_rng(rate)
    for _ in range(4):
        x = (0.5 * rng.standard_normal(int(rng.integers(1, 30000)))).astype(np.float32)
        enc = StreamEncoder("pcm", rate)
        got, written = [], 0
        for chunk in random_chunks(x, rng):
            got.append(enc.push(chunk))
            written += len(got[-1]) // 2
            assert enc.out_samples == written <= out_length(enc.samples, rate)
        got.append(enc.close())
        assert b"".join(got) == to_int16(resample(x, rate)).tobytes() and enc.out_samples == out_length(x.size, rate)


@pytest.mark.parametrize("rate", SAMPLE_RATES)
def test_out_length_is_the_nearest_sample_halves_up(rate):
    rng = np.random.default_rng(rate)
    for n in [0, 1, 2, 79, 80, 160, 959, 960, *map(int, rng.integers(0, 10**7, 200))]:
        assert out_length(n, rate) == int(Fraction(n * rate, SAMPLE_RATE) + Fraction(1, 2))
    assert out_length(12345, SAMPLE_RATE) == 12345


@pytest.mark.parametrize("rate", SAMPLE_RATES)
def test_resampling_keeps_what_the_rate_carries_and_aliases_nothing(rate):
    """A 3 kHz tone survives every rate; a 9 kHz one survives where the rate carries it and is removed (not folded
    to a false tone) where it does not."""
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    x = (0.3 * np.sin(2 * np.pi * 3000 * t) + 0.3 * np.sin(2 * np.pi * 9000 * t)).astype(np.float32)
    y = resample(x, rate)
    assert y.dtype == np.float32 and y.size == rate
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size))) / (y.size / 4)  # 1 Hz bins: a tone of 0.3 peaks at 0.3
    assert abs(spectrum[3000] - 0.3) < 0.01
    if rate > 2 * 9000:
        assert abs(spectrum[9000] - 0.3) < 0.01
    else:
        alias = abs(rate - 9000) if rate > 9000 else 9000 % rate
        assert spectrum[alias - 20:alias + 21].max() < 1e-3
    assert resample(x, SAMPLE_RATE) is x  # the model's rate: the audio itself, no resampling


@pytest.mark.parametrize("fmt", ["ulaw", "alaw"])
@pytest.mark.parametrize("rate", [8000, 16000, 48000])
def test_raw_g711_reads_the_same_by_libsndfile_and_ffmpeg(fmt, rate):
    x = speechlike(0.7, seed=3)
    data = encode(fmt, x, rate)
    assert len(data) == out_length(x.size, rate)  # one byte a sample, no header
    by_sndfile, sr = soundfile.read(io.BytesIO(data), dtype="int16", format="RAW", subtype=G711[fmt], samplerate=rate,
                                    channels=1)
    assert np.array_equal(by_sndfile, samples16(decode(data, fmt, rate)))
    assert within_g711(by_sndfile.astype(np.int32), to_int16(resample(x, rate)))


@pytest.mark.parametrize("fmt,codec,tag", [("wav_ulaw", "pcm_mulaw", 7), ("wav_alaw", "pcm_alaw", 6)])
@pytest.mark.parametrize("rate", [8000, 22050, 44100])
@pytest.mark.parametrize("streamed", [False, True])
def test_g711_wav_files_carry_their_format_tag_rate_and_length_for_libsndfile_and_ffmpeg(fmt,
                                                                                         codec, tag, rate, streamed):
    import av

    x = speechlike(0.6, seed=4)
    data = stream(fmt, rate, x)[1] if streamed else encode(fmt, x, rate)
    info = soundfile.info(io.BytesIO(data))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", G711[fmt], rate, 1)
    assert info.frames == out_length(x.size, rate)  # a stream's sizes are unknown: libsndfile counts to the end
    with av.open(io.BytesIO(data)) as f:
        s = f.streams.audio[0]
        assert (s.codec_context.name, s.rate) == (codec, rate)
    # WAVE_FORMAT_MULAW (7) / ALAW (6), mono, the rate, 8 bits a sample
    fmt_chunk = data.index(b"fmt ") + 8
    assert struct.unpack_from("<HHIIHH", data, fmt_chunk) == (tag, 1, rate, rate, 1, 8)
    by_sndfile = soundfile.read(io.BytesIO(data), dtype="int16")[0]
    assert np.array_equal(by_sndfile, samples16(decode(data, fmt, rate)))
    raw = fmt.removeprefix("wav_")
    assert data.endswith(encode(raw, x, rate))  # the data chunk is the raw G.711 bytes, last in the file


@pytest.mark.parametrize("fmt", ["pcm", "wav", "ulaw", "wav_alaw", "mp3"])
def test_an_empty_stream_and_one_closed_twice_end_cleanly(fmt):
    for rate in (8000, SAMPLE_RATE):
        enc = StreamEncoder(fmt, rate)
        data = enc.push(np.zeros(0, np.float32)) + enc.close()
        assert enc.close() == b"" and enc.out_samples == 0
        if fmt in ("pcm", "ulaw"):
            assert data == b""
        enc = StreamEncoder(fmt, rate)
        enc.push(speechlike(0.1))
        enc.abort()
        assert enc.close() == b""


@pytest.mark.parametrize("call", ["encode", "stream", "resample", "out_length", "check"])
@pytest.mark.parametrize("fmt,rate,named", [("pcm", 11025, "11025"), ("wav", 0, "0"), ("pcm", True, "True"),
                                            ("ulaw", "8000", "'8000'"), ("ogg", 8000, "'ogg'"),
                                            ("opus", 22050, "22050"), ("opus", 44100, "44100")])
def test_a_bad_rate_or_format_is_a_value_error_naming_it(call, fmt, rate, named):
    x = speechlike(0.05)
    run = {"encode": lambda: encode(fmt, x, rate), "stream": lambda: StreamEncoder(fmt, rate),
           "resample": lambda: resample(x, rate), "out_length": lambda: out_length(100, rate),
           "check": lambda: check(fmt, rate)}[call]
    if call in ("resample", "out_length") and (fmt == "ogg" or fmt == "opus"):
        run()  # no format there: an Opus-only restriction is not theirs
        return
    with pytest.raises(ValueError, match=named):
        run()


def test_decoding_at_a_rate_the_file_is_not_is_a_value_error():
    data = encode("wav", speechlike(0.1), 16000)
    assert decode(data, "wav", 16000).size == out_length(speechlike(0.1).size, 16000)
    with pytest.raises(ValueError, match="16000"):
        decode(data, "wav", 8000)


def test_audio_cost_probe_measures_every_rate_and_format_it_can_and_writes_json(tmp_path, capsys):
    import json

    from bench.probes import audio_cost

    out = tmp_path / "cost.json"
    assert audio_cost.main(["--seconds", "0.5", "--repeats", "1", "--formats", "ulaw,opus", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    expected = {("resample", r) for r in SAMPLE_RATES if r != SAMPLE_RATE} | {("ulaw", r) for r in SAMPLE_RATES} | {
        ("opus", r) for r in OPUS_RATES}
    assert {(r["what"], r["rate"]) for r in rows} == expected
    assert all(r["whole_ms_per_audio_s"] >= 0 and r["stream_ms_per_audio_s"] > 0 for r in rows)
    assert all(0 < r["stream_delay"]["mean_ms"] <= r["stream_delay"]["max_ms"] for r in rows if r["what"] == "resample")
    assert capsys.readouterr().out.count("| ulaw |") == len(SAMPLE_RATES)
