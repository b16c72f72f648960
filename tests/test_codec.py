"""Audio networks (chattts_triton.model.codec) and their TorchScript/ONNX exports against upstream ChatTTS.

Every comparison is per item: a padded batch of mixed lengths through our module / artifact must
equal upstream run on each item alone (batch 1, no padding), and padded outputs must be zero.
Padding holds NaN / out-of-range codes, so any leak shows.

Tiny tests use random weights with O(1) layer scales ("strong" weights, derived from the tiny
assets): the synthetic assets keep upstream's 1e-6 ConvNeXt layer-scale init, under which the
blocks are near no-ops and a bug in them would hide below the tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from chattts_triton.config import FULL_ARCH, N_MELS, TINY_ARCH, Arch
from chattts_triton.model.assets import AssetError
from chattts_triton.model.codec import (
    CODEC_ASSET_FILES,
    CODEC_INPUTS,
    CODEC_NAMES,
    CODEC_OUTPUTS,
    MIN_ENCODE_SAMPLES,
    codec_eager_from_script,
    depthwise_as_sum,
    encode_steps,
    load_codec,
    load_codecs,
    vocos_samples,
)
from export.codec import export_codecs

TOL = {"decoder": 1e-4, "dvae_decode": 1e-4, "vocos": 1e-3}
RUNNERS = ("eager", "torchscript", "onnx")
CODEC_FILES = ("Decoder.safetensors", "DVAE.safetensors", "Vocos.safetensors")


# --- weights and upstream modules ----------------------------------------------------------------
def strong_state(state: dict, seed: int) -> dict:
    """Random tensors of the same shapes at O(1) activation scale; mel filterbank and windows kept."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, v in state.items():
        if key.endswith(("mel_scale.fb", "window")):
            out[key] = v
        elif key == "coef":
            out[key] = torch.rand(v.shape, generator=g) + 0.5
        elif v.dim() >= 2:
            gain = 2.0 if key.startswith("head.out") else 1.0  # wide phases, some magnitudes clipped
            out[key] = torch.randn(v.shape, generator=g) * gain / math.sqrt(v[0].numel())
        elif re.search(r"(decoder_block\.\d+\.weight|\.gamma)$", key):  # layer scales
            out[key] = torch.rand(v.shape, generator=g) * 0.7 + 0.3
        elif key.endswith("norm.weight"):
            out[key] = 1 + 0.1 * torch.randn(v.shape, generator=g)
        else:
            out[key] = 0.1 * torch.randn(v.shape, generator=g)
    return out


def make_strong_assets(src: Path, dst: Path, seed: int = 1) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.name in CODEC_FILES:
            save_file(strong_state(load_file(str(entry)), seed), str(dst / entry.name))
            seed += 1
        elif not entry.name.startswith("."):
            (dst / entry.name).symlink_to(entry.resolve())
    return dst


def upstream_modules(folder: Path, arch: Arch) -> dict:
    """Upstream's own classes at `arch`'s widths, loaded from `folder` (as Chat._load does)."""
    from ChatTTS.config import Config
    from ChatTTS.model import DVAE
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    decoder = DVAE(decoder_config=asdict(arch.decoder), dim=arch.decoder.idim)
    dvae = DVAE(
        decoder_config=asdict(arch.dvae_decoder),
        encoder_config=asdict(arch.dvae_encoder),
        vq_config=dict(dim=arch.vq_dim, levels=arch.vq_levels, G=arch.vq_groups, R=arch.vq_residual),
        dim=arch.dvae_decoder.idim,
    )
    cfg = Config()
    backbone = asdict(cfg.vocos.backbone)
    backbone["init_args"].update(
        dim=arch.vocos.dim, intermediate_dim=arch.vocos.intermediate, num_layers=arch.vocos.layers
    )
    head = asdict(cfg.vocos.head)
    head["init_args"].update(dim=arch.vocos.dim)
    vocos = Vocos(
        feature_extractor=instantiate_class(args=(), init=asdict(cfg.vocos.feature_extractor)),
        backbone=instantiate_class(args=(), init=backbone),
        head=instantiate_class(args=(), init=head),
    )
    decoder.load_state_dict(load_file(str(folder / "Decoder.safetensors")))
    dvae.load_state_dict(load_file(str(folder / "DVAE.safetensors")))
    vocos.load_state_dict(load_file(str(folder / "Vocos.safetensors")))
    return {"decoder": decoder.eval(), "dvae": dvae.eval(), "vocos": vocos.eval()}


