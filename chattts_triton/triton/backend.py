"""The one python-backend adapter every model.py uses.

`make_model(pb_utils, factory)` returns a `TritonPythonModel` class. `pb_utils` is passed in (this
package never imports `triton_python_backend_utils`). The adapter validates the config in
`initialize`, turns each request into a `runtime.inputs.Call`, and answers each request exactly once
through its response sender (default, non-decoupled mode) with COMPLETE_FINAL — so services may
answer later from another thread, which is what lets the GPT engine batch in flight.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..config import (
    DRAIN_FILE_ENV,
    FIRST_CHUNK_BUCKETS_MS,
    GPT,
    INFLIGHT_METRIC,
    MANIFEST,
    PENDING_PER_SLOT,
    PREPROCESS,
    STACKS_SIGNAL,
    VOCODER,
    Arch,
    first_chunk_bucket,
)
from ..memory import VOCODER_BYTES
from ..model.text import InputError
from ..runtime.inputs import Call, Overloaded
from ..runtime.streaming import StreamCall
from .deployment import setting_of
from .params import EngineParams, GPTParams, P, PreprocessParams, StreamParams, VocoderParams

log = logging.getLogger("chattts_triton")


class ModelContext:
    """What a service factory gets: the model's config, its files and where it runs."""

    def __init__(self, args: dict[str, str], pb_utils):
        self.config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.instance_name = args.get("model_instance_name", self.name)
        self.version_dir = Path(args["model_repository"]) / args["model_version"]
        self.repo_dir = Path(args["model_repository"]).parent
        self.instance_kind = args.get("model_instance_kind", "CPU")
        self.device_id = int(args.get("model_instance_device_id", 0) or 0)
        self.pb_utils = pb_utils
        manifest = self.repo_dir / MANIFEST
        if not manifest.is_file():
            raise RuntimeError(f"{manifest} is missing: export the repository with `python -m export`")
        self.manifest = json.loads(manifest.read_text(encoding="utf-8"))
        self.arch = Arch.from_json(self.manifest["arch"])

    @classmethod
    def from_repo(cls, repo: Path, model: str, kind: str = "CPU", device_id: int = 0, **params) -> ModelContext:
        """The context Triton would give `model` of an exported repository, outside Triton
        (tests, benches); `params` override its config parameters."""
        from google.protobuf import json_format

        from .repo_config import parse_pbtxt

        cfg = parse_pbtxt((Path(repo) / model / "config.pbtxt").read_text(encoding="utf-8"))
        for k, v in params.items():
            if k not in cfg.parameters:  # a misspelt key would silently leave the configured value
                raise KeyError(f"{model} has no parameter {k!r} (its parameters: {', '.join(sorted(cfg.parameters))})")
            cfg.parameters[k].string_value = str(v)
        args = {"model_config": json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True)),
                "model_name": model, "model_repository": str(Path(repo) / model), "model_version": "1",
                "model_instance_kind": kind, "model_instance_device_id": str(device_id)}
        return cls(args, pb_utils=None)

    def params(self, schema: type[P]) -> P:
        """The model's parameters (triton/params.py)."""
        return schema.read(self.name, self.config.get("parameters", {}))

    def bls(self, model: str, inputs: dict[str, np.ndarray], outputs) -> dict[str, np.ndarray]:
        """Synchronous call of another model of the server (used for refine-text)."""
        pb = self.pb_utils
        req = pb.InferenceRequest(
            model_name=model,
            inputs=[pb.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()],
            requested_output_names=list(outputs),
        )
        resp = req.exec()
        if resp.has_error():
            err = resp.error()
            if getattr(err, "code", None) and err.code() == pb.TritonError.UNAVAILABLE:
                raise Overloaded(err.message())
            raise InputError(err.message())
        return {n: pb.get_output_tensor_by_name(resp, n).as_numpy() for n in outputs}


