"""Model configurations of the repository, built as `model_config_pb2.ModelConfig` protos.

The single place where tensor names/shapes between the models, batching, instance groups and each model's
parameters are decided (the model names are `config.py`'s, the settings `deployment.py`'s `Deployment`);
`python -m chattts_triton.repo_config --repo DIR --gpus 0,1 --instances 2` rewrites them in place
(`make configure`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..config import (
    ENSEMBLE,
    ENSEMBLE_INPUTS,
    ENSEMBLE_OUTPUTS,
    GPT,
    LIMITS,
    MANIFEST,
    NUM_VQ,
    PREPROCESS,
    STREAM,
    VOCODER,
    Arch,
)
from .deployment import CONFIGURE, Deployment, add_flags, from_args
from .params import GPTParams, Params, PreprocessParams, StreamParams, VocoderParams

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


def _dims(dims, hidden: int) -> list[int]:
    return [hidden if d == "H" else d for d in dims]


def _io(msg_list, specs: dict[str, tuple], hidden: int, optional: tuple[str, ...] = (), output=False):
    for name, spec in specs.items():
        t = msg_list.add()
        t.name = name
        t.data_type = mc.DataType.Value(spec[0])
        t.dims.extend(_dims(spec[1], hidden))
        if not output and name in optional:
            t.optional = True


def _contract(names) -> dict[str, tuple]:
    return {n: ENSEMBLE_INPUTS[n][:2] for n in names}


def model_params(dep: Deployment) -> dict[str, Params]:
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


def _python_model(name: str, dep: Deployment, instances: int, gpu: bool, role: str = "gpt") -> mc.ModelConfig:
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


def build_configs(arch: Arch, dep: Deployment) -> dict[str, mc.ModelConfig]:
    h = arch.gpt.hidden
    dep.check()  # every field within its bounds
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

    def step(model: str, from_ensemble, from_prev: dict[str, str], outputs: dict[str, str]):
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
    return ("# Generated by chattts_triton.repo_config; edit with `make configure`, not by hand.\n"
            + text_format.MessageToString(cfg))


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


def parser() -> argparse.ArgumentParser:
    """`python -m chattts_triton.repo_config`'s flags: --repo, and one per Deployment field (deployment.py) but those
    the exported artifacts fix, of the field's name; each omitted one keeps the repository's value, but --gpus and
    --instances."""
    ap = argparse.ArgumentParser(prog="python -m chattts_triton.repo_config",
                                 description="Rewrite instance groups and batching of an exported repository.")
    ap.add_argument("--repo", type=Path, required=True)
    add_flags(ap, CONFIGURE)
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    man = read_manifest(a.repo)
    dep = from_args(a, Deployment.from_manifest(man), CONFIGURE)  # each flag its field's (--gpt-slots: gpt_slots)
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
