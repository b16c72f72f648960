"""Native-backend models of the audio artifacts, for stock Triton servers without this package.

    python -m export.native --repo REPO [--backend onnxruntime|pytorch] [--gpus 0,1] [--instances N]

adds to an exported repository (python -m export, with --formats torchscript,onnx for the ONNX backend):
  chattts_decoder_native/1/model.{onnx,pt}       HIDDEN [B,T,H] fp32, LENGTHS [B] int64 -> MEL [B,100,2T]
  chattts_dvae_decode_native/1/model.{onnx,pt}   CODES [B,T,4] int64, LENGTHS [B] int64 -> MEL [B,100,2T]
  chattts_vocos_native/1/model.{onnx,pt}         MEL [B,100,F] fp32, MEL_LENGTHS [B] int64 -> AUDIO [B,256(F-1)]

The same tensor names, dtypes and shapes as the artifacts (chattts_triton.model.codec CODEC_INPUTS/CODEC_OUTPUTS).
max_batch_size is 0: each request carries its own batch, padded, with per-item LENGTHS; Triton's batcher
would concatenate requests of different T along dim 0, which these shapes do not allow (no ragged batching).
The pytorch backend binds inputs by position when config names are neither forward() argument names nor
<name>__<index>: the inputs are listed in forward() order (HIDDEN, LENGTHS = hidden, lengths).

The python-backend models of the repository are left as they are; `make configure` does not touch these
models (their instance groups are set here). A re-export replaces the repository: run this again after it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from chattts_triton.config import MANIFEST, VOCODER, Arch
from chattts_triton.model.codec import CODEC_INPUTS, CODEC_OUTPUTS
from chattts_triton.triton import repo_config as rc

NATIVE_MODELS = {
    "decoder": "chattts_decoder_native",
    "dvae_decode": "chattts_dvae_decode_native",
    "vocos": "chattts_vocos_native",
}
BACKENDS = ("onnxruntime", "pytorch")
ARTIFACT_SUFFIX = {"onnxruntime": ".onnx", "pytorch": ".pt"}
MODEL_FILE = {"onnxruntime": "model.onnx", "pytorch": "model.pt"}
TRITON_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "int64": "TYPE_INT64", "int32": "TYPE_INT32"}
MANIFEST_KEY = "native"


class NativeExportError(ValueError):
    """The repository or the arguments cannot give native models (the message says why)."""


def artifact_dir(repo: Path) -> Path:
    """Where `python -m export` puts decoder/dvae_decode/vocos."""
    return Path(repo) / VOCODER / "1"


def config_dims(shape: Sequence, arch: Arch) -> list[int]:
    """Triton dims of an artifact shape: symbolic sizes are -1, H is the GPT hidden size."""
    dims = []
    for d in shape:
        if isinstance(d, int):
            dims.append(d)
        elif d == "H":
            dims.append(arch.gpt.hidden)
        else:
            dims.append(-1)
    return dims


def build_native_config(
    name: str, arch: Arch, backend: str, gpus: Sequence[int] = (), instances: int = 1
) -> mc.ModelConfig:
    """The ModelConfig of artifact `name` (decoder, dvae_decode, vocos) for `backend`."""
    if name not in NATIVE_MODELS:
        raise NativeExportError(f"no native model for {name!r}; expected one of {', '.join(NATIVE_MODELS)}")
    if backend not in BACKENDS:
        raise NativeExportError(f"--backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if instances < 1:
        raise NativeExportError(f"--instances must be >= 1, got {instances}")
    cfg = mc.ModelConfig(name=NATIVE_MODELS[name], max_batch_size=0, default_model_filename=MODEL_FILE[backend])
    if backend == "onnxruntime":
        cfg.platform = "onnxruntime_onnx"
    else:
        cfg.backend = "pytorch"
        # Shapes change with every request: the profiling executor would re-optimise for each new one.
        cfg.parameters["DISABLE_OPTIMIZED_EXECUTION"].string_value = "true"
        cfg.parameters["INFERENCE_MODE"].string_value = "true"
    for specs, target in ((CODEC_INPUTS[name], cfg.input), (CODEC_OUTPUTS[name], cfg.output)):
        for tensor, (dtype, shape) in specs.items():  # insertion order = forward() order
            t = target.add()
            t.name = tensor
            t.data_type = mc.DataType.Value(TRITON_DTYPES[dtype])
            t.dims.extend(config_dims(shape, arch))
    g = cfg.instance_group.add()
    g.count = instances
    if gpus:
        g.kind = mc.ModelInstanceGroup.KIND_GPU
        g.gpus.extend(gpus)
    else:
        g.kind = mc.ModelInstanceGroup.KIND_CPU
    return cfg


def _place(src: Path, dst: Path) -> None:
    """Hard link (the artifacts are written once) or, across file systems, copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def add_native_models(
    repo: Path,
    backend: str = "onnxruntime",
    gpus: Sequence[int] | None = None,
    instances: int | None = None,
) -> dict[str, Path]:
    """Write the native models into `repo`; return {artifact name: model directory}.

    `gpus`/`instances` default to the repository's deployment (manifest.json, as `make configure` left it).
    Re-running replaces earlier native models, whichever backend they had.
    """
    repo = Path(repo)
    if backend not in BACKENDS:
        raise NativeExportError(f"--backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    manifest = rc.read_manifest(repo)
    arch = Arch.from_json(manifest["arch"])
    dep = manifest.get("deployment", {})
    gpus = list(dep.get("gpus", []) if gpus is None else gpus)
    instances = int(dep.get("instances", 1) if instances is None else instances)
    suffix = ARTIFACT_SUFFIX[backend]
    sources = {name: artifact_dir(repo) / f"{name}{suffix}" for name in NATIVE_MODELS}
    missing = [str(p) for p in sources.values() if not p.is_file()]
    if missing:
        fmt = "onnx" if backend == "onnxruntime" else "torchscript"
        raise NativeExportError(
            f"{repo} has no {fmt} artifacts ({', '.join(missing)} missing): export with "
            f"`python -m export --formats torchscript,onnx` or pick the other --backend"
        )
    written: dict[str, Path] = {}
    for name, model in NATIVE_MODELS.items():
        cfg = build_native_config(name, arch, backend, gpus, instances)
        final = repo / model
        tmp = Path(tempfile.mkdtemp(prefix=f".{model}.", dir=repo))
        try:
            (tmp / "1").mkdir()
            _place(sources[name], tmp / "1" / MODEL_FILE[backend])
            (tmp / "config.pbtxt").write_text(
                "# Generated by export.native; re-run `python -m export.native`, do not edit.\n"
                + text_format.MessageToString(cfg),
                encoding="utf-8",
            )
            os.chmod(tmp, 0o755)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        written[name] = final
    manifest[MANIFEST_KEY] = {
        "backend": backend,
        "models": {name: NATIVE_MODELS[name] for name in NATIVE_MODELS},
        "gpus": gpus,
        "instances": instances,
    }
    (repo / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False), encoding="utf-8")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.native", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="an exported repository (python -m export)")
    ap.add_argument("--backend", choices=BACKENDS, default="onnxruntime")
    ap.add_argument("--gpus", default=None, help="comma-separated GPU ids, empty = CPU (default: the repository's)")
    ap.add_argument("--instances", type=int, default=None, help="instances per model (default: the repository's)")
    a = ap.parse_args(argv)
    try:
        gpus = None if a.gpus is None else [int(g) for g in a.gpus.split(",") if g.strip()]
    except ValueError:
        ap.error(f"--gpus takes comma-separated integers, not {a.gpus!r}")
    try:
        written = add_native_models(a.repo, a.backend, gpus, a.instances)
    except (NativeExportError, FileNotFoundError) as e:
        print(f"export.native: {e}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"[native] {name}: {path} ({a.backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