def upstream_alone(up: dict, name: str, item: np.ndarray) -> np.ndarray:
    """Upstream on one unpadded item, in our layout."""
    x = torch.from_numpy(np.ascontiguousarray(item))
    with torch.inference_mode():
        if name == "decoder":  # item [T, H]
            return up["decoder"](x.T.unsqueeze(0).contiguous())[0].numpy()
        if name == "dvae_decode":  # item [T, 4]
            return up["dvae"](x.T.unsqueeze(0).contiguous(), "decode")[0].numpy()
        if name == "vocos":  # item [100, F]
            return up["vocos"].decode(x.unsqueeze(0))[0].numpy()
        if name == "dvae_encode":  # item [N]
            return up["dvae"].sample_audio(x.clone()).T.numpy().astype(np.int64)  # [T, 4]
    raise AssertionError(name)


# --- runners: eager module, TorchScript file, ONNX file under onnxruntime --------------------------
def make_runners(assets: Path, arch: Arch, out: Path) -> dict:
    import onnxruntime as ort

    manifest = export_codecs(assets, arch, {n: out / n for n in CODEC_NAMES}, progress=lambda m: None)
    eager = load_codecs(assets, arch)
    runners = {}
    for name in CODEC_NAMES:
        script = torch.jit.load(manifest[name]["files"]["torchscript"]["path"])
        session = ort.InferenceSession(manifest[name]["files"]["onnx"]["path"], providers=["CPUExecutionProvider"])
        runners[("eager", name)] = _torch_runner(eager[name])
        runners[("torchscript", name)] = _torch_runner(script)
        runners[("onnx", name)] = _onnx_runner(session, name)
    runners["manifest"] = manifest
    return runners


def _torch_runner(module):
    def run(*arrays):
        with torch.inference_mode():
            return module(*(torch.from_numpy(a) for a in arrays)).numpy()

    return run


def _onnx_runner(session, name):
    def run(*arrays):
        return session.run(list(CODEC_OUTPUTS[name]), dict(zip(CODEC_INPUTS[name], arrays, strict=True)))[0]

    return run


@pytest.fixture(scope="module")
def strong_tiny(tiny_assets, tmp_path_factory) -> Path:
    return make_strong_assets(tiny_assets, tmp_path_factory.mktemp("strong-tiny"))


@pytest.fixture(scope="module")
def tiny_up(strong_tiny):
    return upstream_modules(strong_tiny, TINY_ARCH)


@pytest.fixture(scope="module")
def tiny_run(strong_tiny, tmp_path_factory):
    return make_runners(strong_tiny, TINY_ARCH, tmp_path_factory.mktemp("codec-tiny"))


# --- batch builders -----------------------------------------------------------------------------
def hidden_batch(lengths, hidden: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(lengths), max(lengths), hidden)).astype(np.float32)
    for i, n in enumerate(lengths):
        x[i, n:] = np.nan
    return x


def codes_batch(lengths, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 625, (len(lengths), max(lengths), 4), dtype=np.int64)
    for i, n in enumerate(lengths):
        x[i, n:] = 10**6  # out of range: must not reach the valid region
    return x


def mel_batch(lengths, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(lengths), N_MELS, max(lengths))).astype(np.float32)
    for i, n in enumerate(lengths):
        x[i, :, n:] = np.nan
    return x


