"""The engine's admission policy (chattts_triton/runtime/scheduler.py) on its own, with stand-in requests: queue
order, batched admission while busy, the slot, token and page budgets, whom to suspend, how suspended requests
come back, cancelled requests, the max-pending bound. (tests/test_engine.py runs it inside the engine.)"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chattts_triton.runtime.scheduler import Scheduler, Suspended

PAGE = 16


@dataclass(eq=False)
class Req:
    name: str
    prompt_len: int = 8
    cancelled: bool = False


def sched(**kw) -> Scheduler:
    kw.setdefault("max_slots", 8)
    kw.setdefault("max_prefill_tokens", 4096)
    return Scheduler(page_tokens=PAGE, **kw)


def names(reqs):
    return [r.name for r in reqs]


def test_an_idle_engine_admits_the_queue_at_once_in_arrival_order_up_to_its_free_slots():
    s = sched(max_slots=3, admit_batch=32, admit_wait_steps=100)
    for i in range(5):
        s.add(Req(f"r{i}"), step=0)
    got = s.admit(running=0, free_pages=100, step=0)
    assert names(got.prefill) == ["r0", "r1", "r2"] and not got.resume and not got.cancelled
    assert names(s.requests()) == ["r3", "r4"] and s.pending == 2
    assert not s.admit(running=3, free_pages=100, step=50).prefill  # no slot free


def test_a_busy_engine_batches_admissions_until_enough_wait_or_the_oldest_waited_long_enough():
    s = sched(max_slots=8, admit_batch=3, admit_wait_steps=4)
    s.add(Req("a"), step=10)
    s.add(Req("b"), step=11)
    for step in (10, 11, 12, 13):
        assert not s.admit(running=1, free_pages=100, step=step).prefill  # 2 < admit_batch, a waited < 4 steps
    assert names(s.admit(running=1, free_pages=100, step=14).prefill) == ["a", "b"]  # a waited 4 steps
    for n in "cde":
        s.add(Req(n), step=20)
    assert names(s.admit(running=3, free_pages=100, step=20).prefill) == ["c", "d", "e"]  # admit_batch wait
    s.add(Req("f"), step=30)
    s.add(Req("g"), step=30)
    # 2 free slots: as many waiting as slots free is enough
    assert names(s.admit(running=6, free_pages=100, step=30).prefill) == ["f", "g"]


def test_the_prefill_token_budget_stops_admission_but_a_longer_prompt_still_goes_alone():
    s = sched(max_prefill_tokens=100)
    for n, t in (("a", 60), ("b", 30), ("c", 20), ("d", 5)):
        s.add(Req(n, prompt_len=t), step=0)
    assert names(s.admit(running=0, free_pages=100, step=0).prefill) == ["a", "b"]  # 90; c would make 110
    s = sched(max_prefill_tokens=100)
    s.add(Req("long", prompt_len=300), step=0)
    s.add(Req("short", prompt_len=4), step=0)
    assert names(s.admit(running=0, free_pages=100, step=0).prefill) == ["long"]


def test_pages_for_counts_whole_pages_of_positions_for_ints_and_arrays():
    s = sched()
    assert [s.pages_for(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]
    assert s.pages_for(np.array([1, 16, 17, 48])).tolist() == [1, 1, 2, 3]


def test_admission_takes_each_prompts_pages_and_keeps_one_in_reserve_per_running_request():
    s = sched()
    for i in range(4):  # 3 pages each
        s.add(Req(f"r{i}", prompt_len=40), step=0)
    # 8 free: r0 takes 3 (5 left); r1 takes 3 + 1 reserve for r0 (4 ≤ 5); r2 would need 3 + 2 > 2
    assert names(s.admit(running=0, free_pages=8, step=0).prefill) == ["r0", "r1"]
    # with 2 running, r2 needs its 3 pages and 2 in reserve: 4 free are too few, 5 enough
    assert not s.admit(running=2, free_pages=4, step=100).prefill
    assert names(s.admit(running=2, free_pages=5, step=100).prefill) == ["r2"]
    assert names(s.requests()) == ["r3"]  # FIFO: the queue waits behind its head, nothing jumps it


def test_victims_are_the_newest_rows_until_the_freed_pages_cover_the_rest_never_all():
    s = sched()
    seqs = [5, 9, 2, 7]  # admission order of rows 0..3: newest is row 1, then row 3
    held = [3, 2, 4, 1]
    assert s.victims(seqs, held, short=[True, True, True, True], free_pages=4) == []  # enough free
    # 4 rows short, 1 free: row 1 (newest) frees 2 and needs none → 3 free for 3 short: done
    assert s.victims(seqs, held, short=[True, True, True, True], free_pages=1) == [1]
    # nothing free, only row 0 short: row 1 frees 2 ≥ 1
    assert s.victims(seqs, held, short=[True, False, False, False], free_pages=0) == [1]
    # newest rows hold little: keep going by age, row 3 then row 0 ...
    assert s.victims(seqs, [9, 0, 9, 0], short=[True, False, True, False], free_pages=0) == [1, 3, 0]
    # ... and never suspend every row (the last one alone always fits the pool)
    assert s.victims([1, 2], [0, 0], short=[True, True], free_pages=0) == [1]


def suspended_queue():
    """Two new requests (a prefill budget of one), then two running ones suspended, the younger listed first."""
    s = sched(max_prefill_tokens=10)
    s.add(Req("new1"), step=0)
    s.add(Req("new2"), step=0)
    old, young = Req("old"), Req("young")
    s.requeue([Suspended(young, seq=7, pages=5, steps=30), Suspended(old, seq=3, pages=2, steps=44)], step=9)
    return s, old, young


def test_suspended_requests_go_back_to_the_head_oldest_first_and_resume_with_their_pages():
    s, old, young = suspended_queue()
    assert names(s.requests()) == ["old", "young", "new1", "new2"] and set(s.suspended) == {id(old), id(young)}
    # 11 free: old takes its 2, young its 5 + 1 in reserve, new1 its 1 + 2: the resumed took no prefill
    # budget (new1's 8 tokens fit the 10); new2's would not
    got = s.admit(running=0, free_pages=11, step=9)
    assert ([r.req for r in got.resume] == [old, young]
            and [(r.pages, r.steps) for r in got.resume] == [(2, 44), (5, 30)])
    assert names(got.prefill) == ["new1"] and names(s.requests()) == ["new2"] and not s.suspended
    # 7 free: young's 5 + 1 reserve do not fit after old's 2, and nothing behind it jumps the queue
    s, old, young = suspended_queue()
    got = s.admit(running=0, free_pages=7, step=9)
    assert [r.req for r in got.resume] == [old] and not got.prefill and set(s.suspended) == {id(young)}


def test_cancelled_requests_are_dropped_from_the_head_with_the_tokens_they_had():
    s = sched(admit_batch=32, admit_wait_steps=100)
    gone, stopped, live = Req("gone", cancelled=True), Req("stopped"), Req("live")
    s.add(gone, step=0)
    s.requeue([Suspended(stopped, seq=1, pages=2, steps=17)], step=0)
    s.add(live, step=0)
    stopped.cancelled = True
    # busy and not due for admission: the cancelled head is dropped all the same
    got = s.admit(running=1, free_pages=100, step=1)
    assert [(r.name, n) for r, n in got.cancelled] == [("stopped", 17), ("gone", 0)]
    assert not got.prefill and names(s.requests()) == ["live"] and not s.suspended
    # one cancelled behind the head goes when admission reaches it
    s.add(Req("late", cancelled=True), step=1)
    s.add(Req("after"), step=1)
    got = s.admit(running=0, free_pages=100, step=2)
    assert names(got.prefill) == ["live", "after"] and [r.name for r, _ in got.cancelled] == ["late"]


def test_the_max_pending_bound_counts_running_and_waiting_requests():
    s = sched(max_pending=3)
    assert not s.full(running=2)
    s.add(Req("a"), step=0)
    assert s.full(running=2) and not s.full(running=1)
    s.admit(running=0, free_pages=100, step=0)  # admitted: a runs now
    assert not s.full(running=2) and s.full(running=3)
    unbounded = sched(max_pending=0)
    for i in range(100):
        unbounded.add(Req(f"r{i}"), step=0)
    assert not unbounded.full(running=1000)