def _status(exc: BaseException):
    """(TritonError code attribute, gRPC status name, message) of a service's exception."""
    from ..runtime.streaming import Cancelled

    if isinstance(exc, Overloaded):
        return "UNAVAILABLE", "UNAVAILABLE", str(exc)
    if isinstance(exc, Cancelled):
        return "CANCELLED", "CANCELLED", str(exc)
    if isinstance(exc, (InputError, ValueError)):
        return "INVALID_ARG", "INVALID_ARGUMENT", str(exc)
    log.error("internal error: %r", exc)
    return "INTERNAL", "INTERNAL", f"internal error: {exc}"


def _error(pb_utils, exc: BaseException, name_status: bool = False):
    """The TritonError of `exc`. name_status prefixes the status name: Triton 2.51 delivers a
    decoupled model's error as a message only (gRPC stream and SSE lose the code)."""
    code, name, msg = _status(exc)
    codes = pb_utils.TritonError
    return codes(f"{name}: {msg}" if name_status else msg, getattr(codes, code, codes.UNAVAILABLE))


def _gauge(pb_utils, name: str, description: str, ctx: ModelContext):
    """A custom-metric gauge labelled with the model and its instance (None where the backend lacks
    metrics). The instance label matters: instances of one model are separate processes, and with
    the same labels they would all write one series (seen on Triton 2.51: two vocoder instances, one
    `chattts_inflight_requests` line), so the drain would read one instance's count for all."""
    try:
        family = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.GAUGE)
        return family, family.Metric(labels={"model": ctx.name, "instance": ctx.instance_name})
    except Exception:  # noqa: BLE001  metrics disabled or an older stub: the drain then waits on Triton only
        return None


