"""The GPT engine's paged KV cache and slot layout: pages granted to a slot as its positions reach them and released
when it leaves (`_grant`, `_release`, the block table `_sync_tables`), a step's pages ensured before it runs
(`_ensure_pages`, suspending the rows the scheduler picks when the pool runs short: `_suspend`, `_resume`), and the
running rows kept in slots 0..B-1 (`_compact`, `_clear_free`). A mixin of `Engine` (engine.py), which owns the state;
which rows to suspend and how many pages a request needs is `scheduler.py`'s."""

from __future__ import annotations

import logging

import numpy as np
import torch

from .request import Slot
from .scheduler import Suspended

log = logging.getLogger(__name__)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache viewed as bytes for the page moves (their CPU kernels have no fp8); other caches as they are."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


class KvPages:
    """`Engine`'s page pool, block tables and slot layout (state: `_alloc_pages`)."""

    def _alloc_pages(self) -> None:
        """The cache's pages and each slot's block table (engine thread, see `Engine._alloc`)."""
        s, dev = self.max_slots, self.device
        self.k_cache, self.v_cache = self.model.new_cache(self.num_pages, self.page, self.cache_dtype, dev)
        # each slot's pages in order (page 0, scratch, where it holds none); the host copy is the truth,
        # rows that changed are copied over before the next prefill or step (`_sync_tables`)
        self.block_table = torch.zeros(s, self.table_width, dtype=torch.int64, device=dev)
        self.h_table = np.zeros((s, self.table_width), dtype=np.int64)
        self.h_pages = np.zeros(s, dtype=np.int64)
        self.free_pages: list[int] = list(range(self.num_pages - 1, 0, -1))
        self._dirty: set[int] = set()

    def _grant(self, slot_id: int, pages: int) -> None:
        """Give the slot free pages until it holds `pages` (the caller checked there are enough)."""
        have = int(self.h_pages[slot_id])
        if pages > have:
            for j in range(have, pages):
                self.h_table[slot_id, j] = self.free_pages.pop()
            self.h_pages[slot_id] = pages
            self._dirty.add(slot_id)

    def _release(self, slot_id: int) -> None:
        """The slot's pages back to the pool (work queued on the device before still reads them in order)."""
        have = int(self.h_pages[slot_id])
        if have:
            self.free_pages.extend(self.h_table[slot_id, :have].tolist())
            self.h_table[slot_id, :have] = 0
            self.h_pages[slot_id] = 0
            self._dirty.add(slot_id)

    def _sync_tables(self) -> None:
        """The block table rows that changed, onto the device (one copy)."""
        if self._dirty:
            rows = sorted(self._dirty)
            self._dirty.clear()
            at = self._h2d(torch.tensor(rows, dtype=torch.int64))
            self.block_table.index_copy_(0, at, self._h2d(torch.from_numpy(self.h_table[rows])))

    def _ensure_pages(self, ahead: np.ndarray | None = None) -> bool:
        """Before a decode step: every running row holds the page of the position it writes; where the pool
        has too few, the rows the scheduler picks are suspended. `ahead` [B]: tokens each row may have on the
        device beyond the host's count (a step in flight); False, and nothing done, where that would need a
        suspension (which copies exactly the tokens a row has: land the step first)."""
        b = len(self.rows)
        reach = self.h_plen[:b] + self.h_n[:b] + (0 if ahead is None else ahead)
        want = self.scheduler.pages_for(reach)  # through the position it writes
        short = want > self.h_pages[:b]
        if int(short.sum()) > len(self.free_pages):
            if ahead is not None and ahead.any():
                return False
            self._suspend(self.scheduler.victims([s.seq for s in self.rows], self.h_pages[:b], short,
                                                 len(self.free_pages)))
            b = len(self.rows)
            want = self.scheduler.pages_for(self.h_plen[:b] + self.h_n[:b])
            short = want > self.h_pages[:b]
        for i in np.flatnonzero(short):
            self._grant(int(i), int(want[i]))
        return True

    def _suspend(self, ids: list[int]) -> None:
        """Take the rows `ids` out of the batch: their pages' keys and values, tokens, hidden states and
        sampling state to the host (queued before anything reuses the pages), their pages freed; back to
        the head of the queue (the scheduler's `requeue`)."""
        assert not self._in_flight(), "suspending with a step in flight"
        records = []
        for i in ids:
            slot = self.rows[i]
            n, k = int(self.h_n[i]), int(self.h_pages[i])
            pages = self._h2d(torch.from_numpy(self.h_table[i, :k].copy()))
            slot.saved = (self._d2h(_bytes(self.k_cache).index_select(1, pages)),
                          self._d2h(_bytes(self.v_cache).index_select(1, pages)),
                          self._d2h(self.tokens[i, :n]), self._d2h(self.hiddens[i, :n]),
                          self.row_params.narrow(i, 1).map(self._d2h),
                          (n, int(self.h_plen[i]), int(self.h_max[i]), bool(self.h_text[i]), k))
            self.streaming.discard(slot)
            self._release(i)
            records.append(Suspended(slot.req, slot.seq, pages=k, steps=n, state=slot))
        self._compact(set(ids))
        self.scheduler.requeue(records, self.counters.steps)
        self.counters.preemptions += len(records)
        log.debug("suspended %d requests for want of KV pages (%d free)", len(records), len(self.free_pages))

    def _resume(self, slot: Slot) -> None:
        """A suspended request into the next slot, exactly as it was."""
        k_saved, v_saved, toks, hids, params, (n, plen, max_new, text, k) = slot.saved
        i = len(self.rows)
        self._grant(i, k)
        pages = self._h2d(torch.from_numpy(self.h_table[i, :k].copy()))
        _bytes(self.k_cache).index_copy_(1, pages, self._h2d(k_saved))
        _bytes(self.v_cache).index_copy_(1, pages, self._h2d(v_saved))
        self.tokens[i, :n].copy_(self._h2d(toks))
        self.hiddens[i, :n].copy_(self._h2d(hids))
        self.row_params.narrow(i, 1).copy_(params.map(self._h2d))
        self.h_n[i], self.h_plen[i], self.h_max[i], self.h_text[i] = n, plen, max_new, text
        slot.idx, slot.saved = i, None
        self.rows.append(slot)
        if slot.req.on_tokens is not None:
            self.streaming.add(slot)
        self.counters.resumes += 1

    def _compact(self, done: set[int]) -> None:
        """Keep the running requests in slots 0..B-1: the last ones move into the freed slots below (their
        state and block table rows; their keys and values stay in their pages). `done` rows hold no pages."""
        b = len(self.rows)
        keep = b - len(done)
        holes = sorted(i for i in done if i < keep)
        movers = [i for i in range(keep, b) if i not in done]
        if holes:
            src_h, dst_h = np.array(movers), np.array(holes)
            src = self._h2d(torch.from_numpy(src_h))
            dst = self._h2d(torch.from_numpy(dst_h))
            t = int(self.h_n[src_h].max()) + 1  # index h_n too: the token a step in flight (overlap) wrote there
            for buf in (self.tokens.narrow(1, 0, t), self.hiddens.narrow(1, 0, t), self.row_params.ints,
                        self.row_params.floats):
                buf.index_copy_(0, dst, buf.index_select(0, src))
            for arr in (self.h_n, self.h_plen, self.h_max, self.h_text, self.h_table, self.h_pages):
                arr[dst_h] = arr[src_h]
            self.h_table[src_h] = 0
            self.h_pages[src_h] = 0
            self._dirty.update(holes + movers)
            for s, d in zip(movers, holes, strict=True):
                slot = self.rows[s]
                slot.idx = d
                self.rows[d] = slot
            for f in self._in_flight():  # the rows of a step in flight move with them
                f.slot_of[dst_h] = f.slot_of[src_h]
        for f in self._in_flight():
            f.slot_of[keep:b] = -1
        del self.rows[keep:]
        self._clear_free(keep, b)

    def _clear_free(self, lo: int, hi: int) -> None:
        # free slots are the padding rows of graph buckets: n = prompt_len = 0 (nothing in their
        # history is read) and the audio EOS (a text request's EOS id would index past the code head)
        if hi > lo:
            self.row_params.narrow(lo, hi - lo).copy_(self._free_row)
            self.h_n[lo:hi] = 0
            self.h_plen[lo:hi] = 0
            self.h_text[lo:hi] = False

