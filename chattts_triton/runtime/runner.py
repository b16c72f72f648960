"""The GPT engine's tensor work: the decode step (`step_core`), sampling (`sample_core`), the prefill
(`prefill_core`, `run_prefill`, `_prompt_batch`), the compiled step, and the slot state they read and write
(tokens, hidden states, `RowParams`). A mixin of `Engine` (engine.py), which owns the state and decides when
each runs; `step_core` and `prefill_core` are pure tensor work (no host sync: CUDA-graph safe)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ..config import REPETITION_WINDOW
from ..model import rowops, sampling
from . import tuning
from .graphs import LEN_STEP, CudaGraphs, to_host
from .request import EngineError, GenRequest
from .row_params import RowParams

log = logging.getLogger(__name__)


def _host_array(t: Tensor) -> np.ndarray:
    """A request's input tensor as a numpy array (no copy where it is on the host already; numpy has no bfloat16)."""
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy(force=not t.is_cpu or t.requires_grad)


def _positions(lens: np.ndarray) -> np.ndarray:
    """0..len-1 for each length, end to end: [sum(lens)]."""
    return np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)


def paged_interface(model) -> bool:
    """Whether `model` (ChatTTSGPT or its TorchScript export) takes block tables (`tables`); a gpt.pt
    exported before the paged cache takes a slot range instead."""
    try:
        if isinstance(model, torch.jit.ScriptModule):
            names = [a.name for a in model.forward.schema.arguments]
        else:
            names = list(inspect.signature(model.forward).parameters)
    except Exception:  # noqa: BLE001  an unusual wrapper: let the first step tell
        return True
    return "tables" in names


def check_model(model) -> None:
    if not paged_interface(model):
        raise EngineError("the GPT model was exported before the paged KV cache: re-export it (python -m export), "
                          "or run the eager module built from its weights (gpt.eager_from_script)")


