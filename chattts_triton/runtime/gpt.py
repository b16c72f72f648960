"""`chattts_gpt`: prompt tensors and sampling inputs → codes and hidden states, through the in-flight engine
(`chattts_stream` hosts one too)."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import (
    ADMIT_BATCH,
    ADMIT_WAIT_STEPS,
    AUDIO_EOS,
    CPU_ONLY_PRECISIONS,
    NUM_VQ,
    USE_DECODER_DEFAULT,
    Arch,
    InferCodeParams,
    RefineTextParams,
)
from ..model.gpt import DTYPES, cache_dtype, eager_from_script
from ..model.text import InputError
from .device import check_dtype_supported, check_kv_cache_supported
from .engine import Engine, GenRequest, GenResult, paged_interface
from .inputs import Call, Outputs, Overloaded, Reply, get_bool, sampling_params

log = logging.getLogger(__name__)

EVENT_SYNC_ENV = "CHATTTS_ENGINE_EVENT_SYNC"  # "1": Engine.event_sync (CUDA; an experiment, off by default)


def compile_applies(device: torch.device) -> bool:
    return device.type == "cuda"  # the compiled step runs in the CUDA-graph buckets only


def _release_failed_compile(device: torch.device) -> None:
    import gc

    import torch._dynamo

    torch._dynamo.reset()  # its caches hold the failed engine's tensors
    gc.collect()  # engine <-> graphs and slot cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


class GPTService:
    """Prompt tensors + sampling inputs → codes (and hidden states) through the in-flight engine."""

    def __init__(self, model_path: Path, arch: Arch, device: torch.device, dtype: str, max_slots: int,
                 max_context: int, max_new_tokens: int, text_eos_id: int, spk_emb_id: int, max_pending: int = 0,
                 compile_step: bool = False, admit_batch: int = ADMIT_BATCH, admit_wait_steps: int = ADMIT_WAIT_STEPS,
                 compile_prefill: bool = False, cache_tokens: int | None = None, overlap: bool = True,
                 packed_prefill: bool = True, high_priority: bool = False, gemv: bool = False,
                 gemv_tune: bool = False, kv_cache_dtype: str = "auto"):
        """cache_tokens: positions of the engine's paged KV cache (None: max_slots × max_context).
        packed_prefill: the compiled engine prefills packed prompts (Engine packed_prefill; the TorchScript step
        has no decode kernel). overlap: the engine's host bookkeeping overlaps its next step (Engine overlap; CUDA
        only: nothing to gain where the ops are synchronous). high_priority: the engine's steps on a CUDA stream of
        the highest priority (Engine high_priority). gemv: the compiled step of one row computes its projections as
        reductions of inductor's own (Engine gemv; with compile_step only), gemv_tune: their launch configurations
        tuned at the warm-up (Engine gemv_tune; with gemv only). kv_cache_dtype: config.KV_CACHE_DTYPES ("fp8": GPUs
        of compute capability 8.9 or later, with compile_step only; a step that fails to compile then fails the
        load instead of falling back to the TorchScript step)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if dtype in CPU_ONLY_PRECISIONS and device.type != "cpu":
            raise ValueError(f"dtype {dtype} runs on CPU only; export fp32/fp16/bf16 for GPUs")
        check_dtype_supported(device, dtype)
        check_kv_cache_supported(device, kv_cache_dtype, compile_step and compile_applies(device))
        kv_dtype = cache_dtype(dtype, kv_cache_dtype)
        self.arch = arch
        self.text_eos_id = text_eos_id
        self.spk_emb_id = spk_emb_id
        self.max_new_tokens = max_new_tokens
        # execute() returns at once, so Triton's queue never fills: running + waiting are bounded here (the
        # engine's scheduler says when they reach it: Engine.full; 0: no bound)
        self.max_pending = max_pending
        script = torch.jit.load(str(model_path), map_location=device).eval()
        plain = script
        if not paged_interface(script):  # exported before the paged KV cache: its weights in the eager module
            log.warning("%s was exported before the paged KV cache: serving the eager module built from its weights "
                        "(re-export for the TorchScript step)", model_path)
            plain = eager_from_script(script, arch)

        def start(model, compiled: bool) -> Engine:
            t0 = time.perf_counter()
            engine = Engine(
                model, max_slots=max_slots, max_context=max_context, max_new_tokens=max_new_tokens,
                hidden=arch.gpt.hidden, num_vq=arch.num_vq, device=device, cache_dtype=kv_dtype,
                cache_tokens=cache_tokens,
                compute_dtype=DTYPES[dtype], compile_step=compiled, compile_prefill=compiled and compile_prefill,
                gemv=compiled and gemv,
                gemv_tune=compiled and gemv and gemv_tune,
                packed_prefill=compiled and packed_prefill,
                admit_batch=admit_batch,
                admit_wait_steps=admit_wait_steps,
                max_pending=max_pending,
                overlap=overlap and device.type == "cuda",
                high_priority=high_priority,
            )
            # an experiment switch: a host sync that waits on an event instead of the stream
            # (bench/probes/stream_codec.py)
            engine.event_sync = os.environ.get(EVENT_SYNC_ENV, "") == "1"
            try:
                engine.warm_up(text_eos_id=text_eos_id)  # specialise / compile before the first client
                if compiled and engine.graphs is not None and engine.graphs.failed_decode_buckets():
                    raise RuntimeError("a warm-up bucket could not be compiled and captured (see the log above)")
            except BaseException:
                engine.stop(drain=False, timeout=60)
                raise
            t1 = time.perf_counter()
            try:  # the other buckets a load reaches; not fatal: they would be captured on first use
                if engine.warm_graphs():
                    log.info("GPT engine: %d CUDA graphs captured in %.1f s", len(engine.graphs.graphs),
                             time.perf_counter() - t1)
            except Exception:
                log.exception("capturing the remaining CUDA graphs at start-up failed; they are captured on first use")
            engine.restart_step_gaps()
            log.info("GPT engine warm (%s) in %.1f s", "compiled step" if compiled else "TorchScript",
                     time.perf_counter() - t0)
            return engine

        engine = None
        if compile_step and not compile_applies(device):
            log.info("compile_step is for GPU instances; this %s instance serves the TorchScript step", device.type)
        elif compile_step:
            try:
                engine = start(eager_from_script(script, arch), True)
            except Exception:  # e.g. no C compiler for inductor in the image: serve anyway
                if kv_cache_dtype != "auto":  # ... except where the TorchScript step cannot read the cache
                    raise
                # the text, not exc_info: a record keeping the traceback would keep the failed engine alive
                log.error("compiling the GPT decode step failed; serving the TorchScript step instead\n%s",
                          traceback.format_exc())
            if engine is None:  # the failed engine's KV cache and graphs must not stay allocated beside the next
                _release_failed_compile(device)
        self.engine = engine or start(plain, False)

    def stats(self) -> dict[str, float]:
        """Published as the instance's `chattts_*` gauges (triton/backend.py STAT_HELP)."""
        return self.engine.stats()

    def execute(self, calls: Sequence[Call]) -> None:
        for c in calls:
            try:
                if self.engine.full():
                    raise Overloaded(f"server busy: {self.max_pending} generations in flight, retry later")
                self.engine.submit(self.request(c.inputs, c.reply))
            except Exception as e:  # noqa: BLE001  every failure becomes this request's error
                c.reply(e)

    def request(self, inputs, reply: Reply) -> GenRequest:
        ids_in = inputs.get("TEXT_IDS")
        if ids_in is None:
            raise InputError("TEXT_IDS is required")
        ids_np = np.asarray(ids_in, dtype=np.int64).reshape(-1)  # checked in numpy: cheaper than torch ops here
        if ids_np.size == 0 or ids_np.min() < 0 or ids_np.max() >= self.arch.num_text_tokens:
            raise InputError(f"TEXT_IDS must be a non-empty list of ids in [0, {self.arch.num_text_tokens})")
        ids = torch.from_numpy(ids_np.copy())
        refine = get_bool(inputs, "REFINE", False)
        if refine:
            params = sampling_params(inputs, RefineTextParams, max_new_limit=self.max_new_tokens)
            return GenRequest(ids, params, self._on_done(reply, refine=True), mode="text", eos_id=self.text_eos_id,
                              want_hidden=False)
        params = sampling_params(inputs, InferCodeParams, max_new_limit=self.max_new_tokens)
        emb = inputs.get("SPK_EMB")
        spk_emb = None
        if emb is not None and np.asarray(emb).size:
            e = np.asarray(emb, dtype=np.float32).reshape(-1)
            if e.size != self.arch.gpt.hidden or not np.isfinite(e).all():
                raise InputError(f"SPK_EMB must hold {self.arch.gpt.hidden} finite values")
            spk_emb = torch.from_numpy(e.copy())
        codes = inputs.get("AUDIO_PROMPT")
        audio = None
        if codes is not None and np.asarray(codes).size:
            a = np.asarray(codes, dtype=np.int64).reshape(-1, NUM_VQ)
            if a.min() < 0 or a.max() >= self.arch.num_audio_tokens:
                raise InputError("AUDIO_PROMPT codes out of range")
            audio = torch.from_numpy(a.copy())
        want_hidden = get_bool(inputs, "USE_DECODER", USE_DECODER_DEFAULT)
        return GenRequest(ids, params, self._on_done(reply, refine=False), mode="code", audio_codes=audio,
                          spk_emb=spk_emb, spk_emb_id=self.spk_emb_id, eos_id=AUDIO_EOS, want_hidden=want_hidden)

    def call(self, inputs, timeout: float | None = None) -> Outputs:
        """A blocking in-process request (refine-text for a model that hosts its own engine)."""
        box: list[Any] = []
        done = threading.Event()

        def reply(result) -> None:
            box.append(result)
            done.set()

        req = self.request(inputs, reply)
        self.engine.submit(req)
        if not done.wait(timeout):
            req.cancel()
            raise TimeoutError("generation timed out")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _on_done(self, reply: Reply, refine: bool):
        h = self.arch.gpt.hidden

        def done(res: GenResult) -> None:
            if res.finish_reason in ("cancelled", "error"):
                reply(res.error or RuntimeError(f"generation {res.finish_reason}"))
                return
            toks = res.tokens  # host memory: the engine copies a finished request's tensors
            codes = toks.unsqueeze(-1).expand(-1, NUM_VQ) if refine else toks
            hid = res.hiddens if res.hiddens is not None else torch.zeros(0, h)
            reply({"CODES": codes.numpy().reshape(1, -1, NUM_VQ).astype(np.int64, copy=False),
                   "HIDDENS": hid.numpy().reshape(1, -1, h).astype(np.float32, copy=False)})

        return done

    def close(self) -> None:
        self.engine.stop(drain=True)