STATS_PERIOD_S = 0.25  # how often a service's stats() refresh its gauges
# the in-flight gauge follows a change within this (serve's drain polls every 0.2 s): set per request,
# its IPC round trip to the server held the GIL twice per request (py-spy: a third of the stub's main
# thread's GIL time on the CPU), time the engine thread waits for
INFLIGHT_PUBLISH_S = 0.05
STATS_JOIN_S = 10.0  # finalize waits this long for the metrics thread's last publish (a stats read, a gauge IPC)
# a finalize (the drain) still running after this long writes every thread's stack to stderr, the server's log:
# where a drain waits is then on record before Triton's exit timeout kills the stub
FINALIZE_STACKS_S = 20.0
STAT_HELP = {
    "engine_active": "generations running in this instance's engine",
    "engine_waiting": "generations waiting for an engine slot",
    "engine_steps": "decode steps so far (cumulative)",
    "engine_step_rows": "rows (generations) summed over decode steps (cumulative); / engine_steps = mean batch",
    "engine_step_seconds": "wall time in decode steps, host work included (cumulative)",
    "engine_step_device_seconds": "of engine_step_seconds, launch to the step's host sync (the GPU's part, as the host "
                                  "waits for it; the rest is host bookkeeping)",
    "engine_step_gpu_seconds": "CUDA: summed span of the sampled decode steps on the GPU's clock (cumulative; / "
                               "engine_step_gpu_samples = GPU ms per step)",
    "engine_step_gpu_samples": "CUDA: decode steps timed on the GPU's clock (one in 8; cumulative)",
    "engine_step_graph_seconds": "CUDA: the sampled steps replayed from a graph, on events the graph records itself "
                                 "(the replay alone; cumulative; with gpt_overlap only steps whose next step "
                                 "replayed another graph, as the same graph's next replay re-records them)",
    "engine_step_graph_samples": "CUDA: sampled steps timed inside their graph (cumulative)",
    "engine_prefill_seconds": "wall time in prefills (cumulative); with engine_step_seconds, the engine's busy time",
    "engine_prefills": "batched prefills (cumulative)",
    "engine_prefill_rows": "prompts those prefills admitted (cumulative); / engine_prefills = prompts per prefill",
    "engine_step_gaps": "CUDA: decode steps timed from the end of the step before them on the GPU's clock (the "
                        "CPU: the host's), where rows of that one ran on in them (cumulative)",
    "engine_step_gap_seconds": "summed time of those gaps (cumulative; / engine_step_gaps = the running rows' mean "
                               "time per step: a prefill, resume or other process between two steps lengthens it)",
    "engine_step_gap_max_seconds": "the longest of those gaps since the warm-up: the worst stall a running "
                                   "generation met so far",
    "engine_gil_wait_seconds": "summed time of the engine thread to get the GIL back after a time.sleep(0) "
                               "(cumulative; sampled steps; ≈ 0.07 ms each with no wait)",
    "engine_gil_wait_samples": "GIL waits sampled (one decode step in 64; cumulative)",
    "engine_results_pending": "finished generations whose results wait for their consumer (grows if replies are stuck)",
    "engine_slots": "generations this engine runs at once (configured, or sized from the GPU's memory)",
    "engine_kv_pages": "pages of the engine's paged KV cache (16 positions each)",
    "engine_kv_pages_free": "of those, the pages no generation holds",
    "engine_preemptions": "generations suspended to host memory for want of KV pages (cumulative; resumed exactly "
                          "later)",
    "engine_resumes": "suspended generations resumed (cumulative)",
    "engine_cancel_releases": "cancelled generations whose slot the engine gave back (cumulative)",
    "engine_cancel_release_seconds": "summed time from a generation's cancel() to its slot given back (cumulative; / "
                                     "engine_cancel_releases = mean)",
    "engine_cancel_release_max_seconds": "the longest of those releases so far",
    "engine_cancel_release_late": "releases after which more than one decode step had begun since the cancel "
                                  "(cumulative; should stay 0)",
    "gc_pauses": "the garbage collector's collections in this model instance's process since start-up (cumulative; "
                 "start-up's objects are frozen out of its scans)",
    "gc_pause_seconds": "summed time of those collections (cumulative): every thread of the process waits them out",
    "gc_pause_max_seconds": "the longest of those collections so far: a stall of the process's engine between two "
                            "steps",
    "gpu_memory_reserved_bytes": "GPU memory this model instance's process holds through torch's allocator",
    "gpu_memory_peak_reserved_bytes": "the most it held so far",
    "streams": "streams in flight in this instance",
    "stream_first_chunks": "streams whose first chunk was sent (cumulative)",
    "stream_first_tokens_seconds": "summed time from a stream's start to its first tokens reaching the codec "
                                   "(cumulative)",
    "stream_first_chunk_seconds": "summed time from a stream's start to its first chunk sent (cumulative)",
    "stream_chunks": "chunks decoded (cumulative)",
    "stream_codec_calls": "vocoder calls of the codec thread, each for all due windows (cumulative)",
    "stream_codec_seconds": "wall time in those vocoder calls (cumulative)",
    "text_normalized": "TEXTs normalised (NORMALIZE_TEXT on; cumulative)",
    "text_with_removed_chars": "of those, TEXTs the normaliser removed characters from: they are not voiced "
                               "(cumulative; listed in the server's verbose log)",
    "text_removed_chars": "characters the normaliser removed from TEXTs (cumulative)",
    **{first_chunk_bucket(ms): f"streams whose first chunk was sent within {ms} ms of their start (cumulative)"
       for ms in FIRST_CHUNK_BUCKETS_MS},
}


def gpu_memory_stats() -> dict[str, float]:
    """This process's GPU memory through torch's allocator, where it uses a GPU (no CUDA call otherwise)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {"gpu_memory_reserved_bytes": torch.cuda.memory_reserved(),
            "gpu_memory_peak_reserved_bytes": torch.cuda.max_memory_reserved()}


class GCPauses:
    """The garbage collector's pauses in this process (a `gc.callbacks` entry). A collection runs on whichever
    thread triggered it, holding the GIL: the engine's thread waits it out between two steps either way."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.max_seconds = 0.0
        self._t0: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt, self._t0 = time.perf_counter() - self._t0, None
            self.count += 1
            self.seconds += dt
            self.max_seconds = max(self.max_seconds, dt)

    def stats(self) -> dict[str, float]:
        return {"gc_pauses": self.count, "gc_pause_seconds": round(self.seconds, 6),
                "gc_pause_max_seconds": round(self.max_seconds, 6)}


