"""Model configurations of the repository, built as `model_config_pb2.ModelConfig` protos.

The single place where tensor names/shapes between the models, batching, instance groups and each model's
parameters are decided (the model names are `config.py`'s);
`python -m chattts_triton.repo_config --repo DIR --gpus 0,1 --instances 2` rewrites them in place
(`make configure`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..config import (
    ADMIT_BATCH,
    ADMIT_WAIT_STEPS,
    ENSEMBLE,
    ENSEMBLE_INPUTS,
    ENSEMBLE_OUTPUTS,
    GIL_SWITCH_INTERVAL_MAX_US,
    GIL_SWITCH_INTERVAL_US,
    GPT,
    LIMITS,
    MANIFEST,
    NUM_VQ,
    PENDING_PER_SLOT,
    PREPROCESS,
    STREAM,
    VOCODER,
    Arch,
)
from ..memory import CPU_SLOTS, GPU_MEMORY_UTILIZATION, MAX_SLOTS
from .params import AUTO, GPTParams, Params, PreprocessParams, StreamParams, VocoderParams

MODELS = (PREPROCESS, GPT, VOCODER)  # the ensemble's steps (they hold the artifacts)

# Contract inputs each composing model takes from the ensemble.
PREPROCESS_FROM_ENSEMBLE = (
    "TEXT", "SPEAKER", "SEED", "PROMPT", "REFINE_TEXT", "REFINE_PROMPT", "REFINE_TEMPERATURE", "REFINE_TOP_P",
    "REFINE_TOP_K", "REFINE_REPETITION_PENALTY", "REFINE_MAX_NEW_TOKENS", "NORMALIZE_TEXT", "SPEAKER_AUDIO",
    "SPEAKER_TEXT", "SPEAKER_SAMPLE", "VOICE",
)
GPT_FROM_ENSEMBLE = (
    "SEED", "TEMPERATURE", "TOP_P", "TOP_K", "REPETITION_PENALTY", "MAX_NEW_TOKENS", "MIN_NEW_TOKENS", "USE_DECODER",
)
VOCODER_FROM_ENSEMBLE = ("USE_DECODER",)

# Tensors between the composing models: name -> (dtype, dims); "H" stands for the GPT hidden size.
PROMPT_TENSORS = {
    "TEXT_IDS": ("TYPE_INT64", [-1]),
    "SPK_EMB": ("TYPE_FP32", [-1]),  # [hidden] or [0] for no speaker embedding
    "AUDIO_PROMPT": ("TYPE_INT64", [-1, NUM_VQ]),  # reference-speaker codes, [0, 4] when none
}
GPT_EXTRA_INPUTS = {"REFINE": ("TYPE_BOOL", [1])}  # text-head generation (refine text, via BLS)
PREPROCESS_OUTPUTS = {**PROMPT_TENSORS, "SPOKEN_TEXT": ENSEMBLE_OUTPUTS["SPOKEN_TEXT"]}  # the ensemble's output
GPT_OUTPUTS = {"CODES": ("TYPE_INT64", [-1, NUM_VQ]), "HIDDENS": ("TYPE_FP32", [-1, "H"])}
VOCODER_OUTPUTS = {"AUDIO": ENSEMBLE_OUTPUTS["AUDIO"]}


@dataclass
class Deployment:
    """What `make configure` changes: where instances run and how many."""

    gpus: List[int] = field(default_factory=list)  # empty: KIND_CPU
    instances: int = 1  # per GPU (or on CPU) for the batching python models
    max_batch_size: int = LIMITS.max_batch_size
    # every Triton queue's bound (None: twice the engines' admission bound, so that no queue refuses a
    # request the engine would take: the only overload answer is the engine's "server busy")
    max_queue_size: Optional[int] = None
    queue_timeout_us: int = 0  # 0: no timeout
    # chattts_vocoder's batching delay (the other models never wait); none: with its CUDA graphs it batches what
    # queued while it worked, and a delay only added latency at low load without raising throughput at high
    # (docs/performance.md)
    max_queue_delay_us: int = 0
    # engine slots per GPT instance and the positions of its paged KV cache (None: on a GPU from its memory,
    # memory.plan; on the CPU 8 slots, a cache of slots × context)
    gpt_slots: Optional[int] = None
    gpt_cache_tokens: Optional[int] = None
    gpt_context: int = 3072  # prompt + generated positions of one request
    gpt_max_pending: Optional[int] = None  # generations running + waiting per GPT engine (None: 4 × slots; 0: no bound)
    gpu_memory_gb: Optional[float] = None  # GPU memory the models plan with, GiB (None: the card's; memory.py)
    gpt_admit_batch: int = ADMIT_BATCH  # config.py: the engine's admission policy
    gpt_admit_wait_steps: int = ADMIT_WAIT_STEPS
    gil_switch_interval_us: int = GIL_SWITCH_INTERVAL_US  # processes hosting an engine (GPT, stream); 0: Python's
    dtype: str = "fp32"
    artifact_format: str = "torchscript"  # torchscript | onnx (decoder/vocoder/DVAE)
    stream_slots: Optional[int] = None  # engine slots of each chattts_stream instance (None: as gpt_slots)
    stream_cache_tokens: Optional[int] = None
    stream_max_pending: Optional[int] = None  # streams in flight per instance before UNAVAILABLE (None: 2 × slots)
    stream_first_chunk_frames: int = 8  # code frames (21.3 ms of audio each) in the first chunk
    stream_chunk_frames: int = 32  # ... in each later chunk (more when generation runs ahead)
    stream_lookahead_frames: int = 0  # context each side of a chunk; 0: exact (codec.stream_lookahead_codes)
    stream_first_lookahead_frames: int = 8  # right context of the first chunk; 0: as the later chunks
    stream_fade_frames: int = 4  # frames cross-faded at each seam (model/chunks.py)
    # GPU: the decode step through torch.compile, which is faster than the TorchScript step served
    # (docs/performance.md) and costs minutes of compiling at start-up. CPU instances run the TorchScript step.
    gpt_compile: bool = True
    # ... and the prefills: faster alone, but served the start-up grew longer than the gain was worth; opt-in
    gpt_compile_prefill: bool = False
    # GPU engines launch each decode step before reading the previous one's EOS flags back, so that the host's
    # bookkeeping overlaps the GPU's step (Engine overlap; CPU engines never: their ops are synchronous)
    gpt_overlap: bool = True
    # chattts_vocoder replays its codec from CUDA graphs (GPU only): one launch per call instead of hundreds
    vocoder_graphs: bool = True
    # chattts_stream's codec on a CUDA stream of its own, so its calls overlap its engine's steps on the GPU
    # instead of queueing with them on the default stream (no gain measured: opt-in)
    stream_codec_stream: bool = False
    # chattts_stream decodes new streams' first chunks in a codec call of their own, ahead of the running
    # streams' chunks (one more codec call per step that starts a stream; its tail latency was worse: opt-in)
    stream_first_chunks_first: bool = False

    @classmethod
    def from_manifest(cls, man: dict) -> "Deployment":
        """The deployment a repository was exported or configured with; one exported before the early
        first chunk keeps its exact chunks, one exported before the compiled step its TorchScript step, one
        exported before the vocoder's graphs its eager vocoder. One written before the paged cache had every
        queue at 256 by default (a burst was refused below the engine's bound): that default becomes the
        engines' bound."""
        dep = dict(man["deployment"])
        if "gpt_cache_tokens" not in dep and dep.get("max_queue_size") == OLD_DEFAULT_QUEUE_SIZE:
            dep["max_queue_size"] = None
        return cls(**{"stream_first_lookahead_frames": 0, "stream_fade_frames": 0, "gpt_compile": False,
                      "vocoder_graphs": False, **dep})

    def stream_schedule(self, arch: Arch) -> Dict[str, int]:
        """`chattts_stream`'s ChunkPlanner arguments (ValueError if refused)."""
        return model_params(self)[STREAM].schedule(arch)

    @property
    def kind(self) -> str:
        return "KIND_GPU" if self.gpus else "KIND_CPU"

    def slots(self, role: str = "gpt") -> Optional[int]:
        """An engine's slots (role "gpt" or "stream"); None: sized from the GPU's memory when it loads."""
        n = self.gpt_slots if role == "gpt" else self.stream_slots
        if n is not None or self.gpus:
            return n
        return CPU_SLOTS[role]

    def cache_tokens(self, role: str = "gpt") -> Optional[int]:
        """Positions of an engine's KV cache; None: on a GPU from its memory, on the CPU slots × context."""
        return self.gpt_cache_tokens if role == "gpt" else self.stream_cache_tokens

    def max_pending(self, role: str = "gpt") -> Optional[int]:
        """An engine's admission bound (running + waiting; 0: none); None: PENDING_PER_SLOT × the slots it sizes."""
        n = self.gpt_max_pending if role == "gpt" else self.stream_max_pending
        if n is not None:
            return n
        slots = self.slots(role)
        return None if slots is None else PENDING_PER_SLOT[role] * slots

    def admission_bound(self, role: str = "gpt") -> int:
        """The most requests the engines of a role (one per GPU) admit together, at any size they may take."""
        n = self.max_pending(role)
        if not n:  # sized at load, or unbounded: as if at the largest batch
            n = PENDING_PER_SLOT[role] * (self.slots(role) or MAX_SLOTS[role])
        return n * max(1, len(self.gpus))

    def queue_size(self, role: str = "gpt") -> int:
        """The Triton queue bound of the models a role's requests pass through."""
        return self.max_queue_size if self.max_queue_size is not None else 2 * self.admission_bound(role)


def _dims(dims, hidden: int) -> List[int]:
    return [hidden if d == "H" else d for d in dims]


def _io(msg_list, specs: Dict[str, tuple], hidden: int, optional: Tuple[str, ...] = (), output=False):
    for name, spec in specs.items():
        t = msg_list.add()
        t.name = name
        t.data_type = mc.DataType.Value(spec[0])
        t.dims.extend(_dims(spec[1], hidden))
        if not output and name in optional:
            t.optional = True


def _contract(names) -> Dict[str, tuple]:
    return {n: ENSEMBLE_INPUTS[n][:2] for n in names}


OLD_DEFAULT_QUEUE_SIZE = 256


def model_params(dep: Deployment) -> Dict[str, Params]:
    """What each python model reads of the deployment (params.py): its settings, and what is worked out for it."""
    engines = dict(instances=max(1, dep.instances), max_new_tokens=LIMITS.max_new_tokens)
    return {
        # an engine told to admit without bound (gpt_max_pending 0) is not bounded in front of it either
        PREPROCESS: PreprocessParams.of(dep, gpt_model=GPT,
                                        max_pending=0 if dep.max_pending("gpt") == 0 else dep.admission_bound("gpt")),
        GPT: GPTParams.of(dep, gpt_slots=dep.slots("gpt"), gpt_max_pending=dep.max_pending("gpt"), **engines),
        VOCODER: VocoderParams.of(dep),
        STREAM: StreamParams.of(dep, stream_slots=dep.slots("stream"), stream_max_pending=dep.max_pending("stream"),
                                **engines),
    }


def _check_engines(dep: Deployment) -> None:
    if dep.gpt_admit_batch < 1 or dep.gpt_admit_wait_steps < 0:
        raise ValueError(f"gpt_admit_batch must be ≥ 1 and gpt_admit_wait_steps ≥ 0, got "
                         f"{dep.gpt_admit_batch} and {dep.gpt_admit_wait_steps}")
    if not 0 <= dep.gil_switch_interval_us <= GIL_SWITCH_INTERVAL_MAX_US:
        raise ValueError(f"gil_switch_interval_us must be in [0, {GIL_SWITCH_INTERVAL_MAX_US}] (0: Python's default), "
                         f"got {dep.gil_switch_interval_us}")


def _python_model(name: str, dep: Deployment, instances: int, gpu: bool, role: str = "gpt") -> mc.ModelConfig:
    if dep.max_queue_delay_us < 0:
        raise ValueError(f"max_queue_delay_us must be ≥ 0, got {dep.max_queue_delay_us}")
    if dep.max_queue_size is not None and dep.max_queue_size < 1:
        raise ValueError(f"max_queue_size must be ≥ 1, got {dep.max_queue_size}")
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=dep.max_batch_size)
    db = cfg.dynamic_batching
    db.max_queue_delay_microseconds = dep.max_queue_delay_us
    db.default_queue_policy.max_queue_size = dep.queue_size(role)
    if dep.queue_timeout_us:
        db.default_queue_policy.timeout_action = mc.ModelQueuePolicy.REJECT
        db.default_queue_policy.default_timeout_microseconds = dep.queue_timeout_us
    g = cfg.instance_group.add()
    g.count = instances
    if gpu and dep.gpus:
        g.kind = mc.ModelInstanceGroup.KIND_GPU
        g.gpus.extend(dep.gpus)
    else:
        g.kind = mc.ModelInstanceGroup.KIND_CPU
    return cfg


