"""WAV files without extra dependencies: 16-bit PCM (the layout of stdlib `wave`) or 32-bit float,
written whole (`save_wav`) or as audio arrives (`WavStreamWriter`)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from chattts_triton.config import SAMPLE_RATE

FORMATS = ("pcm16", "float32")
_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_IEEE_FLOAT = 3
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


class WavError(ValueError):
    """A WAV file that cannot be read or is not what the caller needs."""


def snr_db(ref: np.ndarray, err: np.ndarray) -> float:
    """Signal-to-error ratio in dB: the RMS of `ref` over the RMS of `err` (inf for no error)."""
    e = float(np.sqrt(np.mean(np.asarray(err, np.float64) ** 2))) if np.size(err) else 0.0
    r = float(np.sqrt(np.mean(np.asarray(ref, np.float64) ** 2))) if np.size(ref) else 0.0
    return float("inf") if e == 0 else 20 * float(np.log10(max(r, 1e-12) / e))


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16, clipping out-of-range samples instead of wrapping around."""
    return np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")


def _encode(audio: np.ndarray, fmt: str) -> bytes:
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"expected mono 1-D audio, got shape {audio.shape}")
    return (to_pcm16(audio) if fmt == "pcm16" else audio.astype("<f4")).tobytes()


_UNKNOWN_SIZE = 0xFFFFFFFF


def _wav_header(fmt: str, sample_rate: int, data_bytes: int | None) -> bytes:
    """RIFF header up to the data chunk's size (same length whatever the size; None = not known yet).
    pcm16: the layout of stdlib `wave`. float32: non-PCM formats carry cbSize and a `fact` chunk."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if fmt == "pcm16":
        fmt_chunk = struct.pack("<HHIIHH", _WAVE_FORMAT_PCM, 1, sample_rate, sample_rate * 2, 2, 16)
        extra = b""
    else:
        fmt_chunk = struct.pack("<HHIIHHH", _WAVE_FORMAT_IEEE_FLOAT, 1, sample_rate, sample_rate * 4, 4, 32, 0)
        frames = _UNKNOWN_SIZE if data_bytes is None else data_bytes // 4
        extra = b"fact" + struct.pack("<II", 4, frames)
    head = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk + extra + b"data"
    if data_bytes is None:
        riff_size = data_size = _UNKNOWN_SIZE
    else:
        riff_size, data_size = len(head) + 4 + data_bytes, data_bytes  # data is never odd-sized here
    return b"RIFF" + struct.pack("<I", riff_size) + head + struct.pack("<I", data_size)


def save_wav(
    path: str | Path,
    audio: np.ndarray,
    sample_rate: int = SAMPLE_RATE,
    fmt: str = "pcm16",
) -> Path:
    """Write mono `audio` (float samples in [-1, 1]) as a WAV file; returns the path."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    data = _encode(audio, fmt)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_wav_header(fmt, sample_rate, len(data)) + data)
    return path


class WavStreamWriter:
    """A WAV written as audio arrives: the header's sizes are placeholders (0xFFFFFFFF, "unknown",
    as streaming writers use) until `close()` patches them; the result is the file `save_wav` writes
    for the same samples. `abort()` (and leaving a `with` block by an exception) deletes the file."""

    def __init__(self, path: str | Path, sample_rate: int = SAMPLE_RATE, fmt: str = "pcm16"):
        header = _wav_header(fmt, sample_rate, None)  # checks fmt before creating anything
        self.path, self.sample_rate, self.fmt = Path(path), sample_rate, fmt
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("wb")
        self._file.write(header)
        self._data_bytes = 0

    @property
    def samples(self) -> int:
        return self._data_bytes // (2 if self.fmt == "pcm16" else 4)

    def write(self, audio: np.ndarray) -> None:
        data = _encode(audio, self.fmt)
        self._file.write(data)
        self._file.flush()  # a player reading the file follows along
        self._data_bytes += len(data)

    def close(self) -> Path:
        if not self._file.closed:
            self._file.seek(0)
            self._file.write(_wav_header(self.fmt, self.sample_rate, self._data_bytes))
            self._file.close()
        return self.path

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> WavStreamWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """(samples as float32 — shape (n,) for mono, (n, channels) otherwise, sample rate)."""
    raw = Path(path).read_bytes()
    if len(raw) < 12 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise WavError(f"{path}: not a RIFF/WAVE file")
    fmt = data = None
    pos = 12
    while pos + 8 <= len(raw):
        chunk_id, size = raw[pos : pos + 4], struct.unpack("<I", raw[pos + 4 : pos + 8])[0]
        payload = raw[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt ":
            fmt = payload
        elif chunk_id == b"data":
            data = payload
        pos += 8 + size + (size % 2)
    if fmt is None or data is None or len(fmt) < 16:
        raise WavError(f"{path}: missing fmt or data chunk")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _WAVE_FORMAT_EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # first two bytes of the SubFormat GUID
    if channels < 1:
        raise WavError(f"{path}: {channels} channels")
    if tag == _WAVE_FORMAT_IEEE_FLOAT and bits == 32:
        samples = np.frombuffer(data[: len(data) // 4 * 4], dtype="<f4").astype(np.float32)
    elif tag == _WAVE_FORMAT_PCM and bits == 16:
        samples = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.float32) / 32768.0
    elif tag == _WAVE_FORMAT_PCM and bits == 32:
        samples = (np.frombuffer(data[: len(data) // 4 * 4], dtype="<i4") / 2147483648.0).astype(np.float32)
    else:
        raise WavError(f"{path}: unsupported WAV encoding (format {tag}, {bits} bits)")
    frames = samples.size // channels
    samples = samples[: frames * channels]
    return (samples if channels == 1 else samples.reshape(frames, channels)), rate


def load_reference_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 speaker reference at the model rate (channels averaged; no resampling)."""
    samples, rate = read_wav(path)
    if rate != sample_rate:
        raise WavError(f"{path}: sample rate {rate} Hz; the reference must be {sample_rate} Hz (resample it first)")
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float32)
    if samples.size == 0:
        raise WavError(f"{path}: no samples")
    return samples
