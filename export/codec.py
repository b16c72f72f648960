"""Export ChatTTS's audio networks (chattts_triton.model.codec) to TorchScript and ONNX.

    python -m export.codec ASSETS OUT [--names decoder,vocos] [--formats torchscript,onnx] [--dtype float16]

writes OUT/<name>/<name>.pt and OUT/<name>/<name>.onnx for each artifact and prints the manifest.
Each file is checked after writing: reloaded (torch.jit.load / onnxruntime) and run at a batch and
length other than the traced ones, against the eager module.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from chattts_triton.config import N_MELS, NUM_VQ, Arch
from chattts_triton.model.assets import infer_arch, load_safetensors
from chattts_triton.model.codec import (
    CODEC_ASSET_FILES,
    CODEC_INPUTS,
    CODEC_NAMES,
    CODEC_OUTPUTS,
    cast_codec,
    load_codec,
)

ONNX_OPSET = 17
FORMATS = ("torchscript", "onnx")
# Largest |artifact - eager| accepted at export (fp32); for codes, the fraction that may differ.
EXPORT_TOLERANCE = {"decoder": 1e-4, "dvae_decode": 1e-4, "dvae_encode": 0, "vocos": 1e-3}
# ONNX dynamic axis names per input/output.
_DYNAMIC_AXES = {
    "decoder": {"HIDDEN": {0: "batch", 1: "steps"}, "LENGTHS": {0: "batch"}, "MEL": {0: "batch", 2: "mel_frames"}},
    "dvae_decode": {"CODES": {0: "batch", 1: "steps"}, "LENGTHS": {0: "batch"}, "MEL": {0: "batch", 2: "mel_frames"}},
    "dvae_encode": {"AUDIO": {0: "batch", 1: "samples"}, "CODES": {0: "batch", 1: "steps"}},
    "vocos": {"MEL": {0: "batch", 2: "mel_frames"}, "MEL_LENGTHS": {0: "batch"}, "AUDIO": {0: "batch", 1: "samples"}},
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def sample_inputs(name: str, arch: Arch, variant: int = 0, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Small inputs for tracing (variant 0) and for checking another batch/length (variant 1)."""
    g = torch.Generator().manual_seed(seed + variant)
    lengths = [[6, 3], [9, 1, 5]][variant]
    steps = max(lengths)
    lens = torch.tensor(lengths, dtype=torch.int64)
    if name == "decoder":
        return torch.randn(len(lengths), steps, arch.gpt.hidden, generator=g), lens
    if name == "dvae_decode":
        n_codes = 1
        for level in arch.vq_levels:
            n_codes *= level
        return torch.randint(0, n_codes, (len(lengths), steps, NUM_VQ), generator=g), lens
    if name == "vocos":
        mel_lens = lens * 2
        return torch.randn(len(lengths), N_MELS, 2 * steps, generator=g), mel_lens
    if name == "dvae_encode":
        n = [2048, 4000][variant]
        return (0.3 * torch.randn(1, n, generator=g),)
    raise ValueError(f"unknown codec artifact {name!r}")


