"""Read a ChatTTS asset folder (upstream layout) without the ChatTTS package.

Every failure names the file at fault: a missing file, a file that is not valid safetensors/JSON,
or tensor shapes that do not fit one consistent ChatTTS architecture.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..config import Arch, ConvNetDims, GPTDims, VocosDims

ASSET_FILES = (
    "Vocos.safetensors",
    "DVAE.safetensors",
    "Decoder.safetensors",
    "Embed.safetensors",
    "gpt/config.json",
    "gpt/model.safetensors",
    "tokenizer/tokenizer.json",
)


class AssetError(ValueError):
    """The asset folder is incomplete, corrupt, or not a ChatTTS architecture."""


def check_folder(folder: Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise AssetError(f"asset folder {folder} does not exist")
    missing = [f for f in ASSET_FILES if not (folder / f).is_file()]
    if missing:
        raise AssetError(f"asset folder {folder} lacks: {', '.join(missing)}")
    return folder


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise AssetError(f"missing asset file {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AssetError(f"corrupt asset file {path}: {e}") from e


def load_json(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise AssetError(f"missing asset file {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise AssetError(f"corrupt asset file {path}: {e}") from e


def sha256_files(folder: Path) -> dict[str, str]:
    out = {}
    for rel in ASSET_FILES:
        h = hashlib.sha256()
        with open(Path(folder) / rel, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        out[rel] = h.hexdigest()
    return out


def _shape(sd: dict[str, torch.Tensor], key: str, file: str) -> tuple:
    if key not in sd:
        raise AssetError(f"{file}: tensor {key!r} is missing (not a ChatTTS {file})")
    return tuple(sd[key].shape)


def _convnet_dims(sd, prefix: str, file: str) -> ConvNetDims:
    bn, idim, _ = _shape(sd, f"{prefix}conv_in.0.weight", file)
    hidden = _shape(sd, f"{prefix}conv_in.2.weight", file)[0]
    odim = _shape(sd, f"{prefix}conv_out.weight", file)[0]
    n = 0
    while f"{prefix}decoder_block.{n}.dwconv.weight" in sd:
        n += 1
    return ConvNetDims(idim=idim, odim=odim, hidden=hidden, n_layer=n, bn_dim=bn)


def gpt_dims(cfg: dict) -> GPTDims:
    rope = cfg.get("rope_parameters") or {}
    try:
        heads = int(cfg["num_attention_heads"])
        return GPTDims(
            hidden=int(cfg["hidden_size"]),
            intermediate=int(cfg["intermediate_size"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            layers=int(cfg["num_hidden_layers"]),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise AssetError(f"gpt/config.json: not a Llama config ({e})") from e


def infer_arch(folder: Path, states: dict[str, dict[str, torch.Tensor]] | None = None) -> Arch:
    """Derive the architecture from the files and check that all files agree with it."""
    folder = check_folder(folder)
    states = states or {}

    def sd(name):
        if name not in states:
            states[name] = load_safetensors(folder / name)
        return states[name]

    gcfg = load_json(folder / "gpt/config.json")
    if gcfg.get("model_type", "llama") != "llama":
        raise AssetError(f"gpt/config.json: model_type {gcfg.get('model_type')!r}, expected 'llama'")
    g = gpt_dims(gcfg)

    emb = sd("Embed.safetensors")
    n_text, h = _shape(emb, "emb_text.weight", "Embed.safetensors")
    num_vq = 0
    while f"emb_code.{num_vq}.weight" in emb:
        num_vq += 1
    n_audio = _shape(emb, "emb_code.0.weight", "Embed.safetensors")[0] if num_vq else 0
    if h != g.hidden:
        raise AssetError(f"Embed.safetensors: hidden size {h} does not match gpt/config.json hidden_size {g.hidden}")
    if num_vq == 0:
        raise AssetError("Embed.safetensors: no emb_code.* tensors")

    dec = sd("Decoder.safetensors")
    decoder = _convnet_dims(dec, "decoder.", "Decoder.safetensors")
    if 2 * decoder.idim != g.hidden:
        raise AssetError(
            f"Decoder.safetensors: input width {decoder.idim} × 2 does not match the GPT hidden size {g.hidden}"
        )

    dv = sd("DVAE.safetensors")
    dvae_decoder = _convnet_dims(dv, "decoder.", "DVAE.safetensors")
    dvae_encoder = _convnet_dims(dv, "encoder.", "DVAE.safetensors")
    groups = 0
    while f"vq_layer.quantizer.rvqs.{groups}.project_in.weight" in dv:
        groups += 1
    if groups == 0:
        raise AssetError("DVAE.safetensors: no vq_layer.quantizer.rvqs.* tensors (decoder-only file?)")
    cb_dim, group_dim = _shape(dv, "vq_layer.quantizer.rvqs.0.project_in.weight", "DVAE.safetensors")
    levels = (5,) * cb_dim  # FSQ levels are not stored; ChatTTS uses (5, 5, 5, 5)
    if 2 * dvae_decoder.idim != groups * group_dim:
        raise AssetError("DVAE.safetensors: quantizer width does not match the decoder input width")

    vc = sd("Vocos.safetensors")
    vdim, n_mels, _ = _shape(vc, "backbone.embed.weight", "Vocos.safetensors")
    inter = _shape(vc, "backbone.convnext.0.pwconv1.weight", "Vocos.safetensors")[0]
    nl = 0
    while f"backbone.convnext.{nl}.dwconv.weight" in vc:
        nl += 1
    from ..config import N_FFT, N_MELS

    if n_mels != N_MELS or _shape(vc, "head.out.weight", "Vocos.safetensors")[0] != N_FFT + 2:
        raise AssetError(f"Vocos.safetensors: expected {N_MELS} mel bins and n_fft {N_FFT}")

    return Arch(
        gpt=g,
        decoder=decoder,
        dvae_decoder=dvae_decoder,
        dvae_encoder=dvae_encoder,
        vq_dim=groups * group_dim,
        vq_levels=levels,
        vq_groups=groups,
        vq_residual=2,
        vocos=VocosDims(dim=vdim, intermediate=inter, layers=nl),
        num_text_tokens=n_text,
        num_audio_tokens=n_audio,
        num_vq=num_vq,
    )
