"""TTS figures that generic load-test tools do not give: audio produced, real-time factor, and
failures by Triton status; for streams also time to the first chunk, gaps between chunks and
playback stalls. Shared by the Locust file (where workers ship their share to the master) and the
sweep."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from chattts_triton.config import SAMPLE_RATE

PERCENTILES = (50, 90, 99)


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    arr = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else None


def real_time_factor(latency_s: float, audio_samples: int, sample_rate: int = SAMPLE_RATE) -> float | None:
    """Wall time per second of audio (< 1: faster than real time); None for empty audio."""
    return latency_s * sample_rate / audio_samples if audio_samples > 0 else None


@dataclass
class TTSStats:
    """Per-request latency and audio length of successes, and a count of failures by status."""

    latencies_s: list[float] = field(default_factory=list)
    audio_samples: list[int] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)
    sample_rate: int = SAMPLE_RATE
    # successful streams only
    first_chunk_s: list[float] = field(default_factory=list)
    chunk_gaps_s: list[float] = field(default_factory=list)
    streams: int = 0
    stalled_streams: int = 0

    def record_success(self, latency_s: float, audio_samples: int) -> None:
        self.latencies_s.append(float(latency_s))
        self.audio_samples.append(int(audio_samples))

    def record_stream(self, first_chunk_s: float | None, chunk_gaps_s: Iterable[float], stalled: bool) -> None:
        """A successful stream: time to its first chunk (None: no audio), the gaps between its chunks,
        and whether a player started at the first chunk would have run out of audio."""
        self.streams += 1
        self.stalled_streams += int(bool(stalled))
        if first_chunk_s is not None:
            self.first_chunk_s.append(float(first_chunk_s))
        self.chunk_gaps_s.extend(float(g) for g in chunk_gaps_s)

    def record_failure(self, status: str) -> None:
        self.failures[status] += 1

    def reset(self) -> None:
        self.latencies_s.clear()
        self.audio_samples.clear()
        self.failures.clear()
        self.first_chunk_s.clear()
        self.chunk_gaps_s.clear()
        self.streams = self.stalled_streams = 0

    # Locust workers send what they gathered since their last report; the master merges it.
    def drain(self) -> dict:
        data = {"latencies_s": list(self.latencies_s), "audio_samples": list(self.audio_samples),
                "failures": dict(self.failures), "first_chunk_s": list(self.first_chunk_s),
                "chunk_gaps_s": list(self.chunk_gaps_s), "streams": self.streams,
                "stalled_streams": self.stalled_streams}  # fmt: skip
        self.reset()
        return data

    def merge(self, data: dict | None) -> None:
        if not data:
            return
        self.latencies_s.extend(data.get("latencies_s", []))
        self.audio_samples.extend(data.get("audio_samples", []))
        self.failures.update(data.get("failures", {}))
        self.first_chunk_s.extend(data.get("first_chunk_s", []))
        self.chunk_gaps_s.extend(data.get("chunk_gaps_s", []))
        self.streams += int(data.get("streams", 0))
        self.stalled_streams += int(data.get("stalled_streams", 0))

    def summary(self, wall_s: float | None = None) -> dict:
        """Totals and percentiles; `wall_s` (test duration) adds audio seconds per wall second."""
        rtfs = [r for r in map(real_time_factor, self.latencies_s, self.audio_samples) if r is not None]
        audio_s = sum(self.audio_samples) / self.sample_rate
        successes, failures = len(self.latencies_s), sum(self.failures.values())
        out = {
            "requests": successes + failures,
            "successes": successes,
            "failures": failures,
            "failures_by_status": dict(sorted(self.failures.items())),
            "empty_audio": sum(1 for n in self.audio_samples if n <= 0),
            "audio_seconds": audio_s,
            "mean_audio_seconds": audio_s / successes if successes else None,
            "rtf_p50": percentile(rtfs, 50),
            "rtf_p90": percentile(rtfs, 90),
        }
        for q in PERCENTILES:
            p = percentile(self.latencies_s, q)
            out[f"latency_p{q}_ms"] = None if p is None else p * 1000.0
        if self.streams:
            out["streams"] = self.streams
            out["stalled_streams"] = self.stalled_streams
            for name, values in (("first_chunk", self.first_chunk_s), ("chunk_gap", self.chunk_gaps_s)):
                for q in PERCENTILES:
                    p = percentile(values, q)
                    out[f"{name}_p{q}_ms"] = None if p is None else p * 1000.0
            out["chunk_gap_max_ms"] = max(self.chunk_gaps_s) * 1000.0 if self.chunk_gaps_s else None
        if wall_s:
            out["wall_seconds"] = wall_s
            out["audio_seconds_per_second"] = audio_s / wall_s
            out["utterances_per_second"] = successes / wall_s
        return out


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_summary(s: dict) -> str:
    lines = [
        "TTS summary",
        f"  requests {s['requests']}  ok {s['successes']}  failed {s['failures']}"
        + (f"  by status {s['failures_by_status']}" if s["failures"] else ""),
        f"  audio produced {s['audio_seconds']:.1f} s"
        + (f"  ({_fmt(s.get('audio_seconds_per_second'), '.2f')} s of audio per wall second)"
           if "wall_seconds" in s else ""),
        f"  real-time factor (wall / audio seconds, per request)  p50 {_fmt(s['rtf_p50'])}  p90 {_fmt(s['rtf_p90'])}",
        "  latency ms  " + "  ".join(f"p{q} {_fmt(s[f'latency_p{q}_ms'], '.0f')}" for q in PERCENTILES),
    ]
    if s.get("streams"):
        for name, label in (("first_chunk", "first chunk"), ("chunk_gap", "chunk gap")):
            lines.append(f"  {label} ms  " + "  ".join(f"p{q} {_fmt(s[f'{name}_p{q}_ms'], '.0f')}" for q in PERCENTILES)
                         + (f"  max {_fmt(s['chunk_gap_max_ms'], '.0f')}" if name == "chunk_gap" else ""))  # fmt: skip
        lines.append(f"  streams {s['streams']}  stalled a player started at the first chunk: {s['stalled_streams']}")
    if s["empty_audio"]:
        lines.append(f"  WARNING: {s['empty_audio']} successful responses had no audio samples")
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
