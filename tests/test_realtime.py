"""client.realtime: the text chunker (pieces cut as text arrives, nothing dropped or repeated) and the speech session
(ordered events, timings, seed schedule, barge-in) over a stand-in client; the real server in test_realtime_e2e."""

from __future__ import annotations

import asyncio
import re
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chattts_triton.model.split import split_for_synthesis
from client.errors import ChatTTSError, ChatTTSInputError
from client.realtime import (
    Audio,
    SegmentEnd,
    SegmentError,
    SegmentStart,
    SpeechSession,
    TextChunker,
    TurnCancelled,
    TurnEnd,
)

ENGLISH = ("Sure! The weather in Paris today is sunny, with a high of 21 degrees and a light breeze from the west. "
           "Tomorrow it will rain, so bring an umbrella. Dr. Smith said the meeting moves to 10:30 on 2026-12-04... "
           "Is that okay? It costs $12.50, or about 3.5% more than last year! Call me at 555-0100.\nThanks 🙂")
CHINESE = ("四川美食确实以辣闻名，但也有不辣的选择。比如甜水面、赖汤圆、蛋烘糕、叶儿粑等，"
           "这些小吃口味温和，甜而不腻，也很受欢迎。"
           "我有3个苹果，价格是12.5元！今天是2026年12月3日。你觉得怎么样？好。[uv_break]我们明天见……")
MIXED = ("我们用 ChatTTS 做语音合成，it works well for English too. 第一句话很好。第二句有问题吗？No problem at all! "
         "The API returns 24 kHz audio，也支持 8 kHz μ-law 电话音频。[laugh]真的吗？Yes.")
LONG_SENTENCE = ", ".join(["the quick brown fox jumps over the lazy dog"] * 12) + "."


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def feed(chunker: TextChunker, deltas):
    pieces = []
    for d in deltas:
        pieces += chunker.push(d)
    return pieces + chunker.flush()


def random_split(text: str, cuts) -> list:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0] + points + [len(text)]
    return [text[a:b] for a, b in pairwise(bounds) if b > a]


@settings(max_examples=150, deadline=None)
@given(text=st.sampled_from([ENGLISH, CHINESE, MIXED, LONG_SENTENCE, ENGLISH + CHINESE + MIXED]),
       cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=120))
def test_pieces_cut_from_any_token_split_join_to_the_input(text, cuts):
    pieces = feed(TextChunker(), random_split(text, cuts))
    assert squash("".join(pieces)) == squash(text)
    assert all(p.strip() and p == p.strip() for p in pieces)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab 1.。！?,，\n…🙂[]_好")), max_size=200),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=60))
def test_pieces_of_arbitrary_text_join_to_the_input(text, cuts):
    assert squash("".join(feed(TextChunker(), random_split(text, cuts)))) == squash(text)


def test_a_sentence_goes_out_with_the_token_that_ends_it():
    c = TextChunker()
    assert c.push("The weather in Paris today is sunny") == []
    assert c.push(" and warm") == []
    assert c.push(".") == ["The weather in Paris today is sunny and warm."]
    assert c.push(" 第一句话很好") == []
    assert c.push("。") == ["第一句话很好。"]
    assert c.pending == ""


def test_a_number_at_the_end_of_the_text_so_far_is_not_cut():
    c = TextChunker(min_frames=0)
    assert c.push("It costs 3.") == []  # "3." may be "3.5"
    assert c.push("5 dollars today.") == ["It costs 3.5 dollars today."]


def test_a_short_sentence_waits_to_join_the_next():
    c = TextChunker()
    assert c.push("Sure! ") == []
    assert c.push("The weather in Paris today is sunny and warm.") == ["Sure! The weather in Paris today is sunny and "
                                                                       "warm."]
    assert TextChunker(min_frames=0).push("Sure! ") == ["Sure!"]


def test_a_sentence_past_the_budget_is_spoken_a_clause_at_a_time_while_it_arrives():
    c = TextChunker(max_frames=200)
    out = []
    for word in LONG_SENTENCE.split(" "):
        out += c.push(word + " ")
    # each clause goes once the next one has pushed the sentence past the budget; the last with the full stop
    assert len(out) == 12 and all(p.endswith(",") for p in out[:-1]) and out[-1].endswith(".")
    assert c.flush() == [] and squash("".join(out)) == squash(LONG_SENTENCE)


def test_whole_text_at_once_is_cut_as_the_splitter_cuts_it():
    # complete text in one delta: the same pieces as the splitter gives the REST gateway (a trailing unfinished
    # sentence, by contrast, is a piece of its own once the complete ones have gone)
    for text in (ENGLISH.rsplit("\n", 1)[0], CHINESE, MIXED):
        c = TextChunker(max_frames=1024)
        assert c.push(text) + c.flush() == split_for_synthesis(text, 1024)