def _ragged(cfg: mc.ModelConfig) -> mc.ModelConfig:
    """Let Triton's dynamic batcher put requests of different lengths in one execution. Without it a batch
    holds only requests whose every input has the same shape, and utterances of different lengths (all real
    traffic) reach chattts_vocoder one per execution; the python backend hands a model each request's own
    tensors, so nothing is padded or copied for it."""
    for i in cfg.input:
        i.allow_ragged_batch = any(d == -1 for d in i.dims)
    return cfg


def _write(cfg: mc.ModelConfig, params: Params) -> None:
    for key, text in params.texts().items():
        cfg.parameters[key].string_value = text


def build_configs(arch: Arch, dep: Deployment) -> Dict[str, mc.ModelConfig]:
    h = arch.gpt.hidden
    _check_engines(dep)
    params = model_params(dep)
    params[STREAM].schedule(arch)  # refuse a schedule the model would refuse at load
    optional_contract = tuple(n for n, spec in ENSEMBLE_INPUTS.items() if not spec[2])

    # tokenizer, normaliser, speaker strings and the reference-audio encoder run on the CPU: no GPU
    # process (and no CUDA context's memory) for them
    pre = _python_model(PREPROCESS, dep, max(1, dep.instances) * max(1, len(dep.gpus) or 1), gpu=False)
    _io(pre.input, _contract(PREPROCESS_FROM_ENSEMBLE), h, optional_contract)
    _io(pre.output, PREPROCESS_OUTPUTS, h, output=True)
    _write(pre, params[PREPROCESS])
    # each request is prepared on its own (a thread pool): waiting for a batch buys nothing
    pre.dynamic_batching.max_queue_delay_microseconds = 0

    gpt = _python_model(GPT, dep, 1, gpu=True)  # one engine per device: it batches in flight itself
    # so a request waiting for Triton to form a batch would only wait
    gpt.dynamic_batching.max_queue_delay_microseconds = 0
    _io(gpt.input, PROMPT_TENSORS, h, optional=("SPK_EMB", "AUDIO_PROMPT"))
    _io(gpt.input, _contract(GPT_FROM_ENSEMBLE), h, optional_contract)
    _io(gpt.input, GPT_EXTRA_INPUTS, h, optional=tuple(GPT_EXTRA_INPUTS))
    _io(gpt.output, GPT_OUTPUTS, h, output=True)
    _write(gpt, params[GPT])

    voc = _python_model(VOCODER, dep, max(1, dep.instances), gpu=True)
    _io(voc.input, {"CODES": GPT_OUTPUTS["CODES"], "HIDDENS": GPT_OUTPUTS["HIDDENS"]}, h)
    _io(voc.input, _contract(VOCODER_FROM_ENSEMBLE), h, optional_contract)
    _io(voc.output, VOCODER_OUTPUTS, h, output=True)
    _write(voc, params[VOCODER])

    ens = mc.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=dep.max_batch_size)
    _io(ens.input, {n: s[:2] for n, s in ENSEMBLE_INPUTS.items()}, h, optional_contract)
    _io(ens.output, ENSEMBLE_OUTPUTS, h, output=True)

    def step(model: str, from_ensemble, from_prev: Dict[str, str], outputs: Dict[str, str]):
        s = ens.ensemble_scheduling.step.add()
        s.model_name = model
        s.model_version = -1
        for n in from_ensemble:
            s.input_map[n] = n
        for k, v in from_prev.items():
            s.input_map[k] = v
        for k, v in outputs.items():
            s.output_map[k] = v

    prompt = {n: f"_{n}" for n in PROMPT_TENSORS}
    step(PREPROCESS, PREPROCESS_FROM_ENSEMBLE, {}, {**prompt, "SPOKEN_TEXT": "SPOKEN_TEXT"})
    step(GPT, GPT_FROM_ENSEMBLE, prompt, {n: f"_{n}" for n in GPT_OUTPUTS})
    step(VOCODER, VOCODER_FROM_ENSEMBLE, {n: f"_{n}" for n in GPT_OUTPUTS}, {"AUDIO": "AUDIO"})

    stream = _python_model(STREAM, dep, 1, gpu=True, role="stream")  # one engine per device, like the GPT
    stream.model_transaction_policy.decoupled = True
    stream.dynamic_batching.max_queue_delay_microseconds = 0  # a stream's first chunk must not wait for others
    _io(stream.input, {n: s[:2] for n, s in ENSEMBLE_INPUTS.items()}, h, optional_contract)
    _io(stream.output, ENSEMBLE_OUTPUTS, h, output=True)
    _write(stream, params[STREAM])
    for cfg in (pre, gpt, voc, stream):
        _ragged(cfg)
    return {ENSEMBLE: ens, PREPROCESS: pre, GPT: gpt, VOCODER: voc, STREAM: stream}


