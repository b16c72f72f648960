"""export.native: native-backend (onnxruntime / pytorch) models of the decoder, DVAE decode and Vocos artifacts.

Only the python backend runs here, so the configs are checked offline: they parse as ModelConfig protos, their
tensor names, dtypes and dims equal the artifact contract, the ONNX graphs and the TorchScript forward()
signatures, and the ONNX models, fed by the names and dtypes the configs give, compute what the TorchScript
artifacts compute. Not run here: a stock tritonserver loading them with its onnxruntime/pytorch backends.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from tritonclient.grpc import model_config_pb2 as mc

from chattts_triton.config import ENSEMBLE, MANIFEST, Arch
from chattts_triton.model.codec import CODEC_INPUTS, CODEC_OUTPUTS
from chattts_triton.triton import repo_config as rc
from export.codec import EXPORT_TOLERANCE, sample_inputs
from export.native import (
    BACKENDS,
    MODEL_FILE,
    NATIVE_MODELS,
    NativeExportError,
    add_native_models,
    artifact_dir,
    build_native_config,
    main,
)

ONNX_TO_TRITON = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.INT64: "TYPE_INT64"}
TRITON_TO_NUMPY = {"TYPE_FP32": np.float32, "TYPE_INT64": np.int64}


def _copy(repo: Path, dst: Path) -> Path:
    # Never touch the session's tiny_repo: the e2e tests serve it with a python-backend-only server.
    shutil.copytree(repo, dst, symlinks=True)
    return dst


def _arch(repo: Path) -> Arch:
    return Arch.from_json(rc.read_manifest(repo)["arch"])


def _config(repo: Path, name: str) -> mc.ModelConfig:
    return rc.parse_pbtxt((repo / NATIVE_MODELS[name] / "config.pbtxt").read_text(encoding="utf-8"))


def _dtype(t) -> str:
    return mc.DataType.Name(t.data_type)


@pytest.fixture(scope="module", params=BACKENDS)
def native_repo(request, tiny_repo, tmp_path_factory) -> tuple:
    repo = _copy(tiny_repo, tmp_path_factory.mktemp(f"native-{request.param}") / "repo")
    add_native_models(repo, backend=request.param)
    return repo, request.param


def test_configs_parse_and_follow_the_artifact_contract(native_repo):
    repo, backend = native_repo
    arch = _arch(repo)
    for name, model in NATIVE_MODELS.items():
        cfg = _config(repo, name)
        assert cfg.name == model
        assert cfg.max_batch_size == 0  # explicit batch dim + LENGTHS in every request
        if backend == "onnxruntime":
            assert (cfg.platform, cfg.backend) == ("onnxruntime_onnx", "")
        else:
            assert (cfg.platform, cfg.backend) == ("", "pytorch")
        assert cfg.default_model_filename == MODEL_FILE[backend]
        assert (repo / model / "1" / MODEL_FILE[backend]).is_file()
        for got, spec in ((cfg.input, CODEC_INPUTS[name]), (cfg.output, CODEC_OUTPUTS[name])):
            assert [t.name for t in got] == list(spec)  # same order as forward()
            for t in got:
                np_dtype, shape = spec[t.name]
                assert TRITON_TO_NUMPY[_dtype(t)] == np.dtype(np_dtype).type
                assert len(t.dims) == len(shape)  # max_batch_size 0: full shape, batch dim included
                for d, s in zip(t.dims, shape, strict=True):
                    want = s if isinstance(s, int) else (arch.gpt.hidden if s == "H" else -1)
                    assert d == want, (model, t.name, list(t.dims), shape)
        # HIDDEN carries the GPT hidden size; the mel axis is fixed at 100
        if name == "decoder":
            assert list(cfg.input[0].dims) == [-1, -1, arch.gpt.hidden]
        assert len(cfg.instance_group) == 1 and cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


@pytest.mark.parametrize("native_repo", ["onnxruntime"], indirect=True)
def test_onnx_configs_equal_the_onnx_graphs(native_repo):
    repo, _ = native_repo
    for name in NATIVE_MODELS:
        cfg = _config(repo, name)
        graph = onnx.load(str(repo / NATIVE_MODELS[name] / "1" / "model.onnx"), load_external_data=False).graph
        for tensors, values in ((cfg.input, graph.input), (cfg.output, graph.output)):
            assert [t.name for t in tensors] == [v.name for v in values]
            for t, v in zip(tensors, values, strict=True):
                tt = v.type.tensor_type
                assert ONNX_TO_TRITON[tt.elem_type] == _dtype(t), (name, t.name)
                dims = tt.shape.dim
                assert len(dims) == len(t.dims)
                for cd, gd in zip(t.dims, dims, strict=True):
                    if gd.HasField("dim_value"):
                        assert cd == gd.dim_value, (name, t.name)
                    else:
                        assert cd == -1 and gd.dim_param, (name, t.name)  # dynamic axis in the graph


def _pytorch_naming_convention(cfg: mc.ModelConfig, forward_args) -> str:
    """The input-binding rule of Triton's pytorch backend (GetNamingConvention in its model_instance_state.cc)."""
    names = [t.name for t in cfg.input]
    if all(n in forward_args for n in names):
        return "FORWARD_ARGUMENT"
    for n in names:
        if "__" not in n or not n.split("__", 1)[1].isdigit():
            return "STRICT_CONFIG_ORDERING"
    return "NAMED_INDEX"


