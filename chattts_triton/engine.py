"""In-flight batching engine for the ChatTTS GPT.

A single loop thread owns the model, the slot KV cache and all per-slot state. Each iteration it
admits waiting requests into free slots (one batched prefill), runs one decode step for every
active request, samples, and retires the finished ones through their callbacks. Requests join and
leave the running batch at every step, and each one's tokens depend only on its own prompt, params
and seed (per-slot positions, per-request counter-based sampling).

`model` is `ChatTTSGPT` or its TorchScript export (same methods).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional

import torch
from torch import Tensor

from . import sampling
from .config import AUDIO_EOS, REPETITION_WINDOW

log = logging.getLogger(__name__)

MAX_EMPTY_RETRIES = 16  # ensure_non_empty re-draws of the first step before giving up


@dataclass
class SamplingParams:
    temperature: float
    top_p: Optional[float]  # None: off (upstream passes None to skip the warper)
    top_k: Optional[int]
    repetition_penalty: float
    max_new_tokens: int
    min_new_tokens: int
    seed: int
    ensure_non_empty: bool = True


@dataclass
class GenRequest:
    """One generation. `mode` "code": audio codes through the 4 code heads (EOS = code 625);
    "text": refine-text through the text head (EOS = `eos_id`)."""

    text_ids: Tensor  # int64 [N]
    params: SamplingParams
    on_done: Callable[["GenResult"], None]
    mode: str = "code"
    audio_codes: Optional[Tensor] = None  # int64 [P, num_vq] appended after the text (spk_smp)
    spk_emb: Optional[Tensor] = None  # float [hidden] written at every spk_emb_id position
    spk_emb_id: int = -1
    eos_id: int = AUDIO_EOS
    want_hidden: bool = True
    cancelled: bool = False
    # streaming: on_tokens(tokens, hiddens) gets the tokens generated since its last call once
    # there are at least `stream_every` of them (on the engine thread: hand off, never block).
    # The consumer may change stream_every at any time; the tail arrives in on_done's result.
    on_tokens: Optional[Callable[[Tensor, Optional[Tensor]], None]] = None
    stream_every: int = 1

    @property
    def prompt_len(self) -> int:
        return int(self.text_ids.numel()) + (0 if self.audio_codes is None else int(self.audio_codes.shape[0]))

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class GenResult:
    tokens: Optional[Tensor]  # code: int64 [n, num_vq]; text: int64 [n]
    hiddens: Optional[Tensor]  # float32 [n, hidden] (code mode with want_hidden)
    finish_reason: str  # "eos" | "max_tokens" | "cancelled" | "error"
    error: Optional[BaseException] = None
    steps: int = 0


class EngineError(RuntimeError):
    pass


class _Slot:
    __slots__ = ("req", "n", "plen", "attempt", "emitted")

    def __init__(self, req: GenRequest):
        self.req = req
        self.n = 0  # tokens generated (kept) so far
        self.plen = req.prompt_len
        self.attempt = 0
        self.emitted = 0  # tokens handed to req.on_tokens


class Engine:
    def __init__(
        self,
        model,
        *,
        max_slots: int,
        max_context: int,
        max_new_tokens: int,
        hidden: int,
        num_vq: int,
        device: str | torch.device = "cpu",
        cache_dtype: torch.dtype = torch.float32,
        compute_dtype: torch.dtype = torch.float32,
        max_prefill_tokens: int = 4096,
        cuda_graphs: bool = True,
        start: bool = True,
    ):
        self.model = model
        self.device = torch.device(device)
        self.max_slots = max_slots
        self.max_context = max_context
        self.max_new_tokens = max_new_tokens
        self.hidden = hidden
        self.num_vq = num_vq
        self.compute_dtype = compute_dtype
        self.max_prefill_tokens = max_prefill_tokens
        dev = self.device
        s = max_slots + 1  # the last slot is scratch: padding rows of CUDA-graph buckets use it
        self.scratch = max_slots
        self.k_cache, self.v_cache = model.new_cache(s, max_context, cache_dtype, dev)
        self.tokens = torch.zeros(s, max_new_tokens + 1, num_vq, dtype=torch.int64, device=dev)
        self.hiddens = torch.zeros(s, max_new_tokens + 1, hidden, dtype=torch.float32, device=dev)
        self.n_dev = torch.zeros(s, dtype=torch.int64, device=dev)
        self.p_temp = torch.ones(s, device=dev)
        self.p_top_p = torch.ones(s, device=dev)
        self.p_top_k = torch.zeros(s, dtype=torch.int64, device=dev)
        self.p_pen = torch.ones(s, device=dev)
        self.p_min = torch.zeros(s, dtype=torch.int64, device=dev)
        self.p_seed = torch.zeros(s, dtype=torch.int64, device=dev)
        self.p_attempt = torch.zeros(s, dtype=torch.int64, device=dev)
        self.p_eos = torch.full((s,), AUDIO_EOS, dtype=torch.int64, device=dev)
        self.slots: Dict[int, _Slot] = {}
        self.free: List[int] = list(range(max_slots - 1, -1, -1))
        self.waiting: Deque[GenRequest] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.steps = 0
        self.graphs = CudaGraphs(self) if (cuda_graphs and self.device.type == "cuda") else None
        self.thread: Optional[threading.Thread] = None
        if start:
            self.start()

    # -- public ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="chattts-engine", daemon=True)
        self.thread.start()

    def validate(self, req: GenRequest) -> None:
        p = req.params
        if req.text_ids.numel() == 0:
            raise ValueError("empty prompt")
        if p.max_new_tokens < 1 or p.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens must be in [1, {self.max_new_tokens}], got {p.max_new_tokens}")
        if req.prompt_len + p.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({req.prompt_len} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                f"context of {self.max_context} tokens"
            )

    def submit(self, req: GenRequest) -> None:
        self.validate(req)
        with self.cv:
            if self.stopping:
                raise EngineError("engine is stopping")
            self.waiting.append(req)
            self.cv.notify()

    def generate(self, req: GenRequest, timeout: Optional[float] = None) -> GenResult:
        """Blocking helper: submit and wait for the result."""
        done = threading.Event()
        box: List[GenResult] = []
        user_cb = req.on_done

        def cb(res: GenResult) -> None:
            box.append(res)
            done.set()
            if user_cb is not None:
                user_cb(res)

        req.on_done = cb
        self.submit(req)
        if not done.wait(timeout):
            req.cancel()
            raise TimeoutError("generation timed out")
        return box[0]

    @property
    def active(self) -> int:
        return len(self.slots)

    @property
    def pending(self) -> int:
        return len(self.waiting)

    def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop accepting work; with drain, finish what is queued and running first."""
        with self.cv:
            self.stopping = True
            if not drain:
                for r in self.waiting:
                    r.cancel()
                for s in self.slots.values():
                    s.req.cancel()
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)

    # -- loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.cv:
                while not self.waiting and not self.slots and not self.stopping:
                    self.cv.wait()
                if self.stopping and not self.waiting and not self.slots:
                    return
                admitted = self._take_admissions()
            try:
                with torch.inference_mode():
                    if admitted:
                        self._prefill(admitted)
                    if self.slots:
                        self._decode_step()
            except Exception as e:  # fail the requests in flight, keep serving the next ones
                log.exception("engine step failed")
                for slot_id in list(self.slots):
                    self._finish(slot_id, "error", error=e)

    def _take_admissions(self) -> List[int]:
        admitted: List[int] = []
        budget = self.max_prefill_tokens
        while self.waiting and self.free:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                self._call(req, GenResult(None, None, "cancelled"))
                continue
            if admitted and req.prompt_len > budget:
                break
            self.waiting.popleft()
            slot_id = self.free.pop()
            self.slots[slot_id] = _Slot(req)
            budget -= req.prompt_len
            admitted.append(slot_id)
        return admitted

    def _set_params(self, slot_id: int, req: GenRequest) -> None:
        p = req.params
        self.p_temp[slot_id] = p.temperature
        self.p_top_p[slot_id] = 1.0 if p.top_p is None else p.top_p
        self.p_top_k[slot_id] = 0 if p.top_k is None else p.top_k
        self.p_pen[slot_id] = p.repetition_penalty
        self.p_min[slot_id] = p.min_new_tokens
        self.p_seed[slot_id] = p.seed
        self.p_attempt[slot_id] = 0
        self.p_eos[slot_id] = req.eos_id
        self.n_dev[slot_id] = 0

    def _prompt_embeds(self, req: GenRequest) -> Tensor:
        ids = req.text_ids.to(self.device)
        x = self.model.embed_text(ids)
        if req.spk_emb is not None:
            pos = ids == req.spk_emb_id
            x = torch.where(pos.unsqueeze(1), req.spk_emb.to(self.device, x.dtype).unsqueeze(0), x)
        if req.audio_codes is not None and req.audio_codes.numel():
            x = torch.cat([x, self.model.embed_code(req.audio_codes.to(self.device))], 0)
        return x.to(self.compute_dtype)

    def _prefill(self, slot_ids: List[int]) -> None:
        embeds = [self._prompt_embeds(self.slots[s].req) for s in slot_ids]
        lens = [e.shape[0] for e in embeds]
        t = max(lens)
        b = len(slot_ids)
        x = torch.zeros(b, t, self.hidden, dtype=self.compute_dtype, device=self.device)
        positions = torch.full((b, t), -1, dtype=torch.int64)
        for i, e in enumerate(embeds):
            x[i, : lens[i]] = e
            positions[i, : lens[i]] = torch.arange(lens[i])
        slots_t = torch.tensor(slot_ids, dtype=torch.int64, device=self.device)
        for s in slot_ids:
            self._set_params(s, self.slots[s].req)
        h = self.model(x, positions.to(self.device), slots_t, self.k_cache, self.v_cache, t)
        last = torch.tensor([n - 1 for n in lens], device=self.device)
        h_last = h[torch.arange(b, device=self.device), last].float()
        self._first_step(slot_ids, slots_t, h_last)

    def _decode_step(self) -> None:
        groups: Dict[str, List[int]] = {}
        for s in self.slots:
            groups.setdefault(self.slots[s].req.mode, []).append(s)
        for mode, ids in groups.items():
            pos_host = [self.slots[s].plen + self.slots[s].n - 1 for s in ids]
            attn_len = max(pos_host) + 1
            graphed = None
            if self.graphs is not None and mode == "code":
                graphed = self.graphs.step(ids, pos_host, attn_len)
            if graphed is not None:
                tok, hit = graphed
            else:
                st = torch.tensor(ids, dtype=torch.int64, device=self.device)
                positions = torch.tensor(pos_host, dtype=torch.int64, device=self.device)
                tok, hit = self.step_core(st, positions, attn_len, mode)
            self._advance(ids, hit)
        self.steps += 1

    def step_core(self, st: Tensor, positions: Tensor, attn_len: int, mode: str = "code"):
        """One decode step of the rows `st` (pure tensor work: no host sync, CUDA-graph safe).

        Feeds each row's last token, samples the next, records token and hidden state, and returns
        (tokens [B, num_vq], eos_hit [B])."""
        n = self.n_dev.index_select(0, st)
        last_tok = self.tokens[st, (n - 1).clamp(min=0)]
        if mode == "code":
            x = self.model.embed_code(last_tok)
        else:
            x = self.model.embed_text(last_tok[:, 0])
        x = x.to(self.compute_dtype).unsqueeze(1)
        h = self.model(x, positions.unsqueeze(1), st, self.k_cache, self.v_cache, attn_len)[:, 0].float()
        return self.sample_core(st, n, h, mode)

    def sample_core(self, st: Tensor, n: Tensor, h: Tensor, mode: str):
        b = st.shape[0]
        q = self.num_vq if mode == "code" else 1
        hc = h.to(self.compute_dtype)
        logits = self.model.logits_code(hc) if mode == "code" else self.model.logits_text(hc).unsqueeze(1)
        logits = logits.reshape(b * q, logits.shape[-1]).float()

        def rep(t: Tensor) -> Tensor:  # per-request value for each of its rows
            return t.repeat_interleave(q)

        w = REPETITION_WINDOW
        offs = (n.unsqueeze(1) - w + torch.arange(w, device=self.device)).clamp(min=0)  # [B, W]
        hist = self.tokens[st.unsqueeze(1), offs][..., :q].permute(0, 2, 1).reshape(b * q, w)
        eos = self.p_eos.index_select(0, st)
        eos_rows = rep(eos)
        logits = sampling.process_logits(
            logits,
            rep(self.p_temp.index_select(0, st)),
            rep(self.p_pen.index_select(0, st)),
            rep(self.p_top_p.index_select(0, st)),
            rep(self.p_top_k.index_select(0, st)),
            hist,
            rep(n.clamp(max=w)),
            rep(n < self.p_min.index_select(0, st)),
            eos_rows,
        )
        attempt = self.p_attempt.index_select(0, st)
        row = torch.arange(q, device=self.device).repeat(b)
        u = sampling.uniform(rep(self.p_seed.index_select(0, st)), rep(n), row, rep(attempt))
        tok = sampling.sample(logits, u).view(b, q)
        hit = (tok == eos.unsqueeze(1)).any(1)
        if q < self.num_vq:
            tok = tok.expand(b, self.num_vq)
        self.tokens[st, n] = tok
        self.hiddens[st, n] = h
        self.n_dev.index_add_(0, st, (~hit).long())
        self.n_dev.narrow(0, self.scratch, 1).zero_()  # padding rows of a CUDA-graph bucket write here
        return tok, hit

    def _first_step(self, slot_ids: List[int], st: Tensor, h: Tensor) -> None:
        """Sample each new request's first token; upstream ensure_non_empty: an EOS there is redrawn."""
        modes = {self.slots[s].req.mode for s in slot_ids}
        for mode in modes:
            ids = [s for s in slot_ids if self.slots[s].req.mode == mode]
            sub = torch.tensor([slot_ids.index(s) for s in ids], device=self.device)
            sts, hs = st[sub], h[sub]
            zero = torch.zeros(len(ids), dtype=torch.int64, device=self.device)
            while True:
                self.n_dev.index_fill_(0, sts, 0)
                _, hit = self.sample_core(sts, zero, hs, mode)
                hit_host = hit.tolist()
                redraw = []
                for s, eos in zip(ids, hit_host):
                    slot = self.slots[s]
                    if eos and slot.req.params.ensure_non_empty and slot.attempt + 1 < MAX_EMPTY_RETRIES:
                        slot.attempt += 1
                        redraw.append(s)
                if not redraw:
                    break
                self.p_attempt.index_add_(0, torch.tensor(redraw, device=self.device), torch.ones(len(redraw), dtype=torch.int64, device=self.device))
            self._advance(ids, hit)

    def _advance(self, slot_ids: List[int], hit: Tensor) -> None:
        hit_host = hit[: len(slot_ids)].tolist()
        for i, s in enumerate(slot_ids):
            slot = self.slots[s]
            if slot.req.cancelled:
                self._finish(s, "cancelled")
            elif hit_host[i]:
                self._finish(s, "eos")
            else:
                slot.n += 1
                if slot.n >= slot.req.params.max_new_tokens:
                    self._finish(s, "max_tokens")
                elif slot.req.on_tokens is not None and slot.n - slot.emitted >= max(1, slot.req.stream_every):
                    self._emit(s, slot)

    def _emit(self, slot_id: int, slot: _Slot) -> None:
        a, b = slot.emitted, slot.n
        toks = self.tokens[slot_id, a:b].cpu()
        hid = self.hiddens[slot_id, a:b].cpu() if slot.req.want_hidden else None
        slot.emitted = b
        try:
            slot.req.on_tokens(toks, hid)
        except Exception:  # a failing consumer must not take the engine down: stop its generation
            log.exception("streaming callback failed; cancelling that generation")
            slot.req.cancel()

    def _finish(self, slot_id: int, reason: str, error: Optional[BaseException] = None) -> None:
        slot = self.slots.pop(slot_id)
        self.free.append(slot_id)
        n = slot.n
        req = slot.req
        if reason in ("eos", "max_tokens"):
            toks = self.tokens[slot_id, :n].clone()
            if req.mode == "text":
                toks = toks[:, 0]
            hid = self.hiddens[slot_id, :n].clone() if (req.want_hidden and req.mode == "code") else None
            res = GenResult(toks, hid, reason, steps=n)
        else:
            res = GenResult(None, None, reason, error=error, steps=n)
        self._call(req, res)

    @staticmethod
    def _call(req: GenRequest, res: GenResult) -> None:
        try:
            req.on_done(res)
        except Exception:  # a failing callback must not take the engine down
            log.exception("generation callback failed")


