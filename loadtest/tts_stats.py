"""TTS figures that generic load-test tools do not give: audio produced, real-time factor, and
failures by Triton status. Shared by the Locust file (where workers ship their share to the master)
and the sweep."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import numpy as np

from chattts_triton.config import SAMPLE_RATE

PERCENTILES = (50, 90, 99)


def percentile(values: Iterable[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    arr = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else None


def real_time_factor(latency_s: float, audio_samples: int, sample_rate: int = SAMPLE_RATE) -> Optional[float]:
    """Wall time per second of audio (< 1: faster than real time); None for empty audio."""
    return latency_s * sample_rate / audio_samples if audio_samples > 0 else None


@dataclass
class TTSStats:
    """Per-request latency and audio length of successes, and a count of failures by status."""

    latencies_s: List[float] = field(default_factory=list)
    audio_samples: List[int] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)
    sample_rate: int = SAMPLE_RATE

    def record_success(self, latency_s: float, audio_samples: int) -> None:
        self.latencies_s.append(float(latency_s))
        self.audio_samples.append(int(audio_samples))

    def record_failure(self, status: str) -> None:
        self.failures[status] += 1

    def reset(self) -> None:
        self.latencies_s.clear()
        self.audio_samples.clear()
        self.failures.clear()

    # Locust workers send what they gathered since their last report; the master merges it.
    def drain(self) -> dict:
        data = {"latencies_s": list(self.latencies_s), "audio_samples": list(self.audio_samples),
                "failures": dict(self.failures)}  # fmt: skip
        self.reset()
        return data

    def merge(self, data: Optional[dict]) -> None:
        if not data:
            return
        self.latencies_s.extend(data.get("latencies_s", []))
        self.audio_samples.extend(data.get("audio_samples", []))
        self.failures.update(data.get("failures", {}))

    def summary(self, wall_s: Optional[float] = None) -> dict:
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
        + (f"  ({_fmt(s.get('audio_seconds_per_second'), '.2f')} s of audio per wall second)" if "wall_seconds" in s else ""),
        f"  real-time factor (wall / audio seconds, per request)  p50 {_fmt(s['rtf_p50'])}  p90 {_fmt(s['rtf_p90'])}",
        "  latency ms  " + "  ".join(f"p{q} {_fmt(s[f'latency_p{q}_ms'], '.0f')}" for q in PERCENTILES),
    ]
    if s["empty_audio"]:
        lines.append(f"  WARNING: {s['empty_audio']} successful responses had no audio samples")
    return "\n".join(lines)


def write_json(path: Union[str, Path], data: Dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
