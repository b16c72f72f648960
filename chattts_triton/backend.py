"""The one python-backend adapter every model.py uses.

`make_model(pb_utils, factory)` returns a `TritonPythonModel` class. `pb_utils` is passed in (this
package never imports `triton_python_backend_utils`). The adapter validates the config in
`initialize`, turns each request into a `services.Call`, and answers each request exactly once
through its response sender (default, non-decoupled mode) with COMPLETE_FINAL — so services may
answer later from another thread, which is what lets the GPT engine batch in flight.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Dict

import numpy as np

from .config import Arch
from .repo_config import MANIFEST
from .serve import INFLIGHT_METRIC
from .services import Call, Overloaded
from .text import InputError

log = logging.getLogger("chattts_triton")


class ModelContext:
    """What a service factory gets: the model's config, its files and where it runs."""

    def __init__(self, args: Dict[str, str], pb_utils):
        self.config = json.loads(args["model_config"])
        self.name = args["model_name"]
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

    def param(self, key: str, default=None, cast: Callable = str):
        entry = self.config.get("parameters", {}).get(key)
        if entry is None:
            if default is None:
                raise RuntimeError(f"model {self.name}: parameter {key!r} missing from config.pbtxt")
            return default
        try:
            return cast(entry["string_value"])
        except (KeyError, ValueError) as e:
            raise RuntimeError(f"model {self.name}: parameter {key!r} is invalid: {entry}") from e

    def bls(self, model: str, inputs: Dict[str, np.ndarray], outputs) -> Dict[str, np.ndarray]:
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


def _error(pb_utils, exc: BaseException):
    if isinstance(exc, Overloaded):
        return pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
    if isinstance(exc, (InputError, ValueError)):
        return pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
    log.error("internal error: %r", exc)
    return pb_utils.TritonError(f"internal error: {exc}", pb_utils.TritonError.INTERNAL)


def _inflight_gauge(pb_utils, model: str):
    """A custom-metric gauge of this model's in-flight requests (None where the backend lacks metrics)."""
    try:
        family = pb_utils.MetricFamily(name=INFLIGHT_METRIC, description="requests admitted and not yet answered",
                                       kind=pb_utils.MetricFamily.GAUGE)
        return family, family.Metric(labels={"model": model})
    except Exception:  # noqa: BLE001  metrics disabled or an older stub: the drain then waits on Triton only
        return None


def make_model(pb_utils, factory: Callable[[ModelContext], Any]):
    """A TritonPythonModel class whose work is done by `factory(ctx)`'s service."""

    class TritonPythonModel:
        def initialize(self, args):
            self.ctx = ModelContext(args, pb_utils)
            self.input_names = [i["name"] for i in self.ctx.config.get("input", [])]
            self.output_names = [o["name"] for o in self.ctx.config.get("output", [])]
            self.service = factory(self.ctx)
            self.inflight = 0
            self.idle = threading.Condition()
            self.gauge = _inflight_gauge(pb_utils, self.ctx.name)

        def _count(self, delta: int) -> None:
            with self.idle:
                self.inflight += delta
                if self.gauge is not None:
                    self.gauge[1].set(self.inflight)
                self.idle.notify_all()

        def _reply(self, request):
            sender = request.get_response_sender()
            sent = threading.Event()

            def reply(result) -> None:
                if sent.is_set():  # one response per request, whatever a service does
                    return
                sent.set()
                try:
                    if isinstance(result, BaseException):
                        resp = pb_utils.InferenceResponse(error=_error(pb_utils, result))
                    else:
                        tensors = [pb_utils.Tensor(n, np.ascontiguousarray(result[n])) for n in self.output_names if n in result]
                        resp = pb_utils.InferenceResponse(output_tensors=tensors)
                    sender.send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception as e:  # noqa: BLE001  never lose the final flag
                    log.exception("sending a response failed")
                    try:
                        sender.send(pb_utils.InferenceResponse(error=_error(pb_utils, e)),
                                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    except Exception:  # noqa: BLE001
                        pass
                finally:
                    self._count(-1)

            return reply

        def execute(self, requests):
            calls = []
            for request in requests:
                inputs = {}
                for name in self.input_names:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        inputs[name] = t.as_numpy()
                self._count(+1)
                calls.append(Call(inputs, self._reply(request)))
            self.service.execute(calls)
            return None

        def finalize(self):
            # drain: every admitted request gets its answer before the model goes away
            close = getattr(self.service, "close", None)
            if close is not None:
                close()
            with self.idle:
                self.idle.wait_for(lambda: self.inflight <= 0, timeout=60)

    return TritonPythonModel


# --- the factories the model.py files name -----------------------------------------------------
def preprocess_service(ctx: ModelContext):
    from .repo_config import GPT
    from .services import PreprocessService, device_for

    gpt_model = ctx.param("gpt_model", GPT)

    def refine(ids: np.ndarray, params: Dict[str, np.ndarray]) -> np.ndarray:
        inputs = {"TEXT_IDS": ids.reshape(1, -1).astype(np.int64), "REFINE": np.array([[True]])}
        inputs.update({k: np.asarray(v) for k, v in params.items()})
        return ctx.bls(gpt_model, inputs, ["CODES"])["CODES"][0, :, 0]

    return PreprocessService(
        ctx.version_dir, ctx.arch, device_for(ctx.instance_kind, ctx.device_id),
        ctx.param("artifact_format", "torchscript"), refine=refine,
    )


def gpt_service(ctx: ModelContext):
    from .services import GPTService, device_for

    return GPTService(
        ctx.version_dir / "gpt.pt", ctx.arch, device_for(ctx.instance_kind, ctx.device_id),
        dtype=ctx.param("dtype", "fp32"),
        max_slots=ctx.param("max_slots", cast=int),
        max_context=ctx.param("max_context", cast=int),
        max_new_tokens=ctx.param("max_new_tokens", cast=int),
        text_eos_id=int(ctx.manifest["tokens"]["text_eos_id"]),
        spk_emb_id=int(ctx.manifest["tokens"]["spk_emb_id"]),
        max_pending=ctx.param("max_pending", 0, cast=int),
    )


def vocoder_service(ctx: ModelContext):
    from .services import VocoderService, device_for

    return VocoderService(ctx.version_dir, ctx.arch, device_for(ctx.instance_kind, ctx.device_id),
                          ctx.param("artifact_format", "torchscript"))