def test_text_with_nothing_to_say_rides_with_a_neighbour():
    c = TextChunker(min_frames=0)
    assert c.push("…… ") == []
    assert c.push("好的。") == ["…… 好的。"]
    assert c.push(" 🙂") == []
    assert c.flush() == ["🙂"]  # alone at the end of a turn: the session reports it silent
    assert TextChunker(min_frames=0).push("Fine. 🙂 Next one.") == ["Fine.", "🙂 Next one."]


def test_clear_drops_the_pending_text():
    c = TextChunker()
    c.push("half a sent")
    assert c.clear() == "half a sent" and c.flush() == []


def test_bad_chunker_input_is_refused():
    with pytest.raises(TypeError, match="text must be a str"):
        TextChunker().push(5)
    with pytest.raises(ValueError, match="max_frames"):
        TextChunker(max_frames=0)
    with pytest.raises(ValueError, match="min_frames"):
        TextChunker(min_frames=-1)


# --- the session over a stand-in client ------------------------------------------------------------------------------
def piece_level(n: int, i: int) -> float:
    """The stand-in's sample value for chunk i of its n-th call: a piece's audio tells which call it came from."""
    return 0.1 * n + 0.0001 * i


def call_of(samples: np.ndarray) -> np.ndarray:
    return np.floor(samples * 10 + 1e-3)


class FakeClient:
    """`stream` as AsyncChatTTSClient's: chunks of a piece after delays that make later pieces finish first."""

    def __init__(self, chunk=480, chunks=3, delay=0.01, fail_on=None, busy=0):
        self.chunk, self.chunks, self.delay, self.fail_on = chunk, chunks, delay, fail_on
        self.busy = busy  # the first `busy` calls are refused as an overloaded server refuses them
        self.calls, self.cancelled, self.running = [], [], 0

    def stream(self, text, *, split, voice_from_first, on_spoken_text, chunk_timeout_s, **options):
        assert split is False and voice_from_first is False
        self.calls.append((text, options))
        n = len(self.calls)

        async def gen():
            self.running += 1
            try:
                if n <= self.busy:
                    raise ChatTTSError("UNAVAILABLE", "server busy: 4 streams in flight, retry later")
                if self.fail_on and self.fail_on in text:
                    raise ChatTTSInputError(f"TEXT has an unknown control token in {text!r}")  # as the server words it
                on_spoken_text(text.upper())
                for i in range(self.chunks):
                    # the first piece is the slowest: later pieces are ready before it
                    await asyncio.sleep(self.delay * (4 if n == 1 else 1))
                    yield np.full(self.chunk, piece_level(n, i), np.float32)
            except asyncio.CancelledError:
                self.cancelled.append(text)
                raise
            finally:
                self.running -= 1

        return gen()


async def collect(session, until=(TurnEnd, TurnCancelled)):
    out = []
    async for ev in session.events():
        out.append(ev)
        if isinstance(ev, until):
            return out
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_turn_is_handed_out_in_order_with_exact_timings_and_the_seed_schedule():
    async def main():
        fake = FakeClient()
        s = SpeechSession(fake, {"voice": "alloy"}, seed=100, pause_s=0.01, min_frames=0)
        for token in ("The first sentence is here. ", "A second one follows. ", "第三句。", " And the end"):
            await s.append(token)
        await s.flush()
        events = await collect(s)
        await s.close()
        return fake, events

    fake, events = run(main())
    assert [o["seed"] for _, o in fake.calls] == [100, 101, 102, 103]
    assert all(o["voice"] == "alloy" for _, o in fake.calls)
    ends = [e for e in events if isinstance(e, SegmentEnd)]
    assert [e.text for e in ends] == ["The first sentence is here.", "A second one follows.", "第三句。", "And the end"]
    assert [e.index for e in ends] == [0, 1, 2, 3]
    audio = np.concatenate([e.samples for e in events if isinstance(e, Audio)])
    pause = 240
    assert ends[0].start == 0 and ends[0].end == 3 * 480
    for a, b in pairwise(ends):
        assert b.start == a.end + pause and b.end == b.start + 3 * 480
    for e in ends:  # the samples between start and end are this piece's (piece_level)
        assert np.all(call_of(audio[e.start:e.end]) == e.index + 1)
        assert e.spoken_text == e.text.upper()
    assert isinstance(events[-1], TurnEnd) and events[-1].samples == audio.size == ends[-1].end
    starts = [e for e in events if isinstance(e, SegmentStart)]
    assert [e.start for e in starts] == [e.start for e in ends]


def test_without_a_voice_every_piece_gets_the_seeds_speaker():
    async def main():
        fake = FakeClient()
        s = SpeechSession(fake, {}, seed=7, min_frames=0)
        await s.append("One sentence here. Another sentence there.")
        await s.flush()
        await collect(s)
        await s.close()
        return fake

    assert {o["voice"] for _, o in run(main()).calls} == {"7"}