def check_batch(run, up, name: str, inputs: np.ndarray, lengths) -> float:
    """Run the padded batch, compare each item to upstream alone; return the max error."""
    out = run(inputs, np.asarray(lengths, dtype=np.int64))
    assert out.dtype == np.float32
    steps = inputs.shape[2] if name == "vocos" else inputs.shape[1]
    if name == "vocos":
        assert out.shape == (len(lengths), vocos_samples(steps))
    else:
        assert out.shape == (len(lengths), N_MELS, 2 * steps)
    worst = 0.0
    for i, n in enumerate(lengths):
        if name == "vocos":
            valid = vocos_samples(n)
            assert not out[i, valid:].any(), "samples past the item's length must be zero"
            if n < 2:
                continue  # upstream's istft fails on one frame; ours gives no samples
            ref = upstream_alone(up, name, inputs[i, :, :n])
            got = out[i, :valid]
        else:
            valid = 2 * n
            assert not out[i, :, valid:].any(), "mel frames past the item's length must be zero"
            if n == 0:
                continue  # upstream cannot run an empty item
            ref = upstream_alone(up, name, inputs[i, :n])
            got = out[i, :, :valid]
        assert got.shape == ref.shape
        err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
        assert err <= TOL[name], f"{name} item {i} (length {n}): max error {err:g}"
        worst = max(worst, err)
    return worst


DECODE_CASES = [[1], [5], [1, 7, 4, 13], [3, 3, 3], [9, 2], [0, 4]]
VOCOS_CASES = [[2], [1], [1, 9, 5, 16], [7, 7], [2, 11, 6]]
ENCODE_SAMPLES = [MIN_ENCODE_SAMPLES, 1000, 256 * 9 + 77, 6001]


# --- tiny: many cases ---------------------------------------------------------------------------
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("lengths", DECODE_CASES, ids=str)
def test_decoder_tiny(tiny_run, tiny_up, runner, lengths):
    x = hidden_batch(lengths, TINY_ARCH.gpt.hidden, seed=sum(lengths))
    check_batch(tiny_run[(runner, "decoder")], tiny_up, "decoder", x, lengths)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("lengths", DECODE_CASES, ids=str)
def test_dvae_decode_tiny(tiny_run, tiny_up, runner, lengths):
    x = codes_batch(lengths, seed=sum(lengths))
    check_batch(tiny_run[(runner, "dvae_decode")], tiny_up, "dvae_decode", x, lengths)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("lengths", VOCOS_CASES, ids=str)
def test_vocos_tiny(tiny_run, tiny_up, runner, lengths):
    x = mel_batch(lengths, seed=sum(lengths))
    check_batch(tiny_run[(runner, "vocos")], tiny_up, "vocos", x, lengths)


@pytest.mark.parametrize("runner", RUNNERS)
def test_dvae_encode_tiny(tiny_run, tiny_up, runner):
    rng = np.random.default_rng(7)
    distinct = set()
    for n in ENCODE_SAMPLES:
        t = np.arange(n) / 24000.0
        wav = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * rng.standard_normal(n)).astype(np.float32)
        codes = tiny_run[(runner, "dvae_encode")](wav[None])
        ref = upstream_alone(tiny_up, "dvae_encode", wav)
        assert codes.dtype == np.int64
        assert codes.shape == (1, encode_steps(n), 4) == (1,) + ref.shape
        np.testing.assert_array_equal(codes[0], ref)
        distinct.update(codes.ravel().tolist())
    assert len(distinct) > 20, "codes too uniform for the test to mean anything"


def test_upstream_batch_leaks_padding(tiny_up, tiny_run):
    """Why LENGTHS exists: upstream's zero-padded batch differs from the item alone (#813), ours not."""
    lengths = [3, 12]
    x = hidden_batch(lengths, TINY_ARCH.gpt.hidden, seed=3)
    padded = np.nan_to_num(x, nan=0.0)
    with torch.inference_mode():
        batched = tiny_up["decoder"](torch.from_numpy(padded).transpose(1, 2).contiguous())[0, :, :6].numpy()
    alone = upstream_alone(tiny_up, "decoder", x[0, :3])
    assert np.max(np.abs(batched - alone)) > 1e-2
    ours = tiny_run[("eager", "decoder")](padded, np.asarray(lengths))
    assert np.max(np.abs(ours[0, :, :6] - alone)) <= TOL["decoder"]


