"""What a served GPT engine runs before its first client: the warm-up generations (TorchScript's specialising
runs, the compiled step's first variants, the common prefill graphs) and the capture of every decode graph a
load reaches (`warm_graphs`), on the engine's own thread. A mixin of `Engine` (engine.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from ..config import AUDIO_EOS, MAX_EMPTY_RETRIES
from .graphs import (
    BATCH_STEP,
    PACKED_STEP,
    PACKED_WARM_TOKENS,
    PREFILL_GRAPH_TOKENS,
    PREFILL_WARM_BATCHES,
    PREFILL_WARM_LENGTHS,
    WARM_DECODE_LEN,
    bucket_sizes,
)
from .request import EngineError, GenRequest, GenResult, SamplingParams


class WarmUp:
    """`Engine.warm_up`, `Engine.warm_graphs` and running a task on the engine thread."""

    def warm_up(self, text_eos_id: int | None = None, freeze: bool = True, timeout: float = 1800.0) -> None:
        """Run what a server meets first before any client does: TorchScript's specialising runs,
        and with graph buckets, per mode (code; text when `text_eos_id` is given) a request alone and
        two together, so the compiled step (batch 1 and the dynamic batch ≥ 2 variant) and their
        first CUDA graphs exist, and the prefill graphs of the common buckets (PREFILL_WARM_*); then
        `freeze_compiled`. Runs the loop itself when the engine thread is not started."""
        deadline = time.monotonic() + timeout
        modes = [("code", AUDIO_EOS)] + ([("text", text_eos_id)] if text_eos_id is not None else [])
        if self.graphs is None:  # nothing to capture or compile: TorchScript's specialising runs only
            modes, rounds, tokens = modes[:1], (1, 1), 4
        else:  # 16 tokens each; a pair steps at batch 2
            rounds, tokens = (1, 1, 2), 16
        for mode, eos in modes:
            for n in rounds:
                self._warm_batch([torch.arange(1, 9)] * n, tokens, deadline, mode, eos)
        if self.graphs is not None:
            self._warm_prefills([k for k in PREFILL_WARM_BATCHES if k <= self.max_slots], deadline)
        if freeze and self.graph_step is not None:
            self.freeze_compiled()

    def warm_graphs(self, mode: str = "code", max_len: int | None = None, timeout: float = 1800.0) -> int:
        """Capture now, before the first client, what a load would otherwise capture as it first reaches
        a bucket (each capture synchronises the device, stalling every running request): the decode
        graph of every batch bucket at every attention bucket up to `max_len` (default
        WARM_DECODE_LEN; with `decode_kernel` one bucket serves every length), the prefill graphs
        of the prompt counts `warm_up` left out, and the first-token graph of every prompt-count bucket. A capture
        that fails leaves its bucket eager, as in serving. Returns the number of graphs held afterwards."""
        if self.graphs is None:
            return 0
        deadline = time.monotonic() + timeout
        max_len = WARM_DECODE_LEN if max_len is None else max_len
        self._warm_prefills([k for k in bucket_sizes(BATCH_STEP, self.max_slots) if k not in PREFILL_WARM_BATCHES],
                            deadline, common=False)
        lens = sorted({self.graphs.buckets(1, n)[1] for n in range(1, min(max_len, self.max_context) + 1)})
        keys = [(bb, lb) for lb in lens for bb in bucket_sizes(BATCH_STEP, self.max_slots)]

        def capture() -> None:
            # a capture's warm-up steps every row of its bucket in `mode`: a live row of the other mode
            # would be stepped with the wrong head (the lazy path only meets buckets of its rows' mode)
            if self.rows:
                raise EngineError("warm_graphs needs an idle engine (requests are running)")
            for bb, lb in keys:
                self.graphs.decode_graph(mode, bb, lb)
            if self.prefill_graphs:  # an admission's first tokens, by prompt count (over slots 0.., none counted)
                for kb in bucket_sizes(BATCH_STEP, self.max_slots):
                    self.graphs.first_graph(kb, MAX_EMPTY_RETRIES)

        self._on_engine_thread(capture, deadline)
        return len(self.graphs.graphs)

    def _warm_prefills(self, counts: list[int], deadline: float, common: bool = True) -> None:
        """One prefill (no decode step) of k prompts per PREFILL_WARM_LENGTHS bucket that graphs take,
        for each k in `counts`: their graphs are captured now. Packed prefills (`packed_prefill`): one per token
        bucket instead, those up to PACKED_WARM_TOKENS where `common`, the larger ones otherwise."""
        if not self.prefill_graphs:
            return
        if self.packed_prefill:
            for tb in bucket_sizes(PACKED_STEP, PREFILL_GRAPH_TOKENS):
                if (tb <= PACKED_WARM_TOKENS) == common:
                    lens = self._packed_warm_lengths(tb)
                    if lens:
                        self._warm_batch([torch.arange(1, n + 1) for n in lens], 1, deadline)
            return
        for k in counts:
            for t in PREFILL_WARM_LENGTHS:
                if t < self.max_context and k * t <= PREFILL_GRAPH_TOKENS:
                    self._warm_batch([torch.arange(1, t + 1)] * k, 1, deadline)

    def _packed_warm_lengths(self, tokens: int) -> list[int]:
        """Prompt lengths that one admission of an idle engine prefills packed as `tokens` positions (at most 128
        each, as served prompts are), or [] where the slots, the context or the prefill budget cannot."""
        longest = min(tokens, 128, self.max_context - 1)
        k = -(-tokens // longest)
        if k > self.max_slots or tokens > self.scheduler.max_prefill_tokens:
            return []
        return [longest] * (k - 1) + [tokens - longest * (k - 1)]

    def _on_engine_thread(self, fn: Callable[[], object], deadline: float) -> None:
        """Run fn where the engine's graphs run (its thread, between two steps), wait for it, raise
        what it raised."""
        if self.thread is None or self.thread is threading.current_thread():
            with torch.inference_mode():
                fn()
            return
        done, box = threading.Event(), []

        def task() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001  handed to the caller
                box.append(e)
            finally:
                done.set()

        with self.cv:
            if self.stopping:
                raise EngineError("engine is stopping")
            self._tasks.append(task)
            self.cv.notify_all()
        while not done.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not self.thread.is_alive():
                raise EngineError("the engine thread has ended")
            if time.monotonic() >= deadline:
                raise EngineError("engine task did not finish in time")
        if box:
            raise box[0]

    def _warm_batch(self, prompts: list[Tensor], tokens: int, deadline: float, mode: str = "code",
                    eos: int = AUDIO_EOS) -> None:
        """Generate `tokens` for each prompt, all waiting before the engine looks (an idle engine admits
        them in one prefill); raise what failed."""
        results: list[GenResult] = []
        with self.cv:  # re-entrant: submit takes it too
            for i, ids in enumerate(prompts):
                params = SamplingParams(1.0, None, None, 1.0, tokens, tokens, seed=i)
                self.submit(GenRequest(ids, params, results.append, mode=mode, eos_id=eos, want_hidden=False))
        while len(results) < len(prompts):
            if time.monotonic() > deadline:
                raise EngineError(f"engine warm-up ({mode}, {len(prompts)} requests) did not finish in time")
            if self.thread is None:
                self._run_once(block=False)
            else:
                time.sleep(0.01)
        for r in results:
            if r.error is not None:
                raise r.error

