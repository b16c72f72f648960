"""Timings of a response's pieces, as JSON and as subtitles (SRT, WebVTT).

A piece's start and end are exact: the samples its audio occupies in the response, at the output's rate. ChatTTS
gives no word or character times, so there are none here (no times spread over the characters).
"""

from __future__ import annotations

import re
from typing import Any

from chattts_triton.model.text import TAG_RE

from .audio import out_length
from .synth import Segment

SUBTITLE_FORMATS = ("srt", "vtt")
CONTENT_TYPES = {"srt": "application/x-subrip", "vtt": "text/vtt"}


def segment_json(seg: Segment, sample_rate: int) -> dict[str, Any]:
    """A segment at the output's rate: sample offsets from the audio's first sample, and seconds."""
    start, end = out_length(seg.start, sample_rate), out_length(seg.end, sample_rate)
    return {"index": seg.index, "text": seg.text, "spoken_text": seg.spoken_text, "start_sample": start,
            "end_sample": end, "start": start / sample_rate, "end": end / sample_rate}


def _cue_text(text: str) -> str:
    """One line of what was written, without ChatTTS's control tokens: a blank line would end the cue."""
    return re.sub(r"\s+", " ", TAG_RE.sub(" ", text)).strip()


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def subtitles(segments: list[dict[str, Any]], fmt: str) -> str:
    """SRT (numbered cues, `00:00:01,234`) or WebVTT (the `WEBVTT` header, `00:00:01.234`, `&`, `<`, `>` as
    character references) of `segment_json` dicts; a piece with nothing to show gets no cue."""
    if fmt not in SUBTITLE_FORMATS:
        raise ValueError(f"unknown subtitle format {fmt!r}")
    sep = "," if fmt == "srt" else "."
    cues = []
    for seg in segments:
        text = _cue_text(seg["text"])
        if not text:
            continue
        if fmt == "vtt":  # WebVTT's cue text is markup: these three are character references there
            text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        cues.append(f"{_stamp(seg['start'], sep)} --> {_stamp(seg['end'], sep)}\n{text}\n")
    if fmt == "srt":
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)