def to_pbtxt(cfg: mc.ModelConfig) -> str:
    return "# Generated by chattts_triton.repo_config; edit with `make configure`, not by hand.\n" + text_format.MessageToString(cfg)


def parse_pbtxt(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def write_configs(repo: Path, arch: Arch, dep: Deployment) -> None:
    repo = Path(repo)
    for name, cfg in build_configs(arch, dep).items():
        d = repo / name
        (d / "1").mkdir(parents=True, exist_ok=True)
        (d / "config.pbtxt").write_text(to_pbtxt(cfg), encoding="utf-8")


def read_manifest(repo: Path) -> dict:
    p = Path(repo) / MANIFEST
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: export a repository first (make export)")
    return json.loads(p.read_text(encoding="utf-8"))


def _count_or_auto(text: str):
    if text == AUTO:
        return AUTO
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a count of at least 1 (or auto)")
    return n


def _gib_or_auto(text: str):
    if text == AUTO:
        return AUTO
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of GiB (or auto)")
    return x


def parser() -> argparse.ArgumentParser:
    """`python -m chattts_triton.repo_config`'s flags: each one after --repo and --gpus sets the Deployment field of its name."""
    ap = argparse.ArgumentParser(prog="python -m chattts_triton.repo_config", description="Rewrite instance groups and batching of an exported repository.")
    ap.add_argument("--repo", type=Path, required=True)
    ap.add_argument("--gpus", default="", help="comma-separated GPU ids; empty = CPU")
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--max-batch-size", type=int)
    ap.add_argument("--max-queue-size", type=_count_or_auto,
                    help="every Triton queue's bound (auto, the default: twice what the engines admit)")
    ap.add_argument("--queue-timeout-us", type=int)
    ap.add_argument("--max-queue-delay-us", type=int,
                    help="how long chattts_vocoder waits to form a batch (default 0: it batches what queued while it "
                         "worked; the other models never wait: the GPT and stream models batch in their engines, the "
                         "preprocess model prepares each request on its own)")
    ap.add_argument("--gpt-slots", type=_count_or_auto,
                    help="engine slots per GPT instance (auto, the default: on a GPU from its memory, 8 on the CPU)")
    ap.add_argument("--gpt-cache-tokens", type=_count_or_auto,
                    help="positions of each GPT engine's paged KV cache, all requests together (auto: on a GPU from "
                         "its memory, on the CPU slots × context)")
    ap.add_argument("--gpu-memory-gb", type=_gib_or_auto,
                    help="GPU memory the models plan with, GiB (auto, the default: the card's; less to share a card or to "
                         f"size for a smaller one; they plan within {int(GPU_MEMORY_UTILIZATION * 100)} %% of it)")
    ap.add_argument("--gpt-context", type=int)
    ap.add_argument("--gpt-max-pending", type=int, help="generations running + waiting per GPT engine before UNAVAILABLE (0: no bound)")
    ap.add_argument("--gpt-admit-batch", type=int,
                    help=f"while generating, prefill waiting requests together once this many wait (default {ADMIT_BATCH})")
    ap.add_argument("--gpt-admit-wait-steps", type=int,
                    help=f"... or once the oldest has waited this many decode steps (default {ADMIT_WAIT_STEPS})")
    ap.add_argument("--gil-switch-interval-us", type=int,
                    help=f"the interpreter's switch interval in the processes hosting an engine (default "
                         f"{GIL_SWITCH_INTERVAL_US}; 0: Python's 5000)")
    ap.add_argument("--stream-slots", type=_count_or_auto, help="engine slots of each chattts_stream instance (auto: as --gpt-slots)")
    ap.add_argument("--stream-cache-tokens", type=_count_or_auto, help="positions of each chattts_stream engine's KV cache")
    ap.add_argument("--stream-max-pending", type=int, help="streams in flight per chattts_stream instance before UNAVAILABLE")
    ap.add_argument("--stream-first-chunk-frames", type=int, help="code frames (21.3 ms each) in a stream's first chunk")
    ap.add_argument("--stream-chunk-frames", type=int, help="code frames in later chunks")
    ap.add_argument("--stream-lookahead-frames", type=int, help="context frames each side of a chunk (0: exact)")
    ap.add_argument("--stream-first-lookahead-frames", type=int,
                    help="right context of a stream's first chunk (0: as later chunks, exact by default)")
    ap.add_argument("--stream-fade-frames", type=int, help="frames cross-faded at each chunk seam (0: hard cut)")
    ap.add_argument("--gpt-compile", action=argparse.BooleanOptionalAction, default=None,
                    help="GPU instances run the decode step through torch.compile (default for new exports; each GPU instance compiles for minutes at start-up)")
    ap.add_argument("--gpt-compile-prefill", action=argparse.BooleanOptionalAction, default=None,
                    help="with --gpt-compile: prefills through torch.compile too (dynamic shapes; opt-in: start-up grows longer)")
    ap.add_argument("--gpt-overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="GPU engines overlap the host's bookkeeping of a decode step with the next step (on by default)")
    ap.add_argument("--vocoder-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="GPU chattts_vocoder instances replay the decoder and Vocos from CUDA graphs (groups of up to 16 "
                         "utterances of up to 512 frames, longer ones eagerly; on by default)")
    ap.add_argument("--stream-codec-stream", action=argparse.BooleanOptionalAction, default=None,
                    help="GPU chattts_stream instances decode on a CUDA stream of their own, beside their engine's "
                         "steps (opt-in)")
    ap.add_argument("--stream-first-chunks-first", action=argparse.BooleanOptionalAction, default=None,
                    help="chattts_stream decodes new streams' first chunks in a codec call of their own, ahead of the "
                         "running streams' chunks (opt-in)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    man = read_manifest(a.repo)
    dep = Deployment.from_manifest(man)
    dep.gpus = [int(g) for g in a.gpus.split(",") if g.strip() != ""]
    if a.instances < 1:
        ap.error("--instances must be ≥ 1")
    dep.instances = a.instances
    for f in fields(Deployment):  # each flag is its field's name (--gpt-slots: gpt_slots); unnamed ones are kept
        v = getattr(a, f.name, None)
        if f.name not in ("gpus", "instances") and v is not None:
            setattr(dep, f.name, None if v == AUTO else v)
    try:
        write_configs(a.repo, Arch.from_json(man["arch"]), dep)
    except ValueError as e:
        ap.error(str(e))
    man["deployment"] = asdict(dep)
    (a.repo / MANIFEST).write_text(json.dumps(man, indent=2, ensure_ascii=False), encoding="utf-8")
    print(f"configured {a.repo}: {dep.kind} gpus={dep.gpus or '-'} instances={dep.instances}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
