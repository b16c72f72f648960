"""Export ChatTTS weights into a Triton model repository.

    python -m export --assets DIR --out REPO [--formats torchscript[,onnx]] [--dtype auto|fp32|fp16|bf16|int8]
                     [--device cpu|cuda] [--gpus 0,1] [--instances N] [any setting of `make configure`]
    python -m export --hf --out REPO      # the 2Noise/ChatTTS snapshot, where a network exists

Writes, into a folder beside REPO that is renamed over REPO only when complete:
  chattts/                 ensemble config
  chattts_preprocess/1/    model.py, tokenizer/, dvae_encode.{pt,onnx}
  chattts_gpt/1/           model.py, gpt.pt (TorchScript, paged KV cache)
  chattts_vocoder/1/       model.py, decoder/dvae_decode/vocos.{pt,onnx}
  manifest.json            sha256 of every source file, architecture, dtype, versions, deployment
  voices.json              named voices (chattts_triton.voices): the built-in ones
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from chattts_triton.config import CPU_ONLY_PRECISIONS, ENSEMBLE, GPT, LEXICON, MANIFEST, PREPROCESS, VOCODER, VOICES
from chattts_triton.model.assets import AssetError, check_folder, infer_arch, sha256_files
from chattts_triton.model.gpt import DTYPES
from chattts_triton.runtime.voices import carried_over, write_voices
from chattts_triton.triton import repo_config as rc
from chattts_triton.triton.deployment import ARTIFACT_FORMATS, EXPORT, Deployment, add_flags, from_args

HERE = Path(__file__).resolve().parent
# the repository's model_repository/, or the copy that the installed package (chattts_triton.export) carries beside
# this file (setup.py stages it there)
TEMPLATE = next((d for d in (HERE / "model_repository", HERE.parent / "model_repository") if d.is_dir()),
                HERE.parent / "model_repository")
FORMATS = ARTIFACT_FORMATS


def hf_assets() -> Path:
    """Download (or reuse) the 2Noise/ChatTTS snapshot and return its asset folder."""
    from huggingface_hub import snapshot_download

    path = snapshot_download(repo_id="2Noise/ChatTTS", allow_patterns=["asset/*", "asset/*/*"])
    return Path(path) / "asset"


def resolve_dtype(dtype: str, gpus: list[int], formats: list[str] = (), progress: Callable[[str], None] = print) -> str:
    """`auto`: fp32 for the CPU; for GPUs bf16 where every one listed supports it (Ampere and later) and no ONNX
    artifact is asked for (ONNX convolutions have no bf16), else fp16 (Volta and Turing, e.g. a T4, have no
    bf16), and fp16 when this machine sees none of them (it runs on every CUDA GPU; export on the serving
    machine, or name bf16, for bf16)."""
    if dtype != "auto":
        return dtype
    if not gpus:
        return "fp32"
    if torch.cuda.is_available() and max(gpus) < torch.cuda.device_count():
        caps = {g: torch.cuda.get_device_capability(g) for g in gpus}
        picked = "bf16" if all(c >= (8, 0) for c in caps.values()) and "onnx" not in formats else "fp16"
        progress(f"[export] --dtype auto: {picked} (GPUs {gpus}: compute capability "
                 f"{', '.join('.'.join(map(str, c)) for c in caps.values())}; formats {', '.join(formats)})")
        return picked
    progress(f"[export] --dtype auto: fp16 (GPUs {gpus} are not visible here; fp16 runs on every CUDA GPU; "
             "for bf16 on Ampere or later export where they are, or pass --dtype bf16)")
    return "fp16"


def export_gpt(assets: Path, arch, out_dir: Path, dtype: str, progress: Callable[[str], None]) -> dict:
    from chattts_triton.model.gpt import load_gpt

    t0 = time.perf_counter()
    # int8 keeps q/k/v and gate/up apart: one quantisation scale per projection keeps its accuracy
    model = load_gpt(assets, arch, fused=dtype != "int8").to(DTYPES[dtype])
    if dtype == "int8":  # dynamic int8 linears: a CPU step in about half the fp32 time (docs/performance.md)
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    scripted = torch.jit.script(model)
    path = out_dir / "gpt.pt"
    scripted.save(str(path))
    progress(f"[gpt] gpt.pt: {path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s")
    return {"file": "gpt.pt", "format": "torchscript", "bytes": path.stat().st_size}


def export_repository(
    assets: Path,
    out: Path,
    formats: list[str],
    dtype: str = Deployment.dtype,
    device: str = "cpu",
    deployment: Deployment | None = None,
    progress: Callable[[str], None] = print,
) -> Path:
    from chattts_triton.model.text import TextTokenizer
    from export.codec import export_codecs

    t0 = time.perf_counter()
    assets = check_folder(Path(assets))
    dtype = resolve_dtype(dtype, deployment.gpus if deployment is not None else [], formats, progress)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}")
    if dtype in CPU_ONLY_PRECISIONS and deployment is not None and deployment.gpus:
        raise ValueError(f"--dtype {dtype} runs on CPU only: leave --gpus empty")
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"--formats takes a comma-separated subset of {', '.join(FORMATS)}")
    if "torchscript" not in formats:
        raise ValueError("--formats must include torchscript (the GPT engine and the default repository use it)")
    progress(f"[export] checking {assets}")
    states: dict = {}
    arch = infer_arch(assets, states)
    tok = TextTokenizer(assets / "tokenizer")
    if len(tok) != arch.num_text_tokens:
        raise AssetError(f"tokenizer has {len(tok)} tokens but Embed.safetensors has {arch.num_text_tokens}")
    dep = deployment or Deployment()
    dep.dtype = dtype
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shutil.copytree(TEMPLATE, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        dirs = {m: tmp / m / "1" for m in rc.MODELS}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        (tmp / ENSEMBLE / "1").mkdir(parents=True, exist_ok=True)
        torch_dtype = DTYPES[dtype]
        artifacts = {"gpt": export_gpt(assets, arch, dirs[GPT], dtype, progress)}
        out_dirs = {"decoder": dirs[VOCODER], "dvae_decode": dirs[VOCODER], "vocos": dirs[VOCODER],
                    "dvae_encode": dirs[PREPROCESS]}
        artifacts.update(export_codecs(assets, arch, out_dirs, formats, torch_dtype, device, progress))
        shutil.copytree(assets / "tokenizer", dirs[PREPROCESS] / "tokenizer")
        progress("[export] hashing source files")
        manifest = {
            "source": str(assets),
            "sha256": sha256_files(assets),
            "arch": arch.to_json(),
            "dtype": dtype,
            "formats": list(formats),
            "tokens": {"text_eos_id": tok.eos_id, "spk_emb_id": tok.spk_emb_id, "break_0_id": tok.break_0_id,
                       "vocab_size": len(tok)},
            "artifacts": artifacts,
            "versions": {"torch": torch.__version__, "python": platform.python_version(), **_onnx_versions(formats)},
            "deployment": asdict(dep),
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False), encoding="utf-8")
        # voice="alloy" etc. (chattts_triton.voices); a re-export keeps the voices added to the repository it replaces
        voices, notes = carried_over(out / VOICES, arch.gpt.hidden)
        for note in notes:
            progress(f"[export] {note}")
        write_voices(tmp / VOICES, voices)
        if (out / LEXICON).is_file():  # and its pronunciation lexicon (chattts_triton.lexicon), as it is
            shutil.copy2(out / LEXICON, tmp / LEXICON)
        rc.write_configs(tmp, arch, dep)
        os.chmod(tmp, 0o755)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"[export] wrote {out} in {time.perf_counter() - t0:.0f} s")
    return out


def _onnx_versions(formats) -> dict:
    if "onnx" not in formats:
        return {}
    import onnx
    import onnxruntime

    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Replace `out` by `tmp` so that a reader never sees a half-written repository."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export",
                                 description="Export ChatTTS weights into a Triton model repository.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--assets", type=Path, help="upstream asset folder (Vocos/DVAE/Decoder/Embed.safetensors, gpt/, "
                                                 "tokenizer/)")
    src.add_argument("--hf", action="store_true", help="download the 2Noise/ChatTTS snapshot from Hugging Face")
    ap.add_argument("--out", type=Path, required=True, help="model repository to write")
    ap.add_argument("--formats", default="torchscript",
                    help="artifact formats, comma-separated: torchscript (served), onnx (for --artifact-format onnx "
                         "and "
                         "python -m export.native)")
    ap.add_argument("--device", default="cpu", help="device used to trace/check the export (cpu or cuda)")
    add_flags(ap, EXPORT)  # --dtype, --gpus, --instances, ... (each a Deployment field)
    a = ap.parse_args(argv)
    def log(m):
        print(m, file=sys.stderr, flush=True)
    try:
        assets = hf_assets() if a.hf else a.assets
        formats = [f.strip() for f in a.formats.split(",") if f.strip()]
        if a.artifact_format not in formats:
            ap.error(f"--artifact-format {a.artifact_format} is not among --formats {a.formats}")
        dep = from_args(a)
        export_repository(assets, a.out, formats, a.dtype, a.device, dep, progress=log)
    except (AssetError, ValueError) as e:
        log(f"export failed: {e}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
