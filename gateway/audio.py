"""The speech API's audio formats, encoded by maintained libraries: FFmpeg through PyAV (`av`) for the
compressed formats and for every stream, libsndfile through `soundfile` for whole WAV and FLAC files, numpy
for raw PCM. All at the model's 24 kHz, mono, like OpenAI's.

| format | container / codec | whole response | streamed |
|---|---|---|---|
| mp3 | MP3 (LAME) | FFmpeg, with the LAME/Xing header (gapless length) | FFmpeg, frame by frame |
| opus | Ogg / Opus | FFmpeg | FFmpeg, a page per 20 ms |
| aac | ADTS / AAC-LC | FFmpeg | FFmpeg |
| flac | FLAC | libsndfile | FFmpeg (STREAMINFO without the total length) |
| wav | RIFF / PCM 16-bit | libsndfile | FFmpeg (sizes 0xFFFFFFFF: unknown, as streaming writers do) |
| pcm | raw 16-bit little-endian | numpy | numpy |
"""

from __future__ import annotations

import io
from typing import Dict, Optional

import numpy as np

from chattts_triton.config import SAMPLE_RATE

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
# what needs no FFmpeg (PyAV): whole files by libsndfile or numpy, streams of raw PCM
WHOLE_WITHOUT_PYAV = ("flac", "wav", "pcm")
STREAM_WITHOUT_PYAV = ("pcm",)


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
    "pcm": "audio/pcm",  # 24 kHz mono signed 16-bit little-endian, no header (OpenAI's pcm)
}
# (container, encoder, bit rate) of the formats FFmpeg writes; bit rates for 24 kHz mono speech
FFMPEG = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "aac": ("adts", "aac", 64_000),
    "flac": ("flac", "flac", None),
    "wav": ("wav", "pcm_s16le", None),
}
# muxer options of a stream: every packet reaches the client when it is made (no 32 KB I/O buffer), and an
# Ogg page per 20 ms of Opus (FFmpeg's default holds pages for up to a second)
STREAM_OPTIONS: Dict[str, Dict[str, str]] = {"ogg": {"page_duration": "20000"}}


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


def _frame(audio: np.ndarray):
    import av

    frame = av.AudioFrame.from_ndarray(to_int16(audio).reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = SAMPLE_RATE
    return frame


def _open(fmt: str, file, streaming: bool, samples: int = 0):
    import av

    container, codec, bit_rate = FFMPEG[fmt]
    if streaming:
        options = {"flush_packets": "1", **STREAM_OPTIONS.get(container, {})}
    else:  # FFmpeg's Ogg muxer writes a granule without the pre-skip when one page holds the whole stream (such a
        # file decodes a pre-skip too long, by FFmpeg and libsndfile alike): short files get short pages
        options = STREAM_OPTIONS.get(container, {}) if samples < 2 * SAMPLE_RATE else {}
    out = av.open(file, "w", format=container, options=options)
    stream = out.add_stream(codec, rate=SAMPLE_RATE, layout="mono")
    if bit_rate:
        stream.bit_rate = bit_rate
    return out, stream


class StreamEncoder:
    """Audio pushed in pieces as it arrives, its bytes given back at once: `push(samples)` returns what the
    encoder and muxer produced for them (codecs with fixed frames keep a remainder), `close()` the rest."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.fmt = fmt
        self.samples = 0
        self._out = self._stream = self._sink = None
        if fmt not in STREAM_WITHOUT_PYAV:
            self._sink = _Sink()
            self._out, self._stream = _open(fmt, self._sink, streaming=True)
            # the codec opened and the header written now (up to a few ms: make the encoder before the first
            # chunk arrives); the header goes out with the first audio
            self._stream.codec_context.open()
            self._out.start_encoding()

    def push(self, audio: np.ndarray) -> bytes:
        self.samples += audio.size
        if self._out is None:
            return pcm16(audio)
        if audio.size == 0:
            return b""
        for packet in self._stream.encode(_frame(audio)):
            self._out.mux(packet)
        return self._sink.take()

    def close(self) -> bytes:
        if self._out is None:
            return b""
        for packet in self._stream.encode(None):
            self._out.mux(packet)
        self._out.close()
        self._out = None
        return self._sink.take()

    def abort(self) -> None:
        if self._out is not None:
            try:
                self._out.close()
            except Exception:  # noqa: BLE001  a half-written stream nobody reads
                pass
            self._out = None


def encode(fmt: str, audio: np.ndarray) -> bytes:
    """A whole file of `audio` (float32 mono at the model's rate) in `fmt`, with its exact length in the header."""
    if fmt == "pcm":
        return pcm16(audio)
    if fmt in WHOLE_WITHOUT_PYAV:
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, to_int16(audio), SAMPLE_RATE, subtype="PCM_16", format=fmt.upper())
        return buf.getvalue()
    buf = io.BytesIO()
    out, stream = _open(fmt, buf, streaming=False, samples=audio.size)
    try:
        if audio.size:
            for packet in stream.encode(_frame(audio)):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    finally:
        out.close()
    return buf.getvalue()


def decode(data: bytes, fmt: Optional[str] = None) -> np.ndarray:
    """The samples of an encoded file as float32 mono at the model's rate (FFmpeg; raw PCM by numpy; 16-bit
    samples / 32768). For tests and the benchmark: a round trip through a decoder no one here wrote."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)  # s16 → float: / 32768
    out = []
    with av.open(io.BytesIO(data)) as f:
        for frame in f.decode(audio=0):
            out += [r.to_ndarray().reshape(-1) for r in resampler.resample(frame)]
        out += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
    return np.concatenate(out) if out else np.zeros(0, np.float32)
