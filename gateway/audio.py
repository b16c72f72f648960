"""The speech API's audio formats and sample rates, by maintained libraries: FFmpeg through PyAV (`av`) for the
compressed formats and for the streams in a container, libsndfile through `soundfile` for whole WAV and FLAC files
and for G.711, libsoxr through `soxr` for other rates than the model's 24 kHz, numpy for raw PCM. Mono, like
OpenAI's.

| format | container / codec | whole response | streamed |
|---|---|---|---|
| mp3 | MP3 (LAME) | FFmpeg, with the LAME/Xing header (gapless length) | FFmpeg, frame by frame |
| opus | Ogg / Opus (8, 16, 24, 48 kHz: Opus has no 22.05 or 44.1) | FFmpeg | FFmpeg, a page per 20 ms |
| aac | ADTS / AAC-LC | FFmpeg | FFmpeg |
| flac | FLAC | libsndfile | FFmpeg (STREAMINFO without the total length) |
| wav | RIFF / PCM 16-bit | libsndfile | FFmpeg (sizes 0xFFFFFFFF: unknown, as streaming writers do) |
| pcm | raw 16-bit little-endian | numpy | numpy |
| ulaw, alaw | raw G.711 μ-law / A-law, 8-bit | libsndfile | libsndfile, chunk by chunk |
| wav_ulaw, wav_alaw | RIFF / G.711 (WAVE_FORMAT_MULAW / ALAW) | libsndfile | FFmpeg's muxer, libsndfile's G.711 |

Every format is made from the same 16-bit samples (`to_int16`), G.711 from them by libsndfile alone, so a stream
of PCM, FLAC or G.711 carries its whole file's samples. At another rate than 24 kHz the audio is resampled first by
libsoxr (HQ), whole or as a stream (`soxr.ResampleStream`: continuous across chunks, the same samples as the whole), and
cut or padded to `out_length` samples at the end. A stream holds the resampler's delay (tens of ms, the most at
8 kHz) until its next chunk or its close.
"""

from __future__ import annotations

import io

import numpy as np

from chattts_triton.config import SAMPLE_RATE

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm", "ulaw", "alaw", "wav_ulaw", "wav_alaw")
SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
# Opus codes at 8, 12, 16, 24 and 48 kHz only (RFC 6716; FFmpeg's libopus refuses the others)
OPUS_RATES = tuple(r for r in SAMPLE_RATES if r in (8000, 12000, 16000, 24000, 48000))
# what needs no FFmpeg (PyAV): whole files by libsndfile or numpy, streams of raw PCM and raw G.711
WHOLE_WITHOUT_PYAV = ("flac", "wav", "pcm", "ulaw", "alaw", "wav_ulaw", "wav_alaw")
STREAM_WITHOUT_PYAV = ("pcm", "ulaw", "alaw")
# libsndfile's subtype of the G.711 formats: one G.711 encoder for the whole files and the streams (FFmpeg's
# pcm_mulaw rounds some negative samples to the next code: a stream would not carry its whole file's bytes)
G711 = {"ulaw": "ULAW", "alaw": "ALAW", "wav_ulaw": "ULAW", "wav_alaw": "ALAW"}
RESAMPLE_QUALITY = "HQ"  # libsoxr's default: flat to 0.9 × Nyquist, the image rejected far below 16-bit noise


def pyav_available() -> bool:
    """Whether FFmpeg's encoders can be loaded (PyAV is a requirement; a host may lack it, e.g. a GPU host
    carrying only the wheels it needs)."""
    import importlib.util

    return importlib.util.find_spec("av") is not None


def needs_pyav(fmt: str, streamed: bool) -> bool:
    return fmt not in (STREAM_WITHOUT_PYAV if streamed else WHOLE_WITHOUT_PYAV)


CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",  # RFC 7845: Ogg Opus is audio/ogg
    "aac": "audio/aac",  # ADTS
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",  # mono signed 16-bit little-endian at the asked rate, no header (OpenAI's pcm at 24 kHz)
    # headerless G.711 as telephony platforms name it (RFC 2046's audio/basic; VoiceXML's audio/x-alaw-basic);
    # both say 8 kHz, the rate a phone line asks for
    "ulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
    "wav_ulaw": "audio/wav",
    "wav_alaw": "audio/wav",
}
# (container, encoder, bit rate) of the formats FFmpeg writes; bit rates for mono speech. The G.711 WAV streams
# take FFmpeg's muxer only: the codec names the format tag, the packets are libsndfile's
FFMPEG = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "aac": ("adts", "aac", 64_000),
    "flac": ("flac", "flac", None),
    "wav": ("wav", "pcm_s16le", None),
    "wav_ulaw": ("wav", "pcm_mulaw", None),
    "wav_alaw": ("wav", "pcm_alaw", None),
}
# muxer options of a stream: every packet reaches the client when it is made (no 32 KB I/O buffer), and an
# Ogg page per 20 ms of Opus (FFmpeg's default holds pages for up to a second)
STREAM_OPTIONS: dict[str, dict[str, str]] = {"ogg": {"page_duration": "20000"}}