GC_PAUSES = GCPauses()


def freeze_start_up_objects() -> None:
    """Collect once, then move every object alive into the collector's permanent generation, and count its pauses
    from here on (`GC_PAUSES`). After torch.compile and the CUDA graphs' capture a process holds hundreds of thousands
    of objects (compiled graphs, guards, caches) that live as long as it does; each full collection scanned them all, a
    pause of the whole process (0.67 s on a 2-core CPU, `bench.probes.gc_pause`) that running generations met between
    two steps. Frozen, they are never scanned again; what requests allocate later is collected as before. (A frozen
    object that later falls into an unreachable cycle is not freed: start-up's objects live as long as the process.)"""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    if GC_PAUSES not in gc.callbacks:
        gc.callbacks.append(GC_PAUSES)
    log.info("start-up's %d objects frozen out of the garbage collector's scans (%.2f s)", gc.get_freeze_count(),
             time.perf_counter() - t0)


def process_stats() -> dict[str, float]:
    """This process's figures beside its service's: GPU memory, and the collector's pauses once counted."""
    return {**gpu_memory_stats(), **(GC_PAUSES.stats() if GC_PAUSES in gc.callbacks else {})}


class TritonLogHandler(logging.Handler):
    """Records of the `chattts_triton` loggers into Triton's log through the stub's `pb_utils.Logger`: DEBUG as
    verbose (shown with tritonserver --log-verbose 1), INFO, WARNING and ERROR as such."""

    def __init__(self, logger):
        super().__init__(logging.DEBUG)
        self.logger = logger
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            if record.levelno >= logging.ERROR:
                self.logger.log_error(msg)
            elif record.levelno >= logging.WARNING:
                self.logger.log_warn(msg)
            elif record.levelno >= logging.INFO:
                self.logger.log_info(msg)
            else:
                self.logger.log_verbose(msg)
        except Exception:  # noqa: BLE001  logging must never fail a request
            self.handleError(record)


def forward_logs(pb_utils) -> None:
    """Send this package's log records to Triton's log (once per process; a stub without a Logger keeps Python's
    default: warnings and errors on stderr)."""
    logger_cls = getattr(pb_utils, "Logger", None)
    if logger_cls is None or any(isinstance(h, TritonLogHandler) for h in log.handlers):
        return
    log.addHandler(TritonLogHandler(logger_cls))
    log.setLevel(logging.DEBUG)


def _stacks_to_stderr(arm: Callable[..., Any], *args, **kwargs) -> bool:
    """Arm one of faulthandler's dumps of every thread's stack to stderr, the server's log (its C handler needs no
    GIL or IPC: it works while the process's Python threads are stuck). False where the process has no stderr."""
    try:
        arm(*args, file=sys.__stderr__, **kwargs)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no stderr file descriptor
        return False
    return True


def dump_stacks_on_signal() -> bool:
    """Every thread's stack to stderr on STACKS_SIGNAL (the launcher's, to the stubs of a drain that outlasts half
    its exit timeout)."""
    return _stacks_to_stderr(faulthandler.register, STACKS_SIGNAL, all_threads=True)


