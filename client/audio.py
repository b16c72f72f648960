"""WAV files without extra dependencies: 16-bit PCM (stdlib `wave`) or 32-bit float (RIFF by hand,
since `wave` only knows integer PCM)."""

from __future__ import annotations

import struct
import wave
from pathlib import Path
from typing import Tuple, Union

import numpy as np

from chattts_triton.config import SAMPLE_RATE

FORMATS = ("pcm16", "float32")
_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_IEEE_FLOAT = 3
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


class WavError(ValueError):
    """A WAV file that cannot be read or is not what the caller needs."""


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16, clipping out-of-range samples instead of wrapping around."""
    return np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")


def save_wav(
    path: Union[str, Path],
    audio: np.ndarray,
    sample_rate: int = SAMPLE_RATE,
    fmt: str = "pcm16",
) -> Path:
    """Write mono `audio` (float samples in [-1, 1]) as a WAV file; returns the path."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"expected mono 1-D audio, got shape {audio.shape}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pcm16":
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(to_pcm16(audio).tobytes())
        return path
    data = audio.astype("<f4").tobytes()
    # Non-PCM formats carry a cbSize field and a `fact` chunk (sample count).
    fmt_chunk = struct.pack("<HHIIHHH", _WAVE_FORMAT_IEEE_FLOAT, 1, sample_rate, sample_rate * 4, 4, 32, 0)
    fact_chunk = struct.pack("<I", audio.size)
    body = (
        b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk
        + b"fact" + struct.pack("<I", len(fact_chunk)) + fact_chunk
        + b"data" + struct.pack("<I", len(data)) + data
        + (b"\x00" if len(data) % 2 else b"")
    )  # fmt: skip
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return path


def read_wav(path: Union[str, Path]) -> Tuple[np.ndarray, int]:
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


def load_reference_audio(path: Union[str, Path], sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 speaker reference at the model rate (channels averaged; no resampling)."""
    samples, rate = read_wav(path)
    if rate != sample_rate:
        raise WavError(f"{path}: sample rate {rate} Hz; the reference must be {sample_rate} Hz (resample it first)")
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float32)
    if samples.size == 0:
        raise WavError(f"{path}: no samples")
    return samples