def _max_error(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| for float outputs; the fraction of differing codes for integer outputs."""
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    if not np.issubdtype(b.dtype, np.floating):
        return float(np.mean(a != b))
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def _ort_session(path: Path, device: str):
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if str(device).startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), providers=providers)


def _spec(name: str) -> dict:
    def fmt(d):
        return {k: {"dtype": dt, "shape": list(shape)} for k, (dt, shape) in d.items()}

    return {"inputs": fmt(CODEC_INPUTS[name]), "outputs": fmt(CODEC_OUTPUTS[name])}


def export_codec(
    name: str,
    module: torch.nn.Module,
    arch: Arch,
    out_dir: Path,
    formats: Sequence[str] = FORMATS,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    reference: torch.nn.Module | None = None,
    progress: Callable[[str], None] = print,
) -> dict:
    """Write one artifact; return its manifest entry (files, shapes, opset, measured errors).

    `dtype` is the one `module` was cast to (fp32 exports must match eager within
    EXPORT_TOLERANCE); `reference` (an fp32 module) adds the error against fp32.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    input_names = list(CODEC_INPUTS[name])
    output_names = list(CODEC_OUTPUTS[name])
    trace_args = tuple(t.to(device) for t in sample_inputs(name, arch, 0))
    check_args = tuple(t.to(device) for t in sample_inputs(name, arch, 1))
    strict = dtype == torch.float32
    with torch.inference_mode():
        expected = module(*check_args).cpu().numpy()
        fp32 = reference(*(t.cpu() for t in check_args)).numpy() if reference is not None else None
    entry = {"name": name, "dtype": str(dtype).replace("torch.", ""), "files": {}, **_spec(name)}
    if fp32 is not None:
        entry["eager_max_error_vs_float32"] = _max_error(expected, fp32)

    def check(fmt: str, got: np.ndarray) -> float:
        err = _max_error(got, expected)
        if strict and not err <= EXPORT_TOLERANCE[name]:
            raise RuntimeError(f"{name} {fmt}: max |artifact - eager| = {err:g} > {EXPORT_TOLERANCE[name]:g}")
        return err

    for fmt in formats:
        t0 = time.perf_counter()
        if fmt == "torchscript":
            path = out_dir / f"{name}.pt"
            scripted = torch.jit.script(module)
            scripted.save(str(path))
            loaded = torch.jit.load(str(path), map_location=device)
            with torch.inference_mode():
                got = loaded(*check_args).cpu().numpy()
            info = {"path": str(path), "bytes": path.stat().st_size, "max_error_vs_eager": check(fmt, got)}
            if fp32 is not None:
                info["max_error_vs_float32"] = _max_error(got, fp32)
        elif fmt == "onnx":
            import onnx

            path = out_dir / f"{name}.onnx"
            with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
                # legacy-exporter deprecation, and tracer notes on the (constant) input-shape checks
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
                torch.onnx.export(
                    module,
                    trace_args,
                    str(path),
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=_DYNAMIC_AXES[name],
                    opset_version=ONNX_OPSET,
                    do_constant_folding=True,
                    dynamo=False,
                )
            onnx.checker.check_model(str(path))
            info = {"path": str(path), "bytes": path.stat().st_size, "opset": ONNX_OPSET, "external_data": False}
            try:
                session = _ort_session(path, device)
            except Exception as e:  # e.g. no fp16 kernel for an op on this machine's providers
                info["onnxruntime"] = f"not verified here: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if strict:
                    raise
            else:
                feeds = {n: t.cpu().numpy() for n, t in zip(input_names, check_args, strict=True)}
                got = session.run(output_names, feeds)[0]
                info["max_error_vs_eager"] = check(fmt, got)
                if fp32 is not None:
                    info["max_error_vs_float32"] = _max_error(got, fp32)
                info["onnxruntime_providers"] = session.get_providers()
        else:
            raise ValueError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")
        info["seconds"] = round(time.perf_counter() - t0, 2)
        entry["files"][fmt] = info
        progress(f"[codec] {name}.{'pt' if fmt == 'torchscript' else 'onnx'}: {info['bytes'] / 1e6:.1f} MB, "
                 f"{info['seconds']} s")
    return entry


def export_codecs(
    assets_dir: Path,
    arch: Arch | None,
    out_dirs: dict[str, Path],
    formats: Sequence[str] = FORMATS,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    progress: Callable[[str], None] = print,
) -> dict:
    """Export each artifact named in `out_dirs` ({"decoder": dir, ...}) into its directory.

    Writes `<name>.pt` (TorchScript, scripted: any batch and length) and `<name>.onnx` (opset 17,
    dynamic batch/length axes, weights inside the file). `arch` None infers it from the assets.
    Reduced `dtype` casts the network weights (see chattts_triton.model.codec.cast_codec); inputs and
    outputs stay fp32/int64. Returns {name: manifest entry}.
    """
    unknown = sorted(set(out_dirs) - set(CODEC_NAMES))
    if unknown:
        raise ValueError(f"unknown codec artifacts {unknown}; expected some of {', '.join(CODEC_NAMES)}")
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; expected some of {', '.join(FORMATS)}")
    if dtype not in _DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; expected one of {', '.join(_DTYPES)}")
    if dtype == torch.bfloat16 and "onnx" in formats:
        raise ValueError("ONNX Conv has no bfloat16 type (opset 17): export bfloat16 as torchscript only, or use "
                         "float16")
    assets_dir = Path(assets_dir)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name in out_dirs:
        file = CODEC_ASSET_FILES[name]
        if file not in states:
            states[file] = load_safetensors(assets_dir / file)
    if arch is None:
        arch = infer_arch(assets_dir, states)
    manifest = {}
    for name, out_dir in out_dirs.items():
        t0 = time.perf_counter()
        module = load_codec(name, assets_dir, arch, states)
        reference = None
        if dtype != torch.float32:
            reference = load_codec(name, assets_dir, arch, states)
            cast_codec(module, dtype)
        module.to(device)
        manifest[name] = export_codec(name, module, arch, out_dir, formats, device, dtype, reference, progress)
        manifest[name]["seconds"] = round(time.perf_counter() - t0, 2)
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.codec", description=__doc__.split("\n\n")[0])
    ap.add_argument("assets", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--names", default=",".join(CODEC_NAMES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    names = [n for n in a.names.split(",") if n]
    manifest = export_codecs(
        a.assets,
        None,
        {n: a.out / n for n in names},
        formats=[f for f in a.formats.split(",") if f],
        dtype=_DTYPES[a.dtype],
        device=a.device,
        progress=lambda m: print(m, file=sys.stderr, flush=True),
    )
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