def _bucket(n: int, smallest: int, largest: int) -> int:
    b = smallest
    while b < n:
        b *= 2
    return min(b, largest)


class CudaGraphs:
    """Decode steps of audio-code rows replayed from CUDA graphs.

    One graph per (batch bucket, attention-length bucket), both powers of two, captured on first
    use into one shared memory pool. Rows past the live batch point at the scratch slot. What a
    graph runs is `Engine.step_core`, the same code as the eager path.
    """

    MIN_LEN = 128

    def __init__(self, engine: Engine):
        self.e = engine
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: Dict[tuple, tuple] = {}
        self.stream = torch.cuda.Stream(device=engine.device)

    def step(self, ids: List[int], pos_host: List[int], attn_len: int):
        e = self.e
        b = len(ids)
        bb = _bucket(b, 1, _bucket(e.max_slots, 1, 1 << 30))
        lb = _bucket(attn_len, self.MIN_LEN, e.max_context)
        key = (bb, lb)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(bb, lb)
            except RuntimeError:  # never fail requests over an optimisation: run this bucket eagerly
                log.exception("CUDA graph capture failed for batch=%d attn_len=%d; running it eagerly", bb, lb)
                self.graphs[key] = None
        entry = self.graphs[key]
        if entry is None:
            return None
        graph, slots, positions, tok, hit = entry
        pad = bb - b
        host = torch.tensor([ids + [e.scratch] * pad, pos_host + [0] * pad], dtype=torch.int64)
        slots.copy_(host[0])
        positions.copy_(host[1])
        graph.replay()
        return tok, hit

    def _capture(self, bb: int, lb: int):
        e = self.e
        slots = torch.full((bb,), e.scratch, dtype=torch.int64, device=e.device)
        positions = torch.zeros(bb, dtype=torch.int64, device=e.device)
        # the scratch slot's state must not leak into live slots: warm up on scratch rows only
        self.stream.wait_stream(torch.cuda.current_stream(e.device))
        with torch.cuda.stream(self.stream):
            for _ in range(3):
                e.step_core(slots, positions, lb)
        torch.cuda.current_stream(e.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            tok, hit = e.step_core(slots, positions, lb)
        log.info("captured decode graph batch=%d attn_len=%d", bb, lb)
        return graph, slots, positions, tok, hit