def make_model(pb_utils, factory: Callable[[ModelContext], Any]):  # noqa: C901  a class, not a function: its methods count in, each of them short
    """A TritonPythonModel class whose work is done by `factory(ctx)`'s service."""

    class TritonPythonModel:
        def initialize(self, args):
            forward_logs(pb_utils)
            dump_stacks_on_signal()
            self.ctx = ModelContext(args, pb_utils)
            self.input_names = frozenset(i["name"] for i in self.ctx.config.get("input", []))
            self.output_names = [o["name"] for o in self.ctx.config.get("output", [])]
            self.service = factory(self.ctx)
            freeze_start_up_objects()
            self.inflight = 0
            self.idle = threading.Condition()
            self.gauge = _gauge(pb_utils, INFLIGHT_METRIC, "requests admitted and not yet answered", self.ctx)
            self.stat_gauges = {}
            self.decoupled = bool(self.ctx.config.get("model_transaction_policy", {}).get("decoupled"))
            self.closed = threading.Event()
            if self._stats():  # e.g. engine slots in use (a cancel shows up here), GPU memory
                self.stat_gauges = {k: _gauge(pb_utils, f"chattts_{k}",
                                              STAT_HELP.get(k, f"{k} of this model instance"), self.ctx)
                                    for k in self._stats()}
            self.publisher = None
            if self.gauge is not None or self.stat_gauges:
                self.publisher = threading.Thread(target=self._publish, name="chattts-metrics", daemon=True)
                self.publisher.start()

        def _publish(self) -> None:
            """The gauges, from this thread only: the in-flight count when it changed (within
            INFLIGHT_PUBLISH_S), the service's stats that changed every STATS_PERIOD_S (each set is
            an IPC round trip to the server, with the GIL held)."""
            published, stats_due, stats_published = None, 0.0, {}
            while not self.closed.wait(INFLIGHT_PUBLISH_S):
                try:
                    n = self.inflight
                    if self.gauge is not None and n != published:
                        self.gauge[1].set(n)
                        published = n
                    now = time.monotonic()
                    if self.stat_gauges and now >= stats_due:
                        stats_due = now + STATS_PERIOD_S
                        for k, v in self._stats().items():
                            g = self.stat_gauges.get(k)
                            if g is not None and stats_published.get(k) != v:
                                g[1].set(v)
                                stats_published[k] = v
                except Exception:
                    log.exception("publishing metrics failed")
                    return

        def _stats(self) -> dict[str, float]:
            stats = self.service.stats() if hasattr(self.service, "stats") else {}
            return {**stats, **process_stats()}

        def _count(self, delta: int) -> None:
            with self.idle:
                self.inflight += delta
                if self.inflight <= 0:
                    self.idle.notify_all()

        def _reply(self, request):
            sender = request.get_response_sender()
            once = threading.Lock()

            def reply(result) -> None:
                if not once.acquire(blocking=False):  # one response per request, whatever a service does
                    return
                try:
                    if isinstance(result, BaseException):
                        resp = pb_utils.InferenceResponse(error=_error(pb_utils, result))
                    else:
                        tensors = [pb_utils.Tensor(n, np.ascontiguousarray(result[n])) for n in self.output_names
                                   if n in result]
                        resp = pb_utils.InferenceResponse(output_tensors=tensors)
                    sender.send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception as e:
                    log.exception("sending a response failed")
                    with contextlib.suppress(Exception):  # the request's sender is gone: nothing more to tell
                        sender.send(pb_utils.InferenceResponse(error=_error(pb_utils, e)),
                                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                finally:
                    self._count(-1)

            return reply

        def _stream(self, request, inputs) -> StreamCall:
            """Decoupled: any number of chunks, then exactly one response flagged final."""
            sender = request.get_response_sender()
            ended = threading.Event()
            lock = threading.Lock()

            def deliver(resp, final: bool) -> None:
                with lock:
                    if ended.is_set():
                        return
                    if final:
                        ended.set()
                try:
                    sender.send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
                except Exception:
                    if not final:
                        raise
                    log.exception("sending the final response failed")
                    with contextlib.suppress(Exception):  # the request's sender is gone: nothing more to tell
                        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                finally:
                    if final:
                        self._count(-1)

            def send(outputs, final: bool) -> None:
                tensors = [pb_utils.Tensor(n, np.ascontiguousarray(outputs[n])) for n in self.output_names
                           if n in outputs]
                deliver(pb_utils.InferenceResponse(output_tensors=tensors), final)

            def fail(exc: BaseException) -> None:
                deliver(pb_utils.InferenceResponse(error=_error(pb_utils, exc, name_status=True)), True)

            def cancelled() -> bool:
                try:
                    return bool(sender.is_cancelled())
                except Exception:  # noqa: BLE001  an older stub: no cancellation
                    return False

            return StreamCall(inputs, send, fail, cancelled)

        def execute(self, requests):
            calls = []
            for request in requests:
                inputs = {}
                # one pass over the request's tensors: get_input_tensor_by_name per configured input
                # built the request's tensor list again for each (GIL time on Triton's thread)
                for t in request.inputs():
                    name = t.name()
                    if name in self.input_names:
                        inputs[name] = t.as_numpy()
                self._count(+1)
                calls.append(self._stream(request, inputs) if self.decoupled else Call(inputs, self._reply(request)))
            self.service.execute(calls)
            return None

        def finalize(self):
            stacks = _stacks_to_stderr(faulthandler.dump_traceback_later, FINALIZE_STACKS_S, exit=False)
            try:
                self._drain()
            finally:
                if stacks:
                    faulthandler.cancel_dump_traceback_later()

        def _drain(self) -> None:
            # every admitted request gets its answer before the model goes away
            close = getattr(self.service, "close", None)
            if close is not None:
                close()
            self.closed.set()
            # joined, not left to die with the stub: a stats read (torch.cuda's memory stats) still running while the
            # process tears CUDA down fails ("driver shutting down") and crashed the stub, so that a SIGTERM'd
            # server exited 1
            if self.publisher is not None:
                self.publisher.join(timeout=STATS_JOIN_S)
            with self.idle:
                self.idle.wait_for(lambda: self.inflight <= 0, timeout=60)

    return TritonPythonModel


# --- the factories the model.py files name -----------------------------------------------------
def preprocess_service(ctx: ModelContext):
    from ..runtime.device import device_for
    from ..runtime.inputs import refine_request
    from ..runtime.preprocess import PreprocessService

    p = ctx.params(PreprocessParams)

    def refine(ids: np.ndarray, params: dict[str, np.ndarray]) -> np.ndarray:
        return ctx.bls(p.gpt_model, refine_request(ids, params), ["CODES"])["CODES"][0, :, 0]

    return PreprocessService(ctx.version_dir, ctx.arch, device_for(ctx.instance_kind, ctx.device_id), p.artifact_format,
                             refine=refine, max_pending=p.max_pending, voice_store=p.voice_store)


def gpt_service(ctx: ModelContext, version_dir: Path | None = None, params: EngineParams | None = None):
    """A GPT engine's service (`params`: chattts_gpt's unless given); its slots and KV cache as configured, or (auto)
    sized from the GPU's memory."""
    from ..runtime.device import device_for, engine_plan, limit_process_memory
    from ..runtime.gpt import GPTService

    p = params or ctx.params(GPTParams)
    set_switch_interval(p.gil_switch_interval_us)
    device = device_for(ctx.instance_kind, ctx.device_id)
    plan = engine_plan(device, ctx.arch, p.dtype, p.ROLE, p.slots, p.cache_tokens, p.gpt_context, p.max_new_tokens,
                       p.gpu_memory_gb, p.instances, p.kv_cache_dtype)
    limit_process_memory(device, plan.bytes + (VOCODER_BYTES if p.ROLE == "stream" else 0), p.gpu_memory_gb)
    return GPTService(
        (version_dir or ctx.version_dir) / "gpt.pt", ctx.arch, device,
        dtype=p.dtype,
        max_slots=plan.slots,
        cache_tokens=plan.cache_tokens,
        max_context=p.gpt_context,
        max_new_tokens=p.max_new_tokens,
        text_eos_id=int(ctx.manifest["tokens"]["text_eos_id"]),
        spk_emb_id=int(ctx.manifest["tokens"]["spk_emb_id"]),
        max_pending=PENDING_PER_SLOT[p.ROLE] * plan.slots if p.max_pending is None else p.max_pending,
        compile_step=p.gpt_compile,
        compile_prefill=p.gpt_compile_prefill,  # with compile_step only
        packed_prefill=p.gpt_packed_prefill,  # with compile_step only
        overlap=p.gpt_overlap,
        high_priority=p.engine_priority,
        admit_batch=p.gpt_admit_batch,
        admit_wait_steps=p.gpt_admit_wait_steps,
        gemv=p.gpt_gemv,  # with compile_step only
        gemv_tune=p.gpt_gemv_tune,  # with gemv only
        kv_cache_dtype=p.kv_cache_dtype,
    )


def set_switch_interval(us: int) -> None:
    """The process's GIL switch interval for an engine's thread (0: leave Python's). Process-wide:
    this process hosts one engine model."""
    why = setting_of("gil_switch_interval_us").bounds_error("gil_switch_interval_us", us)
    if why:  # the bounds repo_config writes within (a hand-edited config)
        raise RuntimeError(f"parameter {why}")
    if us:
        sys.setswitchinterval(us / 1e6)


def vocoder_service(ctx: ModelContext):
    """`chattts_vocoder`: CUDA graphs of the codec as its parameters `vocoder_graphs` and `codec_compile` say."""
    from ..runtime.device import check_dtype_supported, device_for, limit_process_memory
    from ..runtime.vocoder import VocoderService

    p = ctx.params(VocoderParams)
    device = device_for(ctx.instance_kind, ctx.device_id)
    check_dtype_supported(device, p.dtype)
    limit_process_memory(device, VOCODER_BYTES, p.gpu_memory_gb)
    return VocoderService(ctx.version_dir, ctx.arch, device, p.artifact_format, graphs=p.vocoder_graphs,
                          compile_codec=p.codec_compile)


def stream_service(ctx: ModelContext):
    """`chattts_stream`: its own engine; the artifacts are read from the composing models' folders."""
    from ..runtime.device import check_dtype_supported, device_for
    from ..runtime.inputs import refine_request
    from ..runtime.preprocess import PreprocessService
    from ..runtime.streaming import StreamService, omp_threads
    from ..runtime.vocoder import VocoderService

    p = ctx.params(StreamParams)
    schedule = p.schedule(ctx.arch)
    gpt = gpt_service(ctx, ctx.repo_dir / GPT / "1", p)  # its engine thread has made its OpenMP team (warm-up)
    device = device_for(ctx.instance_kind, ctx.device_id)
    # CPU: everything but the engine on one OpenMP thread (loading here, the codec thread, the preprocess threads),
    # so that, as in chattts_gpt, the engine's team is the process's only one (StreamService's side_threads says why)
    side_threads = 1 if device.type == "cpu" else None
    with omp_threads(side_threads):
        pre = PreprocessService(
            ctx.repo_dir / PREPROCESS / "1", ctx.arch, device, p.artifact_format,
            refine=lambda ids, params: gpt.call(refine_request(ids, params))["CODES"][0, :, 0],
            voice_store=p.voice_store,
        )
        check_dtype_supported(device, p.dtype)
        # the stream's codec windows come in a few sizes: always CUDA graphs of them (its memory is
        # within the engine's cap)
        voc = VocoderService(ctx.repo_dir / VOCODER / "1", ctx.arch, device, p.artifact_format, graphs=True,
                             compile_codec=p.codec_compile)
    return StreamService(
        pre, gpt, voc, **schedule,
        max_streams=gpt.max_pending, drain_file=os.environ.get(DRAIN_FILE_ENV, ""),
        codec_stream=p.stream_codec_stream, first_chunks_first=p.stream_first_chunks_first, side_threads=side_threads,
    )