def test_a_piece_that_fails_is_reported_in_its_place_and_the_turn_goes_on():
    async def main():
        s = SpeechSession(FakeClient(fail_on="[bad_token]"), {"voice": "alloy"}, seed=1, min_frames=0, pause_s=0)
        await s.append("第一句话很好。第二句有问题[bad_token]。第三句也很好。")
        await s.flush()
        events = await collect(s)
        await s.close()
        return events

    events = run(main())
    kinds = [(type(e).__name__, e.index) for e in events if not isinstance(e, (Audio, TurnEnd))]
    assert kinds == [("SegmentStart", 0), ("SegmentEnd", 0), ("SegmentError", 1), ("SegmentStart", 2),
                     ("SegmentEnd", 2)]
    err = next(e for e in events if isinstance(e, SegmentError))
    assert "[bad_token]" in err.text and "unknown control token" in err.error.message


def test_cancel_stops_the_turn_cancels_every_piece_and_the_session_goes_on():
    async def main():
        fake = FakeClient(chunks=50, delay=0.02)
        s = SpeechSession(fake, {"voice": "alloy"}, seed=1, min_frames=0, idle_flush_s=None)
        await s.append("One long first sentence. A second sentence. A third sentence. And half a fou")
        got = []
        async for ev in s.events():
            got.append(ev)
            if isinstance(ev, Audio):
                break
        running_before = fake.running
        turn = await s.cancel()
        assert fake.running == 0 and len(fake.cancelled) == running_before == 2  # the third waited for its turn
        after_cancel = await collect(s)
        await s.append("Next turn.")
        await s.flush()
        nxt = await collect(s)
        await s.close()
        return turn, got, after_cancel, nxt, fake

    turn, got, after_cancel, nxt, fake = run(main())
    assert turn == 0
    assert len(after_cancel) == 1 and isinstance(after_cancel[0], TurnCancelled)
    assert after_cancel[0].samples == sum(e.samples.size for e in got if isinstance(e, Audio))
    assert [e.text for e in nxt if isinstance(e, SegmentEnd)] == ["Next turn."]
    assert all(e.turn == 1 for e in nxt)
    assert fake.calls[-1][1]["seed"] == 4  # the schedule goes on: pieces 0-2 were sent, "half a fou" was dropped


def test_an_overloaded_server_is_asked_again_and_no_piece_is_dropped():
    async def main():
        fake = FakeClient(busy=3)
        s = SpeechSession(fake, {"voice": "alloy"}, seed=1, min_frames=0, piece_concurrency=1)
        await s.append("One sentence here. Another sentence there.")
        await s.flush()
        events = await collect(s)
        await s.close()
        return fake, events

    fake, events = run(main())
    assert [e.text for e in events if isinstance(e, SegmentEnd)] == ["One sentence here.", "Another sentence there."]
    assert not any(isinstance(e, SegmentError) for e in events) and len(fake.calls) == 5
    assert [o["seed"] for _, o in fake.calls] == [1, 1, 1, 1, 2]  # a retry is the same piece: the same seed


def test_an_overload_that_outlasts_the_retry_window_is_the_pieces_error():
    async def main():
        s = SpeechSession(FakeClient(busy=100), {"voice": "alloy"}, seed=1, retry_s=0.2)
        await s.append("One sentence here, long enough to stand alone.")
        await s.flush()
        events = await collect(s)
        await s.close()
        return events

    err = next(e for e in run(main()) if isinstance(e, SegmentError))
    assert err.error.status == "UNAVAILABLE"


def test_text_left_idle_is_spoken_without_a_flush():
    async def main():
        s = SpeechSession(FakeClient(), {"voice": "alloy"}, seed=1, idle_flush_s=0.05)
        await s.append("no full stop yet")
        events = []
        async for ev in s.events():
            events.append(ev)
            if isinstance(ev, SegmentEnd):
                break
        await s.close()
        return events

    assert run(main())[-1].text == "no full stop yet"


def test_a_turn_with_nothing_to_say_ends_silent():
    async def main():
        fake = FakeClient()
        s = SpeechSession(fake, {"voice": "alloy"}, seed=1)
        await s.append("🙂")
        await s.flush()
        events = await collect(s)
        await s.close()
        return fake, events

    fake, events = run(main())
    assert fake.calls == []
    assert [type(e).__name__ for e in events] == ["SegmentStart", "SegmentEnd", "TurnEnd"]
    assert events[1].start == events[1].end == 0 and events[-1].samples == 0


def test_bad_session_settings_are_refused():
    with pytest.raises(TypeError, match="unknown option"):
        SpeechSession(FakeClient(), {"volume": 3})
    with pytest.raises(ChatTTSInputError, match="session's seed"):
        SpeechSession(FakeClient(), {"seed": 3})
    with pytest.raises(ChatTTSInputError, match="seed must be"):
        SpeechSession(FakeClient(), {}, seed=-1)


def test_a_closed_session_refuses_text():
    async def main():
        s = SpeechSession(FakeClient(), {})
        await s.close()
        with pytest.raises(ChatTTSError, match="closed"):
            await s.append("x")
        assert [e async for e in s.events()] == []

    run(main())