@pytest.mark.parametrize("native_repo", ["pytorch"], indirect=True)
def test_pytorch_configs_bind_forward_arguments_in_order(native_repo):
    repo, _ = native_repo
    for name in NATIVE_MODELS:
        cfg = _config(repo, name)
        model = torch.jit.load(str(repo / NATIVE_MODELS[name] / "1" / "model.pt"))
        args = [a.name for a in model.forward.schema.arguments[1:]]  # drop self
        assert len(model.forward.schema.returns) == len(cfg.output) == 1
        # Contract names are neither forward() argument names nor <name>__<index>: the backend binds the
        # config inputs by position, so their order must be forward()'s (HIDDEN->hidden, LENGTHS->lengths).
        assert _pytorch_naming_convention(cfg, args) == "STRICT_CONFIG_ORDERING"
        assert [t.name.lower() for t in cfg.input] == args, (name, args)


def _feeds_from_config(cfg: mc.ModelConfig, tensors) -> dict:
    """Arrays keyed by the config's input names, checked against the config's dtypes and dims."""
    feeds = {}
    assert len(tensors) == len(cfg.input)
    for t, x in zip(cfg.input, tensors, strict=True):
        a = x.numpy()
        assert a.dtype == TRITON_TO_NUMPY[_dtype(t)], (t.name, a.dtype)
        assert (a.ndim == len(t.dims) and all(d in (-1, s)
                                              for d, s in zip(t.dims, a.shape, strict=True))), (t.name, a.shape)
        feeds[t.name] = a
    return feeds


@pytest.mark.parametrize("variant", [0, 1])  # two batch sizes / length patterns: dynamic dims really dynamic
def test_onnx_models_fed_by_config_equal_torchscript_artifacts(tiny_repo, native_repo, variant):
    import onnxruntime as ort

    repo, backend = native_repo
    arch = _arch(repo)
    for name in NATIVE_MODELS:
        inputs = sample_inputs(name, arch, variant=variant, seed=11)
        with torch.inference_mode():
            want = torch.jit.load(str(artifact_dir(tiny_repo) / f"{name}.pt"))(*inputs).numpy()
        cfg = _config(repo, name)
        feeds = _feeds_from_config(cfg, inputs)
        model_file = repo / NATIVE_MODELS[name] / "1" / MODEL_FILE[backend]
        if backend == "onnxruntime":
            sess = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
            (got,) = sess.run([t.name for t in cfg.output], feeds)
        else:  # positional, in config order: how the pytorch backend binds them
            with torch.inference_mode():
                got = torch.jit.load(str(model_file))(*(torch.from_numpy(feeds[t.name]) for t in cfg.input)).numpy()
        out = cfg.output[0]
        assert got.dtype == TRITON_TO_NUMPY[_dtype(out)] and got.ndim == len(out.dims)
        assert all(d in (-1, s) for d, s in zip(out.dims, got.shape, strict=True))
        assert got.shape == want.shape, name
        err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
        assert err <= EXPORT_TOLERANCE[name], (name, backend, err)


def test_native_files_are_the_artifacts(native_repo):
    repo, backend = native_repo
    suffix = ".onnx" if backend == "onnxruntime" else ".pt"
    for name, model in NATIVE_MODELS.items():
        got = (repo / model / "1" / MODEL_FILE[backend]).read_bytes()
        assert got == (artifact_dir(repo) / f"{name}{suffix}").read_bytes()