class Runner:
    """`Engine`'s decode step, sampling and prefill (state: `_alloc_slots`)."""

    def _alloc_slots(self) -> None:
        """Each slot's tokens, hidden states and sampling state (engine thread, see `Engine._alloc`)."""
        max_slots, max_new_tokens, num_vq, hidden = self.max_slots, self.max_new_tokens, self.num_vq, self.hidden
        dev = self.device
        # running requests hold slots 0..B-1 (compacted); CUDA-graph buckets pad with free slots B..
        # and never exceed max_slots, so no scratch slot is needed
        s = max_slots
        self.tokens = torch.zeros(s, max_new_tokens + 1, num_vq, dtype=torch.int64, device=dev)
        # the model's final hidden states are in the compute dtype: kept in it, they are exact at half the memory
        self.hiddens = torch.zeros(s, max_new_tokens + 1, hidden, dtype=self.compute_dtype, device=dev)
        # each slot's sampling state and counts (row_params.py); a free slot's pads graph buckets
        self.row_params = RowParams.free(s, dev)
        self._free_row = RowParams.free(1, dev)
        self.n_dev = self.row_params.n  # the count column, kept as one view: every step writes it in place
        self.n_live = torch.zeros((), dtype=torch.int64, device=dev)  # rows ≥ this in a graph bucket are padding
        self.graphs = CudaGraphs(self) if (self.cuda_graphs and self.device.type == "cuda") else None

    def compile_step(self, dynamic: bool = True, backend: str = "inductor", prefill: bool = False,
                     gemv: bool = False, gemv_tune: bool = False, gemv_kernels: bool | None = None) -> None:
        """Graph buckets run the decode step compiled by torch.compile (inductor: fused norm, RoPE
        and sampling kernels, still replayed from CUDA graphs: faster than the TorchScript step, bench/probes/step.py
        measures both); audio-code steps only. Needs the eager module, not TorchScript.
        dynamic: one compile for all buckets (batch 1 still gets its own); else one per bucket. Call
        `freeze_compiled` once the buckets in use are warm: a bucket that would need a recompile then
        runs the plain step instead of stalling every running request for the tens of seconds a
        compile takes. prefill: prefills (graphed or not) run `prefill_core` compiled too, with dynamic
        shapes (opt-in: faster alone from its graph, but it makes a served start-up minutes longer;
        docs/performance.md). gemv: the compiled step of one row computes its projections and code heads as
        reductions inductor generates and fuses, not cuBLAS GEMMs (`ChatTTSGPT.set_gemv`; eager calls unchanged),
        compiled on its own; gemv_kernels: its layers' projections are `rowops.row_matvec` kernels, each fused with
        its norm, gate or skip connection (False: inductor's reductions; None: where they pay,
        `rowops.kernels_pay`). gemv_tune: with gemv, inductor tunes that compile's launch configurations at its
        first run (`tuning.py`)."""
        if isinstance(self.model, torch.jit.ScriptModule):
            raise EngineError("compile_step needs the eager GPT module (chattts_triton.model.gpt), not TorchScript")
        import torch._dynamo as dynamo
        import torch._inductor.config as inductor_config

        cfg = dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(cfg, name):  # one compile per (mode, batch bucket, length bucket) unless dynamic
                setattr(cfg, name, max(getattr(cfg, name), 4096))
        # autotuning a kernel that writes in place clones its arguments per tried config: for the
        # KV-cache writes that is the whole multi-GB cache (minutes, and no result)
        inductor_config.triton.autotune_pointwise = False
        if gemv:
            self.model.set_gemv(True, kernels=rowops.kernels_pay(self.device) if gemv_kernels is None else gemv_kernels)
        self.graph_step = torch.compile(self.step_core, dynamic=dynamic, backend=backend)
        self.graph_step_one = (torch.compile(self.step_core, dynamic=dynamic, backend=backend,
                                             **(tuning.one_row_options(backend) if gemv_tune else {}))
                               if gemv else None)
        self.graph_prefill = torch.compile(self.prefill_core, dynamic=True, backend=backend) if prefill else None

    def compiled_step(self, rows: int) -> Callable | None:
        """The compiled step that a graph bucket of `rows` rows runs (None: the plain `step_core`)."""
        return self.graph_step_one if rows == 1 and self.graph_step_one is not None else self.graph_step

    def freeze_compiled(self) -> None:
        self.compiled_frozen = True

    def compile_stance(self) -> str:
        """torch.compiler stance of compiled calls: once frozen, a call that would recompile runs plainly."""
        return "eager_on_recompile" if self.compiled_frozen else "default"

    # -- host <-> device without extra host syncs ---------------------------------------------------
    def _h2d(self, t: Tensor) -> Tensor:
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)  # a pageable copy would sync the stream

    def _h2d_into(self, dst: Tensor, t: Tensor) -> None:
        """`dst.copy_(t)` from host memory in one copy (through pinned memory on CUDA: no sync, no device temporary)."""
        dst.copy_(t.pin_memory() if self.device.type == "cuda" else t, non_blocking=True)

    def _d2h(self, t: Tensor) -> Tensor:
        if self.device.type != "cuda":
            return t.clone()  # the slot's buffers are reused: hand out a copy
        return t.to("cpu", non_blocking=True)  # pinned; valid after the next host sync

    def _set_live(self, b: int) -> None:
        if b != self._live:
            self.n_live.fill_(b)  # a kernel with a scalar argument: no copy, no sync
            self._live = b


    # -- prefill --------------------------------------------------------------------------------
    def run_prefill(self, x: Tensor, positions: Tensor, idx: Tensor) -> Tensor:
        """`prefill_core`, compiled where `compile_step(prefill=True)` asked (frozen: a shape that would
        recompile runs it plainly, as the step does)."""
        if self.graph_prefill is not None:
            try:
                with torch.compiler.set_stance(self.compile_stance()):
                    return self.graph_prefill(x, positions, idx)
            except Exception:
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise  # the capture is spoilt: the graph cache runs this bucket eagerly (and we get here again)
                log.exception("the compiled prefill failed; prefills run the plain module from now on")
                self.graph_prefill = None
        return self.prefill_core(x, positions, idx)

    def prefill_core(self, x: Tensor, positions: Tensor, idx: Tensor) -> Tensor:
        """Padded prompts (`_prompt_batch`: x [rows, t, hidden], idx [2, rows]: slots, last positions): the final
        hidden state [rows, hidden] (float) of each row's last prompt position, its keys and values written to
        the pages of slot idx[0, row]. Packed prompts (`_packed_batch`: x [tokens, hidden], idx [tokens]: each
        position's slot): `packed_prefill_core`'s [tokens, hidden]. Pure tensor work: CUDA-graph safe."""
        if x.dim() == 2:
            return self.packed_prefill_core(x, positions, idx)
        h = self.model.prefill(x, positions, self.block_table.index_select(0, idx[0]), self.k_cache, self.v_cache)
        return h[torch.arange(x.shape[0], device=self.device), idx[1]].float()

    def _set_params(self, b0: int, reqs: Sequence[GenRequest]) -> None:
        self.row_params.narrow(b0, len(reqs)).copy_(RowParams.of(reqs).map(self._h2d))

    def _prompt_rows(self, reqs: Sequence[GenRequest]) -> tuple[Tensor, np.ndarray, np.ndarray]:
        """The admitted prompts' inputs embedded: flat [n + 1, hidden] in the compute dtype (every text
        position, a speaker embedding where the request puts one, then every audio-code position, then a zero
        row that padding points at); `rows`, flat's row of each prompt position, request after request, in order;
        `lens`, each request's prompt length. One host→device copy per input kind, one embedding call per kind,
        and the index arithmetic in numpy over all requests at once: per-request tensor calls cost an admission of
        dozens of prompts hundreds of dispatches on the engine's thread."""
        k = len(reqs)
        ids = [_host_array(r.text_ids).reshape(-1) for r in reqs]
        codes = [_host_array(r.audio_codes) if r.audio_codes is not None and r.audio_codes.numel() else None
                 for r in reqs]
        nts = np.fromiter((a.size for a in ids), dtype=np.int64, count=k)
        ncs = np.fromiter((0 if c is None else c.shape[0] for c in codes), dtype=np.int64, count=k)
        ids_all = np.concatenate(ids).astype(np.int64, copy=False)
        n_text = int(nts.sum())
        x = self.model.embed_text(self._h2d(torch.from_numpy(ids_all)))
        lens = nts + ncs
        req_text = np.repeat(np.arange(k), nts)  # the request of each text position
        spk = [i for i, r in enumerate(reqs) if r.spk_emb is not None]
        if spk:
            want = np.full(k, np.iinfo(np.int64).min, dtype=np.int64)  # no text id matches this
            table_row = np.full(k, -1, dtype=np.int64)
            want[spk] = [reqs[i].spk_emb_id for i in spk]
            table_row[spk] = np.arange(len(spk))
            spk_row = np.where(ids_all == want[req_text], table_row[req_text], -1)
            table = self._h2d(torch.from_numpy(np.stack([_host_array(reqs[i].spk_emb).reshape(-1) for i in spk])))
            row = self._h2d(torch.from_numpy(spk_row))
            x = torch.where((row >= 0).unsqueeze(1), table.to(x.dtype)[row.clamp(min=0)], x)
        parts = [x]
        if ncs.any():
            code_all = np.concatenate([c for c in codes if c is not None]).astype(np.int64, copy=False)
            parts.append(self.model.embed_code(self._h2d(torch.from_numpy(code_all))).to(x.dtype))
        parts.append(x.new_zeros(1, x.shape[1]))
        # each position p of request r: its text at ot[r] + p, then its audio codes at oc[r] + (p - nts[r])
        ot = np.cumsum(nts) - nts
        oc = n_text + np.cumsum(ncs) - ncs
        req = np.repeat(np.arange(k), lens)
        p = _positions(lens)
        rows = np.where(p < nts[req], ot[req] + p, oc[req] + p - nts[req])
        return torch.cat(parts).to(self.compute_dtype), rows, lens

    def _prompt_batch(self, reqs: Sequence[GenRequest], rows: int, t: int, b0: int):
        """The admitted prompts (slots b0..) as one padded batch x [rows, t, hidden], positions [rows, t]
        (-1 = padding) and idx [2, rows] (slot, last prompt position); rows past the prompts are bucket
        padding (all positions -1, slot b0)."""
        flat, at_rows, lens = self._prompt_rows(reqs)
        k = len(reqs)
        at = np.full((rows, t), flat.shape[0] - 1, dtype=np.int64)  # padding points at the zero row
        positions = np.full((rows, t), -1, dtype=np.int64)
        filled = np.arange(t) < lens[:, None]  # [k, t], row-major: request after request, positions in order
        at[:k][filled] = at_rows
        positions[:k][filled] = _positions(lens)
        idx = np.full((2, rows), b0, dtype=np.int64)
        idx[0, :k] += np.arange(k)
        idx[1] = 0
        idx[1, :k] = lens - 1
        return flat[self._h2d(torch.from_numpy(at))], self._h2d(torch.from_numpy(positions)), \
            self._h2d(torch.from_numpy(idx))

    def _packed_batch(self, reqs: Sequence[GenRequest], tokens: int, b0: int):
        """The admitted prompts (slots b0..) packed end to end, no padding between them: x [tokens, hidden],
        positions [tokens] (-1 = padding past the prompts), slots [tokens] (each position's slot; padding: b0)
        and last [len(reqs)] (the row of each prompt's last position). The three index rows and `last` go to
        the device in one copy."""
        flat, at_rows, lens = self._prompt_rows(reqs)
        k, n = len(reqs), int(lens.sum())
        host = np.empty(3 * tokens + k, dtype=np.int64)
        at, positions, slots, last = np.split(host, [tokens, 2 * tokens, 3 * tokens])
        at[:] = flat.shape[0] - 1
        at[:n] = at_rows
        positions[:] = -1
        positions[:n] = _positions(lens)
        slots[:] = b0
        slots[:n] = b0 + np.repeat(np.arange(k), lens)
        last[:] = np.cumsum(lens) - 1
        dev = self._h2d(torch.from_numpy(host))
        return flat[dev[:tokens]], dev[tokens : 2 * tokens], dev[2 * tokens : 3 * tokens], dev[3 * tokens :]

    def packed_prefill_core(self, x: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """The final hidden states [tokens, hidden] (float) of packed prompts (`_packed_batch`), their keys and values
        written to their slots' pages (pure tensor work: CUDA-graph safe). Each position is a row of one decode
        step: it writes its key and value, then reads its own prompt's keys up to itself through its slot's
        block table (`attention.decode_attention`), so a prefill's work follows its prompts' positions, not the
        longest prompt times their count."""
        tables = self.block_table.index_select(0, slots)
        h = self.model(x.unsqueeze(1), positions.unsqueeze(1), tables, self.k_cache, self.v_cache, LEN_STEP)
        return h[:, 0].float()

    # -- decode ---------------------------------------------------------------------------------
    def _host_sync(self, hit: Tensor) -> np.ndarray:
        """A step's (or prefill's) one host sync: its EOS flags on the host. `event_sync` (CUDA, off by default,
        an experiment of bench/probes/stream_codec.py): `to_host`'s wait on an event instead of a blocking copy."""
        if self.event_sync:
            return to_host(hit).numpy()
        return hit.cpu().numpy()

    def step_core(self, start: int, b: int, attn_len: int, mode: str = "code", n_live: Tensor | None = None,
                  groups: list[tuple[str, Tensor]] | None = None) -> Tensor:
        """One decode step of the rows in slots start..start+b-1 (pure tensor work: no host sync,
        CUDA-graph safe). Feeds each row's last token at position prompt_len + n - 1 (both from the
        device state, so a graph replay needs no input), samples the next, records token and hidden
        state. Rows at or past `n_live` are padding: they compute, but their count does not advance.
        mode "mixed" (eager) samples each of `groups` (mode, row indices) with its own head.
        Returns eos_hit [b]."""
        dev = self.device
        st = torch.arange(start, start + b, dtype=torch.int64, device=dev)
        p = self.row_params.select(st)  # a copy: sampling advances the counts (n_dev) in place
        n = p.n
        last_tok = self.tokens[st, (n - 1).clamp(min=0)]
        if mode == "text":
            x = self.model.embed_text(last_tok[:, 0])
        else:
            # a free slot may still hold text-vocabulary ids: keep padding rows' lookups in range
            x = self.model.embed_code(last_tok.clamp(max=self.num_audio_tokens - 1))
            if mode == "mixed":
                x = torch.where(p.text.bool().unsqueeze(1), self.model.embed_text(last_tok[:, 0]), x)
        x = x.to(self.compute_dtype).unsqueeze(1)
        positions = (p.prompt_len + n - 1).unsqueeze(1)
        tables = self.block_table.narrow(0, start, b)
        h = self.model(x, positions, tables, self.k_cache, self.v_cache, attn_len)[:, 0].float()
        if groups is None:
            valid = None if n_live is None else torch.arange(b, device=dev) < n_live
            return self.sample_core(st, p, h, mode, valid)[1]
        hit = torch.zeros(b, dtype=torch.bool, device=dev)
        for m, rows in groups:
            _, hm = self.sample_core(st.index_select(0, rows), p.select(rows), h.index_select(0, rows), m)
            hit.index_copy_(0, rows, hm)
        return hit

    def _sampling_logits(self, st: Tensor, p: Tensor, h: Tensor, mode: str) -> tuple[Tensor, int]:
        """The processed logits [rows × q, vocabulary] of the rows in slots `st` (p: a copy of their `row_params`;
        q: the code rows per request, 1 in text mode), everything upstream does before the draw."""
        b = st.shape[0]
        q = self.num_vq if mode == "code" else 1
        n = p.n
        hc = h.to(self.compute_dtype)
        logits = self.model.logits_code(hc) if mode == "code" else self.model.logits_text(hc).unsqueeze(1)
        logits = logits.reshape(b * q, logits.shape[-1]).float()

        def rep(t: Tensor) -> Tensor:  # per-request value for each of its rows
            return t.repeat_interleave(q)

        w = REPETITION_WINDOW
        offs = (n.unsqueeze(1) - w + torch.arange(w, device=self.device)).clamp(min=0)  # [B, W]
        hist = self.tokens[st.unsqueeze(1), offs][..., :q].permute(0, 2, 1).reshape(b * q, w)
        logits = sampling.process_logits(
            logits,
            rep(p.temperature),
            rep(p.repetition_penalty),
            rep(p.top_p),
            rep(p.top_k),
            hist,
            rep(n.clamp(max=w)),
            rep(n < p.min_new_tokens),
            rep(p.eos),
        )
        return logits, q

    def _record(self, st: Tensor, n: Tensor, tok: Tensor, h: Tensor, keep: Tensor) -> None:
        """The drawn tokens [rows, q] and hidden states at each row's position n; counts advance where `keep`."""
        if tok.shape[1] < self.num_vq:
            tok = tok.expand(tok.shape[0], self.num_vq)
        self.tokens[st, n] = tok
        self.hiddens[st, n] = h.to(self.hiddens.dtype)  # the compute dtype: exact, the model's output in it
        self.n_dev.index_add_(0, st, keep.long())

    def sample_core(self, st: Tensor, p: Tensor, h: Tensor, mode: str, valid: Tensor | None = None):
        """Sample the next token of the rows in slots `st` (p: a copy of their `row_params`); record it."""
        b = st.shape[0]
        logits, q = self._sampling_logits(st, p, h, mode)
        row = torch.arange(q, device=self.device).repeat(b)
        u = sampling.uniform(p.seed.repeat_interleave(q), p.n.repeat_interleave(q), row, p.attempt.repeat_interleave(q))
        tok = sampling.sample(logits, u).view(b, q)
        hit = (tok == p.eos.unsqueeze(1)).any(1)
        self._record(st, p.n, tok, h, ~hit if valid is None else ~hit & valid)
        return tok, hit

    def sample_first(self, st: Tensor, p: Tensor, h: Tensor, mode: str, redraw: Tensor, attempts: int,
                     valid: Tensor | None = None) -> Tensor:
        """The first token of freshly prefilled rows in slots `st` (count 0), with upstream's ensure_non_empty:
        where `redraw` [rows] (bool) a draw that ends the row is drawn again, attempt after attempt, up to
        `attempts` in all. All attempts are drawn at once from the same probabilities (a draw depends on its
        attempt only through its uniform number), so no host sync decides a redraw; the row keeps the first
        attempt that does not end it (or the last), and its later draws use that attempt, as one after the
        other would. Rows where `valid` is False are padding: drawn and recorded, their counts and attempts kept.
        Returns the EOS flags [rows] on the device."""
        b = st.shape[0]
        logits, q = self._sampling_logits(st, p, h, mode)
        a = torch.arange(attempts, device=self.device)
        row = torch.arange(q, device=self.device).repeat(b).unsqueeze(1)
        u = sampling.uniform(p.seed.repeat_interleave(q).unsqueeze(1), p.n.repeat_interleave(q).unsqueeze(1), row,
                             p.attempt.repeat_interleave(q).unsqueeze(1) + a)  # [rows × q, attempts]
        toks = sampling.draw(torch.softmax(logits, dim=-1), u).view(b, q, attempts)
        hits = (toks == p.eos.view(b, 1, 1)).any(1)  # [rows, attempts]
        allowed = torch.where(redraw, attempts, 1)  # attempts each row may use
        ok = ~hits & (a < allowed.unsqueeze(1))
        chosen = torch.where(ok.any(1), ok.to(torch.uint8).argmax(1), allowed - 1)
        tok = toks.gather(2, chosen.view(b, 1, 1).expand(b, q, 1)).squeeze(2)
        hit = hits.gather(1, chosen.unsqueeze(1)).squeeze(1)
        keep = ~hit if valid is None else ~hit & valid
        self.row_params.attempt.index_add_(0, st, chosen if valid is None else chosen * valid)
        self._record(st, p.n, tok, h, keep)
        return hit