def test_vocos_all_single_frames(tiny_run):
    """Every item one frame: no samples at all, in every runner."""
    x = mel_batch([1, 1], seed=0)
    for runner in RUNNERS:
        assert tiny_run[(runner, "vocos")](x, np.asarray([1, 1])).shape == (2, 0)


def test_export_manifest(tiny_run):
    manifest = tiny_run["manifest"]
    assert set(manifest) == set(CODEC_NAMES)
    for name, entry in manifest.items():
        assert list(entry["inputs"]) == list(CODEC_INPUTS[name])
        assert list(entry["outputs"]) == list(CODEC_OUTPUTS[name])
        onnx_file = entry["files"]["onnx"]
        assert onnx_file["opset"] >= 17 and onnx_file["external_data"] is False
        assert Path(onnx_file["path"]).name == f"{name}.onnx"
        assert Path(entry["files"]["torchscript"]["path"]).name == f"{name}.pt"


# --- bad input ----------------------------------------------------------------------------------
def _copy_assets(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for entry in src.iterdir():
        if not entry.name.startswith("."):
            (dst / entry.name).symlink_to(entry.resolve())
    return dst


@pytest.mark.parametrize("file", CODEC_FILES)
def test_missing_or_corrupt_file_is_named(tiny_assets, tmp_path, file):
    missing = _copy_assets(tiny_assets, tmp_path / "missing")
    (missing / file).unlink()
    corrupt = _copy_assets(tiny_assets, tmp_path / "corrupt")
    (corrupt / file).unlink()
    (corrupt / file).write_bytes((tiny_assets / file).read_bytes()[:1000])
    for folder in (missing, corrupt):
        with pytest.raises(AssetError, match=re.escape(file)):
            load_codecs(folder)
        with pytest.raises(AssetError, match=re.escape(file)):
            load_codecs(folder, TINY_ARCH)
        users = {n: tmp_path / n for n in CODEC_NAMES if CODEC_ASSET_FILES[n] == file}
        with pytest.raises(AssetError, match=re.escape(file)):
            export_codecs(folder, TINY_ARCH, users, progress=lambda m: None)


def test_wrong_architecture_is_named(tiny_assets):
    with pytest.raises(AssetError, match=r"Vocos.safetensors: not the upstream vocos weights \(missing \['convnext.2"):
        load_codec("vocos", tiny_assets, FULL_ARCH)  # full arch: 8 blocks, tiny file: 2
    wide = dataclasses.replace(TINY_ARCH, vocos=dataclasses.replace(TINY_ARCH.vocos, dim=96))
    with pytest.raises(AssetError, match=r"Vocos.safetensors: tensor 'backbone.*has shape"):
        load_codec("vocos", tiny_assets, wide)


@pytest.mark.parametrize("taps,dilation,bias", [(7, 1, True), (7, 2, True), (3, 1, False)])
def test_depthwise_as_sum_equals_the_depthwise_convolution(taps, dilation, bias):
    """What torch.compile traces for a ConvNeXt block's depthwise convolution (a sum of shifted copies) equals the
    convolution, edges (zero padding) included."""
    g = torch.Generator().manual_seed(taps + dilation)
    conv = torch.nn.Conv1d(16, 16, taps, padding=dilation * (taps // 2), dilation=dilation, groups=16, bias=bias)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
    x = torch.randn(3, 16, 23, generator=g)
    with torch.no_grad():
        assert (depthwise_as_sum(x, conv) - conv(x)).abs().max().item() <= 1e-5


def test_codec_modules_from_the_exported_artifacts_hold_their_weights(tiny_assets, tmp_path):
    """codec_eager_from_script (what --codec-compile traces) rebuilds each exported TorchScript codec as the plain
    module with the artifact's own weights and buffers: the same output; an artifact of another architecture or of
    another network is refused by name."""
    paths = {n: tmp_path / n for n in ("decoder", "dvae_decode", "vocos")}
    export_codecs(tiny_assets, TINY_ARCH, paths, formats=("torchscript",), progress=lambda m: None)
    g = torch.Generator().manual_seed(3)
    inputs = {"decoder": (torch.randn(2, 9, TINY_ARCH.gpt.hidden, generator=g), torch.tensor([9, 4])),
              "dvae_decode": (torch.randint(0, 625, (2, 9, 4), generator=g), torch.tensor([9, 4])),
              "vocos": (torch.randn(2, N_MELS, 18, generator=g), torch.tensor([18, 8]))}
    for name, path in paths.items():
        script = torch.jit.load(str(path / f"{name}.pt"))
        eager = codec_eager_from_script(script, name, TINY_ARCH)
        assert not isinstance(eager, torch.jit.ScriptModule)
        with torch.no_grad():
            assert torch.equal(eager(*inputs[name]), script(*inputs[name]))
    with pytest.raises(AssetError, match="vocos artifact does not hold"):
        codec_eager_from_script(torch.jit.load(str(paths["decoder"] / "decoder.pt")), "vocos", TINY_ARCH)
    wide = dataclasses.replace(TINY_ARCH, vocos=dataclasses.replace(TINY_ARCH.vocos, dim=96))
    with pytest.raises(AssetError, match="vocos artifact's .* has shape"):
        codec_eager_from_script(torch.jit.load(str(paths["vocos"] / "vocos.pt")), "vocos", wide)


def test_bad_tensors_raise_value_error(tiny_run):
    eager = {n: tiny_run[("eager", n)] for n in CODEC_NAMES}
    script = {n: tiny_run[("torchscript", n)] for n in CODEC_NAMES}
    bad = [
        ("decoder", (np.zeros((1, 3, 5), np.float32), np.asarray([3]))),  # wrong hidden size
        ("decoder", (np.zeros((2, 3, TINY_ARCH.gpt.hidden), np.float32), np.asarray([3]))),  # lengths/batch
        ("dvae_decode", (np.zeros((1, 3, 3), np.int64), np.asarray([3]))),
        ("vocos", (np.zeros((1, 80, 4), np.float32), np.asarray([4]))),
        ("dvae_encode", (np.zeros((1, MIN_ENCODE_SAMPLES - 1), np.float32),)),
    ]
    for name, args in bad:
        with pytest.raises(ValueError):
            eager[name](*args)
        with pytest.raises(Exception, match="must have shape|needs at least"):
            script[name](*args)
    with pytest.raises(ValueError, match="at least"):
        encode_steps(100)
    with pytest.raises(ValueError, match="unknown codec"):
        export_codecs(Path("."), TINY_ARCH, {"vocoder": Path(".")})
    with pytest.raises(ValueError, match="bfloat16"):
        export_codecs(Path("."), TINY_ARCH, {"vocos": Path(".")}, dtype=torch.bfloat16)


# --- full size: fewer cases ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_up(full_assets):
    return upstream_modules(full_assets, FULL_ARCH)


@pytest.fixture(scope="module")
def full_run(full_assets, tmp_path_factory):
    return make_runners(full_assets, FULL_ARCH, tmp_path_factory.mktemp("codec-full"))


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS)
def test_full_size(full_run, full_up, runner):
    check_batch(full_run[(runner, "decoder")], full_up, "decoder", hidden_batch([1, 6, 3], 768, 1), [1, 6, 3])
    check_batch(full_run[(runner, "dvae_decode")], full_up, "dvae_decode", codes_batch([4, 1, 7], 2), [4, 1, 7])
    check_batch(full_run[(runner, "vocos")], full_up, "vocos", mel_batch([2, 11, 6], 3), [2, 11, 6])
    rng = np.random.default_rng(4)
    for n in (MIN_ENCODE_SAMPLES, 3001):
        wav = (0.3 * rng.standard_normal(n)).astype(np.float32)
        codes = full_run[(runner, "dvae_encode")](wav[None])
        np.testing.assert_array_equal(codes[0], upstream_alone(full_up, "dvae_encode", wav))