def test_rerun_switches_backend_and_leaves_python_models_alone(tiny_repo, tmp_path):
    repo = _copy(tiny_repo, tmp_path / "repo")
    before = {m: (repo / m / "config.pbtxt").read_bytes() for m in (ENSEMBLE, *rc.MODELS)}
    add_native_models(repo, backend="onnxruntime")
    add_native_models(repo, backend="pytorch")
    for model in NATIVE_MODELS.values():
        files = sorted(p.name for p in (repo / model / "1").iterdir())
        assert files == ["model.pt"]
        assert _config(repo, next(k for k, v in NATIVE_MODELS.items() if v == model)).backend == "pytorch"
    assert {m: (repo / m / "config.pbtxt").read_bytes() for m in before} == before
    man = json.loads((repo / MANIFEST).read_text())
    assert man["native"]["backend"] == "pytorch"
    assert man["arch"] == json.loads((tiny_repo / MANIFEST).read_text())["arch"]
    assert not [p for p in repo.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_instance_groups_follow_the_repository_deployment(tiny_repo, tmp_path):
    repo = _copy(tiny_repo, tmp_path / "repo")
    assert rc.main(["--repo", str(repo), "--gpus", "0,1", "--instances", "2"]) == 0  # make configure
    add_native_models(repo)
    for name in NATIVE_MODELS:
        (g,) = _config(repo, name).instance_group
        assert (g.kind, list(g.gpus), g.count) == (mc.ModelInstanceGroup.KIND_GPU, [0, 1], 2)
    add_native_models(repo, gpus=[], instances=3)  # explicit CPU override
    (g,) = _config(repo, "vocos").instance_group
    assert (g.kind, list(g.gpus), g.count) == (mc.ModelInstanceGroup.KIND_CPU, [], 3)


def test_repository_without_onnx_is_a_clear_error(tiny_repo, tmp_path):
    repo = _copy(tiny_repo, tmp_path / "repo")
    (artifact_dir(repo) / "vocos.onnx").unlink()
    with pytest.raises(NativeExportError, match=r"--formats torchscript,onnx"):
        add_native_models(repo, backend="onnxruntime")
    assert not (repo / NATIVE_MODELS["decoder"]).exists()  # nothing half-written
    add_native_models(repo, backend="pytorch")  # the TorchScript artifacts are all there


def test_bad_arguments(tiny_repo, tmp_path, capsys):
    arch = _arch(tiny_repo)
    with pytest.raises(NativeExportError, match="--backend"):
        build_native_config("decoder", arch, "tensorrt")
    with pytest.raises(NativeExportError, match="no native model"):
        build_native_config("dvae_encode", arch, "onnxruntime")
    with pytest.raises(NativeExportError, match="--instances"):
        build_native_config("vocos", arch, "onnxruntime", instances=0)
    with pytest.raises(FileNotFoundError, match="make export"):
        add_native_models(tmp_path / "nothing")
    assert main(["--repo", str(tmp_path / "nothing")]) == 2
    assert "make export" in capsys.readouterr().err
    repo = _copy(tiny_repo, tmp_path / "repo")
    assert main(["--repo", str(repo), "--backend", "pytorch", "--gpus", "0", "--instances", "1"]) == 0
    (g,) = _config(repo, "decoder").instance_group
    assert list(g.gpus) == [0]
    with pytest.raises(SystemExit):
        main(["--repo", str(repo), "--gpus", "zero"])


@pytest.mark.parametrize("native_repo", ["pytorch"], indirect=True)
def test_torchscript_models_load_without_this_package(native_repo, tmp_path):
    """A stock server's libtorch has no chattts_triton: the scripted code must be self-contained."""
    import subprocess
    import sys

    repo, _ = native_repo
    code = (
        "import sys, torch\n"
        f"m = torch.jit.load({str(repo / NATIVE_MODELS['vocos'] / '1' / 'model.pt')!r})\n"
        "out = m(torch.randn(2, 100, 6), torch.tensor([6, 3]))\n"
        "assert tuple(out.shape) == (2, 256 * 5), out.shape\n"
        "assert not [k for k in sys.modules if k.startswith('chattts_triton')], 'imported chattts_triton'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
