"""The realtime WebSocket (`WS /v1/audio/speech/stream`, gateway/realtime.py) as a voice agent uses it: real
`websockets` clients against `python -m gateway` in front of the server.

    python -m bench.realtime --repo build/repo-tiny --out bench/results/DATE-cpu-realtime       # starts both
    python -m bench.realtime --grpc-url HOST:8001 --metrics-url http://HOST:8002/metrics --out OUT   # a running server
    python -m bench.realtime --grpc-url HOST:8001 --gateway-url ws://HOST:8080/v1/audio/speech/stream --out OUT

Without --grpc-url the server is started as it ships, by the launcher (`python -m chattts_triton.serve`,
--serve-arg passes it flags); without --gateway-url the gateway is started here (`python -m gateway`).

1. First audio at 1 session: from sending the delta that completes the turn's first sentence to the first binary
   audio frame, over --turns turns, in alternation with the first chunk of a direct `chattts_stream` call of the
   same sentence, as the session asks for it (voice, seed, --frames forced frames, options, spoken text);
   target ≤ first chunk + 15 ms.
2. No gaps: --sessions sessions at once, each streaming a 6-sentence reply (English and Chinese, mixed lengths) as
   tokens at --tokens-per-s, then `flush`. Playback starts at the first audio byte and runs in real time; each
   piece after the first has a margin = (when the audio before it has played out) − (when its first byte came).
   A negative margin is a gap a listener hears.
3. Barge-in: `cancel` right after a long turn's audio starts: cancel → last audio byte, cancel → turn.cancelled,
   and cancel → the stream model's in-flight requests and engine slots back at zero in Triton's metrics (in
   decode steps of the stream engine's mean step).
4. Resampling and G.711 CPU cost per second of audio: bench.probes.audio_cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from chattts_triton.config import SAMPLE_RATE
from client.realtime import DEFAULT_PIECE_FRAMES

FIRST = "The quick brown fox jumps over the lazy dog."
LONG = ["The first sentence of a long answer goes on for quite a while before it ends.",
        "The second one is every bit as long as the first one, and then some more.",
        "第三句也很长，足够让服务器忙上好一阵子才能说完。"]
# A voice agent's reply: six sentences of mixed lengths, English and Chinese.
REPLY = ["Sure, I can help with that.",
         "The train to the airport leaves every twenty minutes from platform four, and the ride takes about "
         "half an hour.",
         "票价是十二块钱。",
         "You can pay with a card at the gate or buy a ticket from the machines in the hall.",
         "如果您带着很多行李，最好提前十分钟到站，因为早上的车通常很挤，找座位也不太容易。",
         "Have a good trip!"]
BYTES_PER_SAMPLE = {"pcm": 2, "ulaw": 1, "alaw": 1}  # the raw formats: a byte offset is a sample offset
STREAM_MODEL = "chattts_stream"


def log(msg: str) -> None:
    print(f"[bench.realtime] {msg}", file=sys.stderr, flush=True)


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


def llm_tokens(text: str) -> list[str]:
    """`text` as an LLM streams it: a word (with its leading space) a token, CJK two and three characters a token."""
    out: list[str] = []
    for word in re.findall(r"\s*[^\s\u3000-\u9fff\uff00-\uffef]+|\s*[\u3000-\u9fff\uff00-\uffef]+", text):
        if re.search(r"[\u3000-\u9fff]", word):
            i, n = 0, 2
            while i < len(word):
                out.append(word[i:i + n])
                i, n = i + n, 5 - n
        else:
            out.append(word)
    assert "".join(out) == text
    return out


def margins(frames: Sequence[tuple[float, int]], piece_starts: Sequence[int], rate: int,
            bytes_per_sample: int) -> list[float]:
    """For each piece after the first, the seconds by which its first audio byte came before the listener needed
    it (negative: a gap). `frames` are the turn's audio frames (arrival time, bytes) in order; `piece_starts` the
    sample offsets where the pieces after the first begin (the previous piece's segment.end end_sample: a pause
    before a piece is that piece's audio). Playback starts when the first byte arrives and runs at `rate`."""
    return [need - came for need, came in piece_times(frames, piece_starts, rate, bytes_per_sample)]


def piece_times(frames: Sequence[tuple[float, int]], piece_starts: Sequence[int], rate: int,
                bytes_per_sample: int) -> list[tuple[float, float]]:
    """For each piece after the first: (when the listener needs its first sample, when its first byte came)."""
    if not frames:
        return []
    t0 = frames[0][0]
    out, offset, i = [], 0, 0
    for start in piece_starts:
        need = start * bytes_per_sample
        while i < len(frames) and offset + frames[i][1] <= need:
            offset += frames[i][1]
            i += 1
        if i == len(frames):
            raise ValueError(f"no audio byte at sample {start}: {offset // bytes_per_sample} samples received")
        out.append((t0 + start / rate, frames[i][0]))
    return out


def cut_times(tokens: Sequence[str], sent: Sequence[float], flushed: float, max_frames: int,
              min_frames: int) -> list[float]:
    """When the session could start each piece: the arrival of the token with which its chunker (the same
    client.realtime.TextChunker, the same budgets) gave the piece out, or of the flush for what was left."""
    from client.realtime import TextChunker

    chunker, out = TextChunker(max_frames, min_frames), []
    for tok, t in zip(tokens, sent, strict=True):
        out += [t] * len(chunker.push(tok))
    return out + [flushed] * len(chunker.flush())


def frame_margins(frames: Sequence[tuple[float, int]], rate: int, bytes_per_sample: int) -> list[float]:
    """As `margins`, for every audio frame after the first: a stall inside a piece shows here too."""
    if not frames:
        return []
    t0, offset, out = frames[0][0], frames[0][1], []
    for t, n in frames[1:]:
        out.append(t0 + offset / bytes_per_sample / rate - t)
        offset += n
    return out


# --- the server's metrics -------------------------------------------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    """The stream model's series in Triton's metrics, summed over its instances."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or f'model="{STREAM_MODEL}"' not in line:
            continue
        name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def busy(m: dict[str, float]) -> float:
    return sum(m.get(k, 0.0) for k in ("chattts_inflight_requests", "chattts_engine_active", "chattts_engine_waiting",
                                       "chattts_streams"))


# --- the WebSocket ----------------------------------------------------------------------------------------------------
class Session:
    """One WebSocket session; its receiver keeps the audio frames' arrival times and the events."""

    def __init__(self, url: str):
        self.url = url

    async def open(self, settings: dict) -> Session:
        import websockets

        self.ws = await websockets.connect(self.url, max_size=None)
        created = json.loads(await self.ws.recv())
        if created.get("type") != "session.created":
            raise RuntimeError(f"expected session.created, got {created}")
        await self.ws.send(json.dumps({"type": "session.update", "session": settings}))
        updated = json.loads(await self.ws.recv())
        if updated.get("type") != "session.updated":
            raise RuntimeError(f"session.update refused: {updated}")
        self.settings = updated["session"]
        return self

    async def send(self, **msg) -> None:
        await self.ws.send(json.dumps(msg, ensure_ascii=False))

    async def turn(self, until: tuple[str, ...] = ("turn.done", "turn.cancelled"),
                   first_audio: asyncio.Event | None = None):
        """(audio frames [(arrival, bytes)], events [(arrival, event)]) up to the turn's end."""
        frames, events = [], []
        while True:
            msg = await self.ws.recv()
            now = time.perf_counter()
            if isinstance(msg, bytes):
                frames.append((now, len(msg)))
                if first_audio is not None:
                    first_audio.set()
                continue
            ev = json.loads(msg)
            events.append((now, ev))
            if ev.get("type") in until:
                return frames, events

    async def close(self) -> None:
        await self.ws.close()


def errors_in(events) -> list[dict]:
    return [ev for _, ev in events if ev.get("type") == "error"]


async def run(a: argparse.Namespace, grpc_url: str, ws_url: str, metrics_url: str | None) -> dict[str, object]:  # noqa: C901  a benchmark's script, its stages one after another
    from client import AsyncChatTTSClient
    from gateway.api import contract_options
    from gateway.realtime import parse_settings

    rate, fmt = a.sample_rate, a.response_format
    bps = BYTES_PER_SAMPLE[fmt]
    base = {"response_format": fmt, "sample_rate": rate, "min_piece_frames": 0, "idle_flush_ms": 0}
    fixed = {"max_new_tokens": a.frames, "min_new_tokens": a.frames}
    direct = AsyncChatTTSClient(grpc_url, retries=0)
    result: dict[str, object] = {"errors": []}
    errors: list[str] = result["errors"]  # type: ignore[assignment]
    try:
        # 1. first audio at 1 session, beside a direct stream's first chunk
        first_settings = {**base, "voice": "alloy", "seed": a.seed, **fixed}
        s = await Session(ws_url).open(first_settings)
        # the request the session makes of the server (its options, the spoken text asked for): only the path differs
        same = {k: v for k, v in contract_options(parse_settings(first_settings)).items() if k != "seed"}
        index = 0

        async def first_chunk(seed: int) -> float:
            t0 = time.perf_counter()
            chunks = direct.stream(FIRST, split=False, voice_from_first=False, on_spoken_text=lambda _: None,
                                   seed=seed, **same)
            await chunks.__anext__()
            t = time.perf_counter() - t0
            async for _ in chunks:
                pass
            return t

        async def ws_first_audio() -> float:
            nonlocal index
            *head, last = llm_tokens(FIRST)
            for tok in head:
                await s.send(type="text", text=tok)
            receiver = asyncio.ensure_future(s.turn())
            await asyncio.sleep(0.05)  # the head is in; the timed delta alone completes the sentence
            t0 = time.perf_counter()
            await s.send(type="text", text=last)
            await s.send(type="flush")
            frames, events = await receiver
            errors.extend(f"first audio: {e}" for e in errors_in(events))
            if not frames:
                raise RuntimeError(f"a turn without audio: {[e for _, e in events]}")
            index += 1
            return frames[0][0] - t0

        for _ in range(a.warmup):
            await first_chunk(a.seed + index)
            await ws_first_audio()
        fc, fa = [], []
        for _ in range(a.turns):
            fc.append(await first_chunk(a.seed + index))  # the seed of the piece the session sends next
            fa.append(await ws_first_audio())
        await s.close()
        diff = [x - y for x, y in zip(fa, fc, strict=True)]
        result["first_audio"] = {
            "turns": a.turns, "frames": a.frames,
            "ws_p50_ms": pct(fa, 50) * 1e3, "ws_p90_ms": pct(fa, 90) * 1e3, "ws_max_ms": max(fa) * 1e3,
            "chunk_p50_ms": pct(fc, 50) * 1e3, "chunk_p90_ms": pct(fc, 90) * 1e3, "chunk_max_ms": max(fc) * 1e3,
            "later_p50_ms": (pct(fa, 50) - pct(fc, 50)) * 1e3, "paired_later_p50_ms": statistics.median(diff) * 1e3}
        log(f"first audio: {result['first_audio']}")

        # 2. no gaps: S sessions, a 6-sentence reply each at LLM speed
        gap_settings = {**base, "max_new_tokens": a.max_new_tokens}

        async def reply(i: int):
            sess = await Session(ws_url).open({**gap_settings, "seed": a.seed + 1000 * (i + 1)})
            try:
                receiver = asyncio.ensure_future(sess.turn())
                toks = [t for k, sentence in enumerate(REPLY) for t in llm_tokens((" " if k else "") + sentence)]
                t0, sent = time.perf_counter(), []
                for k, tok in enumerate(toks):
                    await asyncio.sleep(max(0.0, t0 + k / a.tokens_per_s - time.perf_counter()))
                    sent.append(time.perf_counter())
                    await sess.send(type="text", text=tok)
                flushed = time.perf_counter()
                await sess.send(type="flush")
                frames, events = await receiver
            finally:
                await sess.close()
            ends = [ev for _, ev in events if ev.get("type") == "segment.end"]
            errs = errors_in(events)
            starts = [e["end_sample"] for e in ends[:-1]]
            times = piece_times(frames, starts, rate, bps)
            # a piece whose text was not all sent before the audio ahead of it had played out cannot be in time on any
            # server (the random weights end some pieces early): its gap is the text's, not the server's
            cuts = cut_times(toks, sent, flushed, DEFAULT_PIECE_FRAMES, gap_settings["min_piece_frames"])
            # an error's piece: all the server's
            texts = cuts[1:] if len(cuts) == len(ends) else [-math.inf] * len(times)
            # a piece cut with less time left than the server's unloaded first audio (the 1-session p50 above) cannot be
            # in time either: the floor is the first chunk's, whatever the load
            floor = result["first_audio"]["ws_p50_ms"] / 1e3
            return {"pieces": len(ends), "errors": errs, "margins": [need - came for need, came in times],
                    "server_margins": [need - came for (need, came), t in zip(times, texts, strict=True)
                                       if t <= need - floor],
                    "floor_bound": sum(need - floor < t <= need for (need, _), t in zip(times, texts, strict=True)),
                    "cut_to_audio": [came - t for (_, came), t in zip(times, texts, strict=True) if t > -math.inf],
                    "frame_margins": frame_margins(frames, rate, bps),
                    "audio_s": sum(n for _, n in frames) / bps / rate,
                    "texts": [e["text"] for e in ends],
                    "piece_s": [round((e["end_sample"] - e["start_sample"]) / rate, 3) for e in ends]}

        t0 = time.perf_counter()
        got = await asyncio.gather(*(reply(i) for i in range(a.sessions)), return_exceptions=True)
        wall = time.perf_counter() - t0
        ok = [g for g in got if isinstance(g, dict)]
        errors.extend(f"no gaps: {type(g).__name__}: {g}" for g in got if not isinstance(g, dict))
        for g in ok:
            errors.extend(f"no gaps: {e}" for e in g["errors"])
        m = [x for g in ok for x in g["margins"]]
        sm = [x for g in ok for x in g["server_margins"]]
        fm = [x for g in ok for x in g["frame_margins"]]
        ca = [x for g in ok for x in g["cut_to_audio"]]
        result["no_gaps"] = {
            "sessions": a.sessions, "tokens_per_s": a.tokens_per_s, "max_new_tokens": a.max_new_tokens,
            "sessions_ok": len(ok), "pieces": sum(g["pieces"] for g in ok), "margins": len(m), "wall_s": wall,
            "audio_s": sum(g["audio_s"] for g in ok),
            "worst_margin_ms": min(m) * 1e3 if m else float("nan"), "p1_margin_ms": pct(m, 1) * 1e3,
            "p50_margin_ms": pct(m, 50) * 1e3, "negative": sum(x < 0 for x in m),
            "text_bound": len(m) - len(sm) - sum(g["floor_bound"] for g in ok),
            "floor_bound": sum(g["floor_bound"] for g in ok),
            "cut_to_audio_p50_ms": pct(ca, 50) * 1e3 if ca else float("nan"),
            "cut_to_audio_p99_ms": pct(ca, 99) * 1e3 if ca else float("nan"),
            "cut_to_audio_max_ms": max(ca) * 1e3 if ca else float("nan"),
            "server_worst_margin_ms": min(sm) * 1e3 if sm else float("nan"),
            "server_negative": sum(x < 0 for x in sm),
            "worst_frame_margin_ms": min(fm) * 1e3 if fm else float("nan"), "negative_frames": sum(x < 0 for x in fm),
            "frames": len(fm),
            "per_session": [{"texts": g["texts"], "piece_s": g["piece_s"],
                             "margins_ms": [round(x * 1e3, 1) for x in g["margins"]]} for g in ok]}
        log(f"no gaps: {({k: v for k, v in result['no_gaps'].items() if k != 'per_session'})}")

        # 3. barge-in
        long_fixed = {"max_new_tokens": a.long_frames, "min_new_tokens": a.long_frames}
        s = await Session(ws_url).open({**base, "voice": "alloy", "seed": a.seed, **long_fixed})
        rows = []
        step_ms = None
        released0 = scrape(metrics_url) if metrics_url else {}
        for _ in range(a.barge_ins):
            got_audio = asyncio.Event()
            receiver = asyncio.ensure_future(s.turn(first_audio=got_audio))
            for tok in llm_tokens(" ".join(LONG)):
                await s.send(type="text", text=tok)
            await got_audio.wait()
            t0 = time.perf_counter()
            await s.send(type="cancel")
            frames, events = await receiver
            cancelled = next(t for t, ev in events if ev.get("type") == "turn.cancelled")
            errors.extend(f"barge-in: {e}" for e in errors_in(events))
            # no audio after the cancel: 0 (what came before it was sent before it)
            row = {"last_audio_ms": max((t - t0 for t, _ in frames if t > t0), default=0.0) * 1e3,
                   "cancelled_ms": (cancelled - t0) * 1e3,
                   "audio_after_cancel_bytes": sum(n for t, n in frames if t > t0)}
            if metrics_url:
                before = busy(scrape(metrics_url))
                deadline, inflight_freed = time.perf_counter() + 10, None
                while True:
                    now = time.perf_counter()
                    m = scrape(metrics_url)
                    left = busy(m)
                    if inflight_freed is None and not m.get("chattts_inflight_requests"):
                        inflight_freed = (now - t0) * 1e3  # the finer gauge (50 ms) alone
                    if not left or now > deadline:
                        break
                    await asyncio.sleep(0.01)
                row.update(busy_at_turn_cancelled=before, freed_ms=(now - t0) * 1e3 if not left else None,
                           inflight_freed_ms=inflight_freed)
            rows.append(row)
        await s.close()
        if metrics_url:
            # each barge-in cancelled a piece that was speaking, so its row was running: one release each. The model
            # publishes its engine's counters every STATS_PERIOD_S, one gauge at a time, so the scrape that saw the
            # slot free may precede the release count: wait for it (a bounded wait, then what was published)
            def since(m: dict[str, float], name: str) -> float:  # a counter's growth over the barge-ins
                return m.get(name, 0.0) - released0.get(name, 0.0)

            deadline = time.perf_counter() + 3
            while since(scrape(metrics_url), "chattts_engine_cancel_releases") < len(rows) \
                    and time.perf_counter() <= deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the rest of that publishing pass (the release's seconds, its maximum)
            m = scrape(metrics_url)
            steps = m.get("chattts_engine_steps", 0.0)
            step_ms = 1e3 * m.get("chattts_engine_step_seconds", 0.0) / steps if steps else None
            # the engine's own clock: cancel() (the stream stub saw the cancellation) → the row's slot released
            n_rel, rel_s = since(m, "chattts_engine_cancel_releases"), since(m, "chattts_engine_cancel_release_seconds")
            released = {"rows": n_rel, "mean_ms": 1e3 * rel_s / n_rel if n_rel else None,
                        "max_ms": 1e3 * m.get("chattts_engine_cancel_release_max_seconds", 0.0) if n_rel else None,
                        "late": since(m, "chattts_engine_cancel_release_late")}
        else:
            released = None
        freed = [r["freed_ms"] for r in rows if r.get("freed_ms") is not None]
        result["barge_in"] = {
            "runs": len(rows), "long_frames": a.long_frames, "rows": rows,
            "last_audio_p50_ms": pct([r["last_audio_ms"] for r in rows], 50),
            "last_audio_max_ms": max(r["last_audio_ms"] for r in rows),
            "cancelled_p50_ms": pct([r["cancelled_ms"] for r in rows], 50),
            "cancelled_max_ms": max(r["cancelled_ms"] for r in rows),
            "metrics_url": metrics_url, "freed_p50_ms": pct(freed, 50) if freed else None,
            "inflight_freed_p50_ms": pct([r["inflight_freed_ms"] for r in rows
                                          if r.get("inflight_freed_ms") is not None], 50)
            if metrics_url else None,
            "freed_max_ms": max(freed) if freed else None, "not_freed": len(rows) - len(freed) if metrics_url else None,
            "step_ms": step_ms, "freed_max_steps": max(freed) / step_ms if freed and step_ms else None,
            "engine_released": released}
        if metrics_url and len(freed) < len(rows):
            errors.append(f"barge-in: the stream model still busy 10 s after {len(rows) - len(freed)} cancels")
        log(f"barge-in: {({k: v for k, v in result['barge_in'].items() if k != 'rows'})}")
    finally:
        await direct.close()

    # 4. resampling and G.711 per second of audio
    from bench.probes.audio_cost import measure
    from gateway.audio import needs_pyav, pyav_available

    formats = [f for f in ("pcm", "ulaw", "alaw", "wav_ulaw") if pyav_available() or not needs_pyav(f, True)]
    result["audio_cost"] = measure(a.audio_seconds, a.audio_repeats, formats)  # a host without FFmpeg: what it serves
    return result


def _ms(x: float | None, fmt: str = ".1f") -> str:
    return "–" if x is None or x != x else f"{x:{fmt}} ms"


def released_row(bi: dict) -> str:
    r = bi.get("engine_released")
    if not r or not r["rows"]:
        return "not measured (no --metrics-url, or a server without the engine's release counters)"
    steps = f" ({r['max_ms'] / bi['step_ms']:.1f} steps of {bi['step_ms']:.2f} ms)" if bi.get("step_ms") else ""
    return f"{r['rows']:.0f}, {_ms(r['mean_ms'], '.2f')} / {_ms(r['max_ms'], '.2f')}{steps}, late **{r['late']:.0f}**"


def to_markdown(res: dict) -> str:
    from bench.probes.audio_cost import table

    fa, ng, bi = res["first_audio"], res["no_gaps"], res["barge_in"]
    served = res["served"]
    freed = (f"{_ms(bi['freed_p50_ms'])} p50, {_ms(bi['freed_max_ms'])} max"
             + (f" (≤ {bi['freed_max_steps']:.1f} decode steps of {bi['step_ms']:.2f} ms)"
                if bi["freed_max_steps"] else "")
             + f"; in-flight requests alone {_ms(bi['inflight_freed_p50_ms'])} p50"
             if bi["metrics_url"] else "not measured (no --metrics-url)")
    lines = [
        f"# Realtime WebSocket — {res['machine']}",
        "",
        f"`{res['command']}`; {served}; the gateway {res['gateway']}; {res['response_format']} at "
        f"{res['sample_rate']} Hz; server, gateway and clients on the same {os.cpu_count()} cores.",
        "",
        "| | measured | target |",
        "|---|---|---|",
        f"| first audio at 1 session, {fa['turns']} turns of {fa['frames']} forced frames: WebSocket p50 / p90 / max | "
        f"{fa['ws_p50_ms']:.1f} / {fa['ws_p90_ms']:.1f} / {fa['ws_max_ms']:.1f} ms | |",
        f"| direct `chattts_stream` first chunk, same sentence, in alternation: p50 / p90 / max | "
        f"{fa['chunk_p50_ms']:.1f} / {fa['chunk_p90_ms']:.1f} / {fa['chunk_max_ms']:.1f} ms | |",
        f"| first audio − first chunk, p50 (pairs' median) | **{fa['later_p50_ms']:+.1f} ms** "
        f"({fa['paired_later_p50_ms']:+.1f}) | ≤ +15 ms |",
        f"| no gaps: {ng['sessions']} sessions × 6 sentences at {ng['tokens_per_s']:g} tokens/s "
        f"({ng['sessions_ok']} completed, {ng['margins']} piece margins): worst / p1 / p50 margin | "
        f"**{ng['worst_margin_ms']:.0f}** / {ng['p1_margin_ms']:.0f} / {ng['p50_margin_ms']:.0f} ms | worst ≥ 0 |",
        f"| pieces whose first audio came after the audio before them had played out | **{ng['negative']}** of "
        f"{ng['margins']} | 0 |",
        f"| of them, pieces cut only after that (their text came late: the random weights ended the piece before "
        f"early; no server is in time) | {ng['text_bound']} | |",
        f"| pieces cut in time but with less time left than the unloaded first audio at 1 session (late or not: no "
        f"server of this first chunk is sure to be in time) | {ng.get('floor_bound', 0)} | |",
        f"| a piece's cut (its text complete) → its first audio byte, every piece after the first: p50 / p99 / max | "
        f"{ng.get('cut_to_audio_p50_ms', float('nan')):.0f} / {ng.get('cut_to_audio_p99_ms', float('nan')):.0f} / "
        f"{ng.get('cut_to_audio_max_ms', float('nan')):.0f} ms | |",
        f"| pieces cut in time for the server: worst margin, late | **{ng['server_worst_margin_ms']:.0f} ms**, "
        f"**{ng['server_negative']}** | worst ≥ 0, 0 |",
        "| every audio frame (stalls inside a piece too): worst margin, late frames | "
        f"{ng['worst_frame_margin_ms']:.0f} ms, {ng['negative_frames']} of {ng['frames']} | |",
        f"| barge-in ({bi['runs']} cancels in turns of {bi['long_frames']}-frame pieces): cancel → last audio byte, "
        f"p50 / max | **{bi['last_audio_p50_ms']:.1f}** / {bi['last_audio_max_ms']:.1f} ms | ≤ 50 ms |",
        f"| cancel → turn.cancelled, p50 / max | {bi['cancelled_p50_ms']:.1f} / {bi['cancelled_max_ms']:.1f} ms | |",
        "| cancel → the stream model's in-flight requests, streams and engine slots at 0 in Triton's metrics | "
        f"{freed} | |",
        f"| the engine's own clock, the stub's cancel → the row's slot released: rows, mean / max, released after more "
        f"than one decode step had begun | {released_row(bi)} | late 0 |",
        "",
        f"No gaps: {ng['audio_s']:.0f} s of audio in {ng['wall_s']:.1f} s, natural lengths up to "
        f"{ng['max_new_tokens']} "
        "frames per piece. A piece's margin: when the audio before it has played out (playback from the first byte, "
        "in real time at the output rate) minus when its first byte came; a pause before a piece is that piece's "
        "audio. Freed slots are read from gauges Triton publishes every 50 ms (in-flight) and 0.25 s (engine, "
        "streams): the figure is an upper bound with that resolution.",
        "",
        f"Errors: {len(res['errors'])}" + ("" if not res["errors"] else " — " + "; ".join(res["errors"][:5])),
        "",
        f"Resampling (libsoxr) and G.711, CPU per second of audio (bench.probes.audio_cost, "
        f"{res['audio_cost']['audio_seconds']:g} s of speech-like audio, "
        f"least of {res['audio_cost']['repeats']} runs):",
        "",
        table(res["audio_cost"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:  # noqa: C901  a command's main: its flags checked and its stages run in order
    ap = argparse.ArgumentParser(prog="python -m bench.realtime", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, help="the exported repository, served here through the launcher (without "
                                              "--grpc-url)")
    ap.add_argument("--grpc-url", help="a running server's gRPC HOST:PORT")
    ap.add_argument("--metrics-url", help="its metrics, http://HOST:PORT/metrics (default: the launched server's)")
    ap.add_argument("--gateway-url",
                    help="a running gateway's ws://HOST:PORT/v1/audio/speech/stream (needs --grpc-url)")
    ap.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md are written")
    ap.add_argument("--frames", type=int, default=96, help="forced frames per piece for first audio (default "
                                                           "%(default)s)")
    ap.add_argument("--long-frames", type=int, default=600, help="forced frames per piece for barge-in")
    ap.add_argument("--max-new-tokens", type=int, default=384, help="the no-gaps pieces' bound (natural lengths)")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--tokens-per-s", type=float, default=30.0)
    ap.add_argument("--turns", type=int, default=20, help="first-audio turns")
    ap.add_argument("--warmup", type=int, default=2, help="first-audio turns not counted")
    ap.add_argument("--barge-ins", type=int, default=5)
    ap.add_argument("--response-format", default="pcm", choices=sorted(BYTES_PER_SAMPLE))
    ap.add_argument("--sample-rate", type=int, default=SAMPLE_RATE)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--audio-seconds", type=float, default=10.0, help="bench.probes.audio_cost's audio")
    ap.add_argument("--audio-repeats", type=int, default=3)
    ap.add_argument("--gateway-arg", action="append", default=[], help="a flag for python -m gateway (repeatable)")
    ap.add_argument("--serve-arg", action="append", default=[], help="a flag for python -m chattts_triton.serve")
    ap.add_argument("--machine", default=f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores")
    a = ap.parse_args(argv)
    from gateway.audio import SAMPLE_RATES

    for flag, value, low in (("--frames", a.frames, 1), ("--long-frames", a.long_frames, 1),
                             ("--max-new-tokens", a.max_new_tokens, 1), ("--sessions", a.sessions, 1),
                             ("--turns", a.turns, 1), ("--warmup", a.warmup, 0), ("--barge-ins", a.barge_ins, 1),
                             ("--audio-repeats", a.audio_repeats, 1)):
        if value < low:
            ap.error(f"{flag} must be ≥ {low}, got {value}")
    if not a.tokens_per_s > 0 or not a.audio_seconds > 0:
        ap.error(f"--tokens-per-s and --audio-seconds must be positive, got {a.tokens_per_s}, {a.audio_seconds}")
    if a.sample_rate not in SAMPLE_RATES:
        ap.error(f"--sample-rate {a.sample_rate}: one of {', '.join(map(str, SAMPLE_RATES))}")
    if a.response_format in ("ulaw", "alaw") and a.sample_rate != 8000:
        log(f"{a.response_format} at {a.sample_rate} Hz (telephones use 8000)")
    if a.grpc_url is None and a.repo is None:
        ap.error("--repo (a repository to serve here) or --grpc-url (a running server) is required")
    if a.gateway_url and not a.grpc_url:
        ap.error("--gateway-url needs --grpc-url (the direct calls that first audio is compared with)")
    if a.grpc_url and a.serve_arg:
        ap.error("--serve-arg is for the server started here: not with --grpc-url")
    if a.gateway_url and a.gateway_arg:
        ap.error("--gateway-arg is for the gateway started here: not with --gateway-url")
    if a.gateway_url and not a.gateway_url.startswith(("ws://", "wss://")):
        ap.error(f"--gateway-url {a.gateway_url!r}: a ws:// or wss:// URL")

    from bench.gateway import Gateway
    from chattts_triton.launcher.serve import Launched
    from gateway.realtime import PATH

    a.out.parent.mkdir(parents=True, exist_ok=True)
    server = launcher = gateway = None
    if a.grpc_url is None:
        server = Launched(a.repo, a.out.with_suffix(".tritonserver.log"), args=a.serve_arg, ready_timeout_s=900)
        server.start()
        launcher = {"command": " ".join(["python -m chattts_triton.serve --repo", str(a.repo), *a.serve_arg]),
                    "ready_s": round(server.ready_s[0], 1)}
        log(f"launcher ready in {launcher['ready_s']:.0f} s: {server.grpc_url}")
    try:
        grpc_url = a.grpc_url or server.grpc_url
        metrics_url = a.metrics_url or (server.metrics_url if server is not None else None)
        if a.gateway_url:
            ws_url = a.gateway_url
        else:
            gateway = Gateway(grpc_url, a.repo, a.out.with_suffix(".gateway.log"), a.gateway_arg)
            ws_url = "ws" + gateway.url[4:] + PATH
        try:
            res = asyncio.run(run(a, grpc_url, ws_url, metrics_url))
        finally:
            if gateway is not None:
                gateway.close()
        if server is not None:
            launcher.update(restarts=server.restarts, exits=[code for _, code in server.exits])
    finally:
        if server is not None:
            launcher_exit = server.stop()
    if launcher is not None:
        launcher["exit_status"] = launcher_exit
    served = (f"served by `{launcher['command']}` (ready in {launcher['ready_s']:.0f} s, {launcher['restarts']} "
              "restarts)" if launcher else f"served at {grpc_url}")
    gw = (f"at {a.gateway_url}" if a.gateway_url
          else "`python -m gateway" + "".join(f" {g}" for g in a.gateway_arg) + "` started here")
    res.update(machine=a.machine, command=" ".join(["python -m bench.realtime",
                                                    *(argv if argv is not None else sys.argv[1:])]),
               repo=str(a.repo) if a.repo else None, launcher=launcher, grpc_url=grpc_url, served=served, gateway=gw,
               response_format=a.response_format, sample_rate=a.sample_rate, loadavg=os.getloadavg())
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    a.out.with_suffix(".md").write_text(to_markdown(res))
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
