"""Who joins the GPT engine's batch, and who leaves it for want of KV pages: the engine's admission policy.

`Scheduler` holds the waiting queue (new requests at the tail; suspended ones back at the head) and decides:
- `admit`: which waiting requests join this iteration — from the head, in order, while slots, the prefill's
  token budget and pages last, keeping one page in reserve for each request that will be running. While
  requests are running it waits until `admit_batch` wait (or as many as there are free slots) or the oldest
  has waited `admit_wait_steps` decode steps: each prefill is hundreds of kernels between two decode steps,
  so prefills are batched; an idle engine admits at once. Cancelled requests at the head are dropped.
- `pages_for`: how many pages a request holds (the positions it has written, `KV_PAGE_TOKENS` per page).
- `victims`: whom to suspend when the running requests need more pages than are free: the newest first,
  never all of them (the pool holds one request of the full context).
- `full`: whether running + waiting requests reached the service's bound (callers answer "server busy").

It touches no tensor: the engine (engine.py) does what a decision implies (prefill, copying a suspended
request's pages to the host and back, granting pages) and tells it what happened (`requeue`). Requests need
`prompt_len` and `cancelled` only, so tests/test_scheduler.py drives it with stand-ins. Not thread-safe on
its own: the engine calls `add`, `admit` and `full` under its lock; `requeue` (engine thread) and `add` touch
opposite ends of one deque.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config import ADMIT_BATCH, ADMIT_WAIT_STEPS, KV_PAGE_TOKENS


@dataclass
class Suspended:
    """A request taken out of the batch for want of pages, waiting at the head of the queue to resume."""

    req: Any
    seq: int  # its admission order (the newest are suspended first)
    pages: int  # pages it held: it gets as many back when it resumes
    steps: int  # tokens it had generated (what a cancelled one reports)
    state: Any = None  # the engine's copy of its slot, opaque here


@dataclass(frozen=True)
class Admission:
    """What `Scheduler.admit` decided for one iteration, each in queue order."""

    resume: tuple[Suspended, ...] = ()  # back where they stopped (they were at the head)
    prefill: tuple[Any, ...] = ()  # new requests: one batched prefill
    cancelled: tuple[tuple[Any, int], ...] = ()  # (request, tokens it had): end them "cancelled"


NOTHING = Admission()  # an empty queue's answer, every step of a busy engine: made once


class Scheduler:
    def __init__(self, max_slots: int, max_prefill_tokens: int, page_tokens: int = KV_PAGE_TOKENS,
                 admit_batch: int = ADMIT_BATCH, admit_wait_steps: int = ADMIT_WAIT_STEPS, max_pending: int = 0):
        """max_prefill_tokens: prompt positions one prefill takes (a longer prompt goes alone);
        max_pending: running + waiting requests at which `full` says yes (0: no bound)."""
        self.max_slots = max_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.page_tokens = page_tokens
        self.admit_batch = max(1, admit_batch)
        self.admit_wait_steps = max(0, admit_wait_steps)
        self.max_pending = max_pending
        self.waiting: deque[tuple[Any, int]] = deque()  # (request, the step it arrived or was suspended at)
        self.suspended: dict[int, Suspended] = {}  # id(request) → its record, while it waits to resume

    # -- the queue --------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self.waiting)

    def requests(self) -> list[Any]:
        """The waiting requests, head first."""
        return [req for req, _ in self.waiting]

    def add(self, req: Any, step: int) -> None:
        """A new request at the tail; `step`: the engine's decode step count now."""
        self.waiting.append((req, step))

    def full(self, running: int) -> bool:
        """Whether a new request should be refused: `running` + waiting reached max_pending."""
        return bool(self.max_pending) and running + len(self.waiting) >= self.max_pending

    # -- pages ------------------------------------------------------------------------------------------
    def pages_for(self, positions):
        """Pages that hold `positions` positions (an int, or a numpy array of them)."""
        return -(-positions // self.page_tokens)

    def victims(self, seqs: Sequence[int], held: Sequence[int], short: Sequence[bool], free_pages: int) -> list[int]:
        """Which running rows to suspend so that every row short of a page (`short`) gets one: the newest
        (largest admission order `seqs`) first, until the pages free and those the victims hold and no longer
        need cover the rest; never the last row. `held`: pages each row holds. [] if the free pages suffice."""
        b, need = len(seqs), int(sum(short))
        out: list[int] = []
        freed = free_pages
        for i in sorted(range(b), key=lambda i: seqs[i], reverse=True):
            if freed >= need or len(out) == b - 1:
                break
            out.append(i)
            freed += int(held[i])
            need -= int(short[i])
        return out

    def requeue(self, suspended: Sequence[Suspended], step: int) -> None:
        """Requests just suspended, back to the head of the queue, oldest first (ahead of every new one)."""
        for s in sorted(suspended, key=lambda s: s.seq, reverse=True):
            self.waiting.appendleft((s.req, step))
            self.suspended[id(s.req)] = s

    # -- admission --------------------------------------------------------------------------------------
    def admit(self, running: int, free_pages: int, step: int) -> Admission:
        """Who joins this iteration, and the cancelled requests dropped from the head on the way (all taken
        off the queue). running: requests in the batch; free_pages: pages no request holds; step: the engine's
        decode step count. Each admitted request needs its pages (its prompt's, or what a suspended one held)
        plus one in reserve for every request that will be running."""
        if not self.waiting:
            return NOTHING
        resume: list[Suspended] = []
        prefill: list[Any] = []
        cancelled: list[tuple[Any, int]] = []
        while self.waiting and self.waiting[0][0].cancelled:
            cancelled.append(self._drop_head())
        free = self.max_slots - running
        if not self.waiting or free <= 0 or not self._admit_now(running, free, step):
            return Admission(cancelled=tuple(cancelled)) if cancelled else NOTHING
        budget, pages, taken = self.max_prefill_tokens, free_pages, 0
        while self.waiting and taken < free:
            req = self.waiting[0][0]
            if req.cancelled:
                cancelled.append(self._drop_head())
                continue
            suspended = self.suspended.get(id(req))
            if suspended is None:
                if taken and req.prompt_len > budget:
                    break
                need = self.pages_for(req.prompt_len)
            else:
                need = suspended.pages
            if need + running + taken > pages:
                break
            self.waiting.popleft()
            taken += 1
            pages -= need
            if suspended is None:
                budget -= req.prompt_len
                prefill.append(req)
            else:
                resume.append(self.suspended.pop(id(req)))
        return Admission(tuple(resume), tuple(prefill), tuple(cancelled))

    def _admit_now(self, running: int, free: int, step: int) -> bool:
        if not running:  # idle: latency first
            return True
        # busy: batch the prefills (each is hundreds of eager kernels between two decode steps)
        return len(self.waiting) >= min(self.admit_batch, free) or step - self.waiting[0][1] >= self.admit_wait_steps

    def _drop_head(self) -> tuple[Any, int]:
        req, _ = self.waiting.popleft()
        suspended = self.suspended.pop(id(req), None)
        return req, 0 if suspended is None else suspended.steps
