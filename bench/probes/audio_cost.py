"""What output rates and telephone codecs cost the gateway: CPU time per second of audio (gateway/audio.py).

    python -m bench.probes.audio_cost [--seconds 20] [--repeats 5] [--formats pcm,ulaw,alaw,wav_ulaw] [--out FILE.json]

For each output rate: resampling the model's 24 kHz audio (libsoxr), whole and as a stream of 40 ms chunks (the
stream's delay: the audio the resampler holds after a chunk, largest and mean), then each format at that rate,
whole (`encode`) and streamed in 40 ms chunks (`StreamEncoder`), resampling included. CPU time of this process
(`time.process_time`), the least of `--repeats` runs (a shared machine's other work only adds). The audio is a
speech-like signal of `--seconds`: libsoxr and G.711 cost the same on any content.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from chattts_triton.config import SAMPLE_RATE
from gateway.audio import FORMATS, SAMPLE_RATES, StreamEncoder, check, encode, out_length, resample

CHUNK = SAMPLE_RATE * 40 // 1000  # 40 ms: a realtime path's chunk


def speechlike(seconds: float) -> np.ndarray:
    """Harmonics of a gliding pitch in syllable-like bursts over a sweep, with a little noise (float32, ±0.5)."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    phase = 2 * np.pi * np.cumsum(150 + 60 * np.sin(2 * np.pi * 0.7 * t)) / SAMPLE_RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 16)) * np.clip(np.sin(2 * np.pi * 4 * t), 0, None)
    sweep = np.sin(2 * np.pi * (100 * t + 50 * t * t))
    noise = np.random.default_rng(0).standard_normal(t.size)
    return (0.3 * voice / np.abs(voice).max() + 0.15 * sweep + 0.01 * noise).astype(np.float32)


def cpu_ms(work: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        work()
        best = min(best, time.process_time() - t)
    return best * 1e3


def streamed(fmt: str, rate: int, audio: np.ndarray) -> int:
    enc = StreamEncoder(fmt, rate)
    n = sum(len(enc.push(audio[i:i + CHUNK])) for i in range(0, audio.size, CHUNK))
    return n + len(enc.close())


def stream_delay_ms(rate: int, audio: np.ndarray) -> dict[str, float]:
    """The audio a 40 ms-chunk stream's resampler holds after each chunk: largest and mean, in ms."""
    enc = StreamEncoder("pcm", rate)
    held = []
    for i in range(0, audio.size, CHUNK):
        enc.push(audio[i:i + CHUNK])
        held.append(out_length(enc.samples, rate) - enc.out_samples)
    enc.close()
    return {"max_ms": 1e3 * max(held) / rate, "mean_ms": 1e3 * float(np.mean(held)) / rate}


def measure(seconds: float, repeats: int, formats: list[str]) -> dict:
    audio = speechlike(seconds)
    rows = []
    for rate in SAMPLE_RATES:
        if rate != SAMPLE_RATE:
            resampled = resample(audio, rate)
            assert resampled.size == out_length(audio.size, rate)
            rows.append({"what": "resample", "rate": rate,
                         "whole_ms_per_audio_s": cpu_ms(lambda rate=rate: resample(audio, rate), repeats) / seconds,
                         "stream_ms_per_audio_s": cpu_ms(lambda rate=rate: streamed("pcm", rate, audio),
                                                         repeats) / seconds,
                         "stream_delay": stream_delay_ms(rate, audio)})
        for fmt in formats:
            try:
                check(fmt, rate)
            except ValueError:  # Opus at 22050 / 44100
                continue
            size = len(encode(fmt, audio, rate))
            rows.append({"what": fmt, "rate": rate, "kbit_per_s": size * 8 / seconds / 1e3,
                         "whole_ms_per_audio_s": cpu_ms(lambda fmt=fmt, rate=rate: encode(fmt, audio, rate),
                                                        repeats) / seconds,
                         "stream_ms_per_audio_s": cpu_ms(lambda fmt=fmt, rate=rate: streamed(fmt, rate, audio),
                                                         repeats) / seconds})
    return {"audio_seconds": seconds, "repeats": repeats, "chunk_ms": 1e3 * CHUNK / SAMPLE_RATE,
            "cpu": os.uname().machine, "cores": os.cpu_count(), "rows": rows}


def table(result: dict) -> str:
    lines = ["| what | rate | whole: CPU ms per audio s | 40 ms stream: CPU ms per audio s | kbit/s | stream delay max "
             "/ mean ms |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        kbit = f"{r['kbit_per_s']:.0f}" if "kbit_per_s" in r else ""
        delay = f"{r['stream_delay']['max_ms']:.1f} / {r['stream_delay']['mean_ms']:.1f}" if "stream_delay" in r else ""
        lines.append(f"| {r['what']} | {r['rate']} | {r['whole_ms_per_audio_s']:.3f} | "
                     f"{r['stream_ms_per_audio_s']:.3f} | "
                     f"{kbit} | {delay} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.audio_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="audio length (default 20)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each, the least CPU time kept (default 5)")
    ap.add_argument("--formats", default="pcm,ulaw,alaw,wav_ulaw", help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    a = ap.parse_args(argv)
    formats = [f for f in a.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    if bad or a.seconds <= 0 or a.repeats < 1:
        ap.error(f"--formats: unknown {', '.join(bad)}" if bad else "--seconds and --repeats must be positive")
    result = measure(a.seconds, a.repeats, formats)
    print(f"{a.seconds:g} s of audio, {a.repeats} runs each (least CPU time), streams in {result['chunk_ms']:g} ms "
          "chunks")
    print(table(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