def check(fmt: str, sample_rate: int = SAMPLE_RATE) -> int:
    """The output rate of `fmt` at `sample_rate`, or ValueError naming what is wrong (the API's 400)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if isinstance(sample_rate, bool) or sample_rate not in SAMPLE_RATES:
        raise ValueError(f"unsupported sample_rate {sample_rate!r}; one of {', '.join(map(str, SAMPLE_RATES))}")
    if fmt == "opus" and sample_rate not in OPUS_RATES:
        raise ValueError(f"sample_rate {sample_rate} is not an Opus rate; opus codes at "
                         f"{', '.join(map(str, OPUS_RATES))}")
    return int(sample_rate)


def out_length(n: int, sample_rate: int) -> int:
    """Samples at `sample_rate` of `n` samples at the model's rate: the nearest, halves up (exact integers). Every
    encoder writes this many, whole or streamed."""
    rate = check("pcm", sample_rate)
    return (int(n) * rate + SAMPLE_RATE // 2) // SAMPLE_RATE


def _fit(audio: np.ndarray, n: int) -> np.ndarray:
    """`audio` cut or padded with silence to `n` samples (libsoxr's length is within a sample of the rule)."""
    if audio.size >= n:
        return audio[:n]
    return np.concatenate([audio, np.zeros(n - audio.size, audio.dtype)])


def resample(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """`audio` at the model's rate → float32 at `sample_rate` (libsoxr), `out_length` samples; the audio itself at
    the model's rate."""
    rate = check("pcm", sample_rate)
    if rate == SAMPLE_RATE:
        return audio
    import soxr

    x = np.ascontiguousarray(audio, np.float32)
    return _fit(soxr.resample(x, SAMPLE_RATE, rate, quality=RESAMPLE_QUALITY), out_length(x.size, rate))


def to_int16(audio: np.ndarray) -> np.ndarray:
    """float [-1, 1] → 16-bit samples (× 32767, clipped, not wrapped, outside), as client.audio writes WAV files.
    Every format is made from these, so a wav, flac and pcm response carry the same samples."""
    # numpy's elementwise clip costs several times min() and max(): audio already in range skips it (NaN fails
    # both comparisons and is clipped, as before); rint rounds half to even, as round() did
    if audio.size and not (audio.min() >= -1.0 and audio.max() <= 1.0):
        audio = np.clip(audio, -1.0, 1.0)
    scaled = np.multiply(audio, np.float32(32767.0) if audio.dtype == np.float32 else 32767.0)
    return np.rint(scaled, out=scaled).astype("<i2")


def pcm16(audio: np.ndarray) -> bytes:
    """OpenAI's pcm: signed 16-bit little-endian samples."""
    return to_int16(audio).tobytes()


class _Sink:
    """A write-only file for FFmpeg's muxer: what it wrote since the last take()."""

    def __init__(self):
        self.buf = bytearray()

    def write(self, data) -> int:
        self.buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


def _frame(audio: np.ndarray, rate: int):
    import av

    frame = av.AudioFrame.from_ndarray(to_int16(audio).reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = rate
    return frame


def _g711(audio: np.ndarray, rate: int, fmt: str, container: str = "RAW") -> bytes:
    """`audio` in G.711 by libsndfile: raw bytes, or a whole WAV file (`container="WAV"`)."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, to_int16(audio), rate, subtype=G711[fmt], format=container)
    return buf.getvalue()


def _open(fmt: str, file, streaming: bool, rate: int, samples: int = 0):
    import av

    container, codec, bit_rate = FFMPEG[fmt]
    if streaming:
        options = {"flush_packets": "1", **STREAM_OPTIONS.get(container, {})}
    else:  # FFmpeg's Ogg muxer writes a granule without the pre-skip when one page holds the whole stream (such a
        # file decodes a pre-skip too long, by FFmpeg and libsndfile alike): short files get short pages
        options = STREAM_OPTIONS.get(container, {}) if samples < 2 * rate else {}
    out = av.open(file, "w", format=container, options=options)
    stream = out.add_stream(codec, rate=rate, layout="mono")
    if bit_rate:
        stream.bit_rate = bit_rate
    return out, stream


class StreamEncoder:
    """Audio at the model's rate pushed in pieces as it arrives, its bytes at `sample_rate` given back at once:
    `push(samples)` returns what the resampler, encoder and muxer produced for them (the resampler keeps its delay,
    codecs with fixed frames a remainder), `close()` the rest. `samples` counts the samples pushed (24 kHz),
    `out_samples` those written at `sample_rate`: `out_length(samples)` once closed."""

    def __init__(self, fmt: str, sample_rate: int = SAMPLE_RATE):
        self.rate = check(fmt, sample_rate)
        self.fmt = fmt
        self.samples = 0
        self.out_samples = 0
        self._open = True
        self._out = self._stream = self._sink = self._resampler = None
        if self.rate != SAMPLE_RATE:
            import soxr

            self._resampler = soxr.ResampleStream(SAMPLE_RATE, self.rate, 1, dtype="float32", quality=RESAMPLE_QUALITY)
        if fmt not in STREAM_WITHOUT_PYAV:
            self._sink = _Sink()
            self._out, self._stream = _open(fmt, self._sink, streaming=True, rate=self.rate)
            # the codec opened and the header written now (up to a few ms: make the encoder before the first
            # chunk arrives); the header goes out with the first audio
            self._stream.codec_context.open()
            self._out.start_encoding()

    def push(self, audio: np.ndarray) -> bytes:
        self.samples += audio.size
        if self._resampler is not None:
            audio = self._resampler.resample_chunk(np.ascontiguousarray(audio, np.float32))
        return self._write(audio)

    def _write(self, audio: np.ndarray) -> bytes:
        self.out_samples += audio.size
        if self.fmt == "pcm":
            return pcm16(audio)
        if audio.size == 0:
            return b""
        if self.fmt in ("ulaw", "alaw"):  # G.711 codes each sample alone: a chunk's bytes are the file's
            return _g711(audio, self.rate, self.fmt)
        if self.fmt in G711:
            import av

            packet = av.Packet(_g711(audio, self.rate, self.fmt))
            packet.stream, packet.time_base = self._stream, self._stream.time_base
            packet.pts = packet.dts = self.out_samples - audio.size
            packet.duration = audio.size
            self._out.mux(packet)
        else:
            for packet in self._stream.encode(_frame(audio, self.rate)):
                self._out.mux(packet)
        return self._sink.take()

    def close(self) -> bytes:
        if not self._open:
            return b""
        data = b""
        if self._resampler is not None:  # the delay the resampler held, to the exact length
            tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            data = self._write(_fit(tail, max(0, out_length(self.samples, self.rate) - self.out_samples)))
            self._resampler = None
        self._open = False
        if self._out is None:
            return data
        if self.fmt not in G711:
            for packet in self._stream.encode(None):
                self._out.mux(packet)
        self._out.close()
        self._out = None
        return data + self._sink.take()

    def abort(self) -> None:
        self._open, self._resampler = False, None
        if self._out is not None:
            try:
                self._out.close()
            except Exception:  # noqa: BLE001  a half-written stream nobody reads
                pass
            self._out = None


def encode(fmt: str, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A whole file of `audio` (float32 mono at the model's rate) in `fmt` at `sample_rate` (resampled first), with
    its exact length in the header."""
    rate = check(fmt, sample_rate)
    audio = resample(audio, rate)
    if fmt == "pcm":
        return pcm16(audio)
    if fmt in G711:
        return _g711(audio, rate, fmt, "WAV" if fmt.startswith("wav_") else "RAW")
    if fmt in WHOLE_WITHOUT_PYAV:
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, to_int16(audio), rate, subtype="PCM_16", format=fmt.upper())
        return buf.getvalue()
    buf = io.BytesIO()
    out, stream = _open(fmt, buf, streaming=False, rate=rate, samples=audio.size)
    try:
        if audio.size:
            for packet in stream.encode(_frame(audio, rate)):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    finally:
        out.close()
    return buf.getvalue()


def decode(data: bytes, fmt: str | None = None, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The samples of an encoded file as float32 mono at `sample_rate` (FFmpeg; raw PCM by numpy; 16-bit samples /
    32768), the rate of the raw formats' data. A file at another rate is a ValueError, except Opus, which its
    decoder gives at 48 kHz: FFmpeg resamples it, as a player does. For tests and the benchmark: a round trip
    through a decoder no one here wrote."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    import av

    raw = {"ulaw": "mulaw", "alaw": "alaw"}.get(fmt)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)  # s16 → float: / 32768
    out = []
    with av.open(io.BytesIO(data), format=raw, options={"sample_rate": str(sample_rate)} if raw else {}) as f:
        stream = f.streams.audio[0]
        decoder = stream.codec_context
        if decoder.name == "opus":
            if "libopus" in av.codecs_available:  # FFmpeg's own Opus decoder turns some passages of libopus's
                # streams into full-scale noise; libopus is the reference decoder (libsndfile's, the browsers')
                decoder = av.CodecContext.create("libopus", "r")
                decoder.extradata = stream.codec_context.extradata
        elif stream.rate != sample_rate:
            raise ValueError(f"the file's sample rate is {stream.rate}, not {sample_rate}")
        for packet in f.demux(stream):  # the last one (empty) flushes the decoder
            for frame in decoder.decode(packet):
                out += [r.to_ndarray().reshape(-1) for r in resampler.resample(frame)]
        out += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
    return np.concatenate(out) if out else np.zeros(0, np.float32)
