"""The probes (bench/probes/) in their CPU modes: the decode step as AOTInductor packages (aoti.py), checked against
the engine's own step (the GPU timing is `bench.probes.step --variants aoti,aoti_traced`), and the step bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.probes.aoti import AotiStep, package_step
from chattts_triton.runtime.engine import CudaGraphs, SamplingParams
from tests.engine_util import check_same_as_alone, drive, make_engine


def _specs():
    g = torch.Generator().manual_seed(5)
    # equal lengths: both rows run in one bucket (2 rows) to the end, so one package is built
    return [dict(ids=torch.randint(0, 21000, (9 + 4 * i,), generator=g),
                 params=SamplingParams(0.3, 0.7, 20, 1.05, 14, 14, seed=30 + i))
            for i in range(2)]


@pytest.mark.parametrize("attention", ["dense", "op"])
def test_packaged_step_gives_the_engine_steps_tokens_hidden_states_and_cache(tiny, tmp_path, monkeypatch, attention):
    """dense: the CPU engine's masked attention; op: the decode attention through its custom operator, as
    a GPU runs it (here the operator's PyTorch reference), which the package calls back."""
    arch, _, _, ours = tiny
    kernel = attention == "op"
    if kernel:  # on a CPU decode_attention skips the operator: route it through, as on a GPU
        monkeypatch.setattr("chattts_triton.model.gpt.decode_attention",
                            lambda q, k, v, t, n: torch.ops.chattts_triton.decode_attention(q, k, v, t, n))
    plain = make_engine(ours, arch, max_slots=2, start=False, decode_kernel=kernel)
    plain.graphs = CudaGraphs(plain, capture=False)
    expected = drive(plain, _specs())

    eng = make_engine(ours, arch, max_slots=2, start=False, decode_kernel=kernel)
    eng.graphs = CudaGraphs(eng, capture=False)  # buckets run eagerly: graph_step is called as on a GPU
    aoti = eng.graph_step = AotiStep(eng, tmp_path)
    got = drive(eng, _specs())
    if kernel:  # the package calls the operator (AOTInductor's proxy executor), not a copy of it
        import zipfile

        pkg = zipfile.ZipFile(next(tmp_path.glob("*.pt2")))
        calls = [n for n in pkg.namelist() if n.endswith("wrapper.json")]  # the extern calls it makes
        assert calls and '"target": "chattts_triton::decode_attention"' in pkg.read(calls[0]).decode()
    assert list(aoti.build_s) == [(2, eng.graphs.buckets(2, 24)[1])]  # one package, and it served every step
    assert (tmp_path / f"step-b2-l{eng.graphs.buckets(2, 24)[1]}-op.pt2").is_file()
    check_same_as_alone(expected, got)
    # the state the package wrote in place (nothing copied out): the cache the plain step wrote
    assert torch.allclose(eng.k_cache, plain.k_cache, atol=1e-5, rtol=0)
    assert torch.equal(eng.tokens, plain.tokens)


def test_packaging_refuses_torchscript_and_unknown_kernels(tiny, tmp_path):
    arch, _, _, ours = tiny
    eng = make_engine(torch.jit.script(ours), arch, max_slots=1, start=False)
    with pytest.raises(ValueError, match="eager GPT module"):
        package_step(eng, 1, 128, tmp_path / "x.pt2")
    eng = make_engine(ours, arch, max_slots=1, start=False)
    with pytest.raises(ValueError, match="kernel must be one of"):
        package_step(eng, 1, 128, tmp_path / "x.pt2", kernel="fast")
    with pytest.raises(ValueError, match="audio-code graph buckets"):
        AotiStep(eng, tmp_path)(0, 1, 128, "text", eng.n_live)


def test_step_bench_times_the_packaged_step_on_cpu(tiny_assets, tmp_path):
    from bench.probes import step

    args = ["--assets", str(tiny_assets), "--out", str(tmp_path), "--device", "cpu", "--dtype", "fp32",
            "--batches", "1",
            "--variants", "aoti_traced", "--iters", "2", "--prefill", "", "--context", "128", "--max-new-tokens", "16",
            "--attn-len", "32", "--aoti-dir", str(tmp_path / "packages")]
    assert step.main(args) == 0
    res = json.loads((tmp_path / "step-aoti_traced.json").read_text())
    row = res["batches"]["1"]
    assert row["step_ms"] > 0 and row["build_s"] > 0 and row["load_s"] > 0
    assert (tmp_path / "packages" / "step-b1-l32-traced.pt2").is_file()


def test_step_bench_records_a_variant_that_fails_and_runs_the_next(tiny_assets, tmp_path, monkeypatch):
    """A device session's time is short: a host without a C++ compiler for AOTInductor loses that variant only."""
    from bench.probes import aoti, step

    def no_compiler(*a, **kw):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(aoti, "package_step", no_compiler)
    args = ["--assets", str(tiny_assets), "--out", str(tmp_path), "--device", "cpu", "--dtype", "fp32",
            "--batches", "1",
            "--variants", "aoti,script", "--iters", "2", "--prefill", "", "--context", "128", "--max-new-tokens", "16",
            "--attn-len", "32", "--aoti-dir", str(tmp_path / "packages")]
    assert step.main(args) == 1
    assert json.loads((tmp_path / "step-aoti.json").read_text())["error"] == "RuntimeError: no C++ compiler"
    assert json.loads((tmp_path / "step-script.json").read_text())["batches"]["1"]["step_ms"] > 0
    # a variant that fails after its steps were timed (its prefills, say) keeps the step figures beside the error
    def no_prefill(*a, **kw):
        raise AssertionError("two admissions' first tokens unread")

    monkeypatch.setattr(step, "_time_prefill", no_prefill)
    assert step.main([a if a != "aoti,script" else "script" for a in args[:-2]] + ["--prefill", "1x8"]) == 1
    res = json.loads((tmp_path / "step-script.json").read_text())
    assert res["error"].startswith("AssertionError: two admissions") and res["batches"]["1"]["step_ms"] > 0


def test_a_package_is_loaded_in_a_fresh_process_first_and_a_crash_there_is_an_error(tiny, tmp_path, monkeypatch):
    """torch's loader died of SIGSEGV on the H200 (2026-12-02) and took the bench with it: the check
    loads each package in a child process, so a crash, a failure or a hang is an error naming the package."""
    from bench.probes import aoti

    arch, _, _, ours = tiny
    eng = make_engine(ours, arch, max_slots=1, start=False)
    path = package_step(eng, 1, 32, tmp_path / "packages" / "good.pt2")
    aoti.check_loads(path)  # a sound package loads
    monkeypatch.chdir(tmp_path)
    # ... named relative to the caller's folder too (bench.probes.step's build/aoti)
    aoti.check_loads(Path("packages/good.pt2"))
    (tmp_path / "bad.pt2").write_bytes(b"not a zip")
    with pytest.raises(RuntimeError, match=r"bad\.pt2 in a fresh process failed \(exit 1\): .*Error"):
        aoti.check_loads(tmp_path / "bad.pt2")
    monkeypatch.setattr(aoti, "LOAD_CHECK", "import ctypes; ctypes.string_at(0)")  # a real segfault
    with pytest.raises(RuntimeError, match=r"good\.pt2 in a fresh process killed it \(SIGSEGV\): .*Fatal Python error"):
        aoti.check_loads(path)
    monkeypatch.setattr(aoti, "LOAD_CHECK", "import time; time.sleep(30)")
    with pytest.raises(RuntimeError, match="took over 1 s"):
        aoti.check_loads(path, timeout_s=1)


def test_step_bench_reports_a_package_whose_load_crashes_and_runs_the_next_variant(tiny_assets, tmp_path, monkeypatch):
    from bench.probes import aoti, step

    monkeypatch.setattr(aoti, "LOAD_CHECK", "import ctypes; ctypes.string_at(0)")
    args = ["--assets", str(tiny_assets), "--out", str(tmp_path), "--device", "cpu", "--dtype", "fp32",
            "--batches", "1",
            "--variants", "aoti,script", "--iters", "2", "--prefill", "", "--context", "128", "--max-new-tokens", "16",
            "--attn-len", "32", "--aoti-dir", str(tmp_path / "packages")]
    assert step.main(args) == 1
    error = json.loads((tmp_path / "step-aoti.json").read_text())["error"]
    assert "step-b1-l32-op.pt2 in a fresh process killed it (SIGSEGV)" in error
    assert json.loads((tmp_path / "step-script.json").read_text())["batches"]["1"]["step_ms"] > 0


def test_a_crashed_childs_report_keeps_its_fatal_error_line_and_names_any_signal():
    from bench.probes.aoti import _child_output, _signal_name

    stderr = "Fatal Python error: Segmentation fault\n\n" + "\n".join(f'  File "x.py", line {i}' for i in range(20))
    out = _child_output(stderr.encode())
    assert (out.startswith("Fatal Python error: Segmentation fault | ") and out.endswith("line 19")
            and "line 13" not in out)
    assert _child_output(None) == "" and _child_output("one\ntwo") == "one | two"
    assert _signal_name(11) == "SIGSEGV" and _signal_name(40) == "signal 40"  # a real-time signal has no name


def test_aoti_probe_loads_a_small_package_here_and_reports_a_loader_that_crashes(tmp_path, monkeypatch, capsys):
    """`python -m bench.probes.aoti` tells a host whose torch cannot load any package (the H200's, 2026-12-02)
    from a step package that fails: it builds a two-layer one and loads it in a fresh process."""
    from bench.probes import aoti

    assert aoti.main(["--device", "cpu", "--workdir", str(tmp_path)]) == 0
    assert "probe-cpu.pt2 built and loaded in a fresh process" in capsys.readouterr().out
    monkeypatch.setattr(aoti, "LOAD_CHECK", "import ctypes; ctypes.string_at(0)")  # a loader that crashes
    assert aoti.main(["--device", "cpu", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "probe-cpu.pt2 in a fresh process killed it (SIGSEGV)" in err and "Fatal Python error" in err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            aoti.main(["--device", "cuda", "--workdir", str(tmp_path)])
        assert e.value.code == 2 and "sees no CUDA GPU" in capsys.readouterr().err


def test_step_bench_times_steps_and_prefills_of_each_variant_on_cpu(tiny_assets, tmp_path):
    """bench.probes.step's CPU mode (the GPU one needs the device): one JSON per variant, a step and forward
    time per batch, an eager prefill time per shape (more prompts than batch rows fit too)."""
    import json

    from bench.probes import step

    args = ["--assets", str(tiny_assets), "--out", str(tmp_path), "--device", "cpu", "--dtype", "fp32",
            "--batches", "1,2", "--variants", "script,script_unfused", "--iters", "2", "--prefill", "1x8,4x16",
            "--context", "128", "--max-new-tokens", "16", "--attn-len", "32", "--profile", "2", "--lengths", "uniform"]
    assert step.main(args) == 0
    ops = {}
    for variant in ("script", "script_unfused"):
        res = json.loads((tmp_path / f"step-{variant}.json").read_text())
        assert res["variant"] == variant and res["gpu"] == "cpu" and res["lengths"] == "uniform"
        assert res["decode_kernel"] is False  # TorchScript
        assert (set(res["batches"]) == {"1", "2"} and all(r["step_ms"] > 0 and r["forward_ms"] > 0
                                                          for r in res["batches"].values()))
        prof = res["batches"]["1"]["profile"]
        assert prof["kernel_ms_per_step"] > 0 and 0 < len(prof["top"]) <= 12
        assert sum(k["per_step"] for k in prof["top"]) <= prof["kernels_per_step"]
        ops[variant] = prof["kernels_per_step"]
        assert set(res["prefill"]) == {"1x8", "4x16"} and all(r["eager_ms"] > 0 for r in res["prefill"].values())
    # fused projections: one GEMM for q/k/v and one for gate/up instead of five per layer
    assert ops["script"] < ops["script_unfused"], ops
    with pytest.raises(SystemExit, match="on a CPU"):  # inductor's step is a GPU variant
        step.main([a if a != "script,script_unfused" else "compile" for a in args])
    with pytest.raises(SystemExit, match="unknown variant script_gemv"):  # one row's reductions: compiled steps only
        step.main([a if a != "script,script_unfused" else "script_gemv" for a in args])


def test_host_cost_probe_times_an_admissions_inputs_and_a_finish_with_its_aten_calls(tiny_assets, tmp_path, capsys):
    """bench.probes.host_cost on the CPU: per admission size, _packed_batch's time (whole and host part) and aten
    calls, and _finish_rows's time per result; rows finishing together take a gathered copy per kind, so a finish
    makes a few aten calls per result (the results' views), not the ten of a copy and cast each."""
    from bench.probes import host_cost

    out = tmp_path / "host.json"
    assert host_cost.main(["--assets", str(tiny_assets), "--prompts", "4,12", "--repeats", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompts"] for r in rows] == [4, 12]
    for r in rows:
        assert r["packed_batch_ms"] > 0 and r["packed_batch_host_ms"] > 0 and r["packed_batch_aten_calls"] > 0
        assert r["finish_us_per_result"] > 0
        assert r["finish_aten_calls_first_call"] > 0
    # each further result finishing in the same call adds its views, not a copy and cast of its own
    assert rows[1]["finish_aten_calls_first_call"] - rows[0]["finish_aten_calls_first_call"] < 6 * 8
    with pytest.raises(SystemExit):
        host_cost.main(["--assets", str(tiny_assets), "--prompts", "0"])
    assert "--prompts must be ≥ 1" in capsys.readouterr().err


def test_step_bench_times_prefills_again_and_again_with_the_engines_overlap(tiny):
    """bench.probes.step's prefill timing with the engine's overlap on (CUDA's default): each admission's first
    tokens are read back before the next one (an unread admission is an engine error), and every slot is free
    again after each."""
    from bench.probes.step import prefill_once

    arch, _, _, model = tiny
    engine = make_engine(model, arch, start=False, overlap=True)
    once = prefill_once(engine, 3, 8, False)
    with torch.inference_mode():
        for _ in range(3):
            once()
            assert engine._first is None and not engine.rows


def test_gc_pause_probe_times_a_full_collection_before_and_after_freezing(tiny_assets, tmp_path):
    """bench.probes.gc_pause with dynamo alone (quick): the compile leaves the process more objects than it started
    with; a full collection over them takes time, and after `freeze_start_up_objects` it skips them."""
    import gc
    import json

    from bench.probes import gc_pause
    from chattts_triton.triton import backend

    out = tmp_path / "gc.json"
    try:
        assert gc_pause.main(["--assets", str(tiny_assets), "--backend", "eager", "--batches", "1,2",
                              "--out", str(out)]) == 0
    finally:
        if backend.GC_PAUSES in gc.callbacks:
            gc.callbacks.remove(backend.GC_PAUSES)
    res = json.loads(out.read_text())
    # frozen: the objects alive, less what the freeze's own collection still found
    assert res["objects_after_compile"] > res["objects_at_start"] and res["frozen"] >= 0.99 * res["objects_alive"] > 0
    assert gc.get_freeze_count() == 0  # the probe gives pytest's process its collector back
    assert res["full_collect_ms"] > 0 and res["full_collect_frozen_ms"] < res["full_collect_ms"] / 4


def test_the_row_kernel_probe_reads_its_layouts_and_refuses_bad_ones_by_name(tmp_path, capsys):
    """bench.probes.rowops: `current`, `N/K/W` (either with /nopdl), `inductor`, `cublas`; a bad layout or product is
    an argument error naming it; without a GPU it says so and exits 2."""
    from bench.probes import rowops as probe

    assert probe.parse_layout("current") == {"way": "kernel"}
    assert probe.parse_layout("current/nopdl") == {"way": "kernel", "pdl": False}
    assert probe.parse_layout("4/1024/2/nopdl") == {"way": "kernel", "layout": (4, 1024, 2), "pdl": False}
    assert probe.parse_layout("inductor") == {"way": "inductor"}
    with pytest.raises(ValueError, match="'8/x'"):
        probe.parse_layout("8/x")
    for bad, word in ((["--layouts", "8/x"], "--layouts"), (["--products", "qkv,lm"], "lm")):
        with pytest.raises(SystemExit):
            probe.main(["--out", str(tmp_path / "r.json"), *bad])
        assert word in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert probe.main(["--out", str(tmp_path / "r.json")]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_launch_way_the_compiler_refuses_is_recorded_and_said_not_fatal(capsys):
    """bench.common.time_launch_way (the layout probes' one way): a way that raises is a row with its error, printed
    after its tag, and the probe goes on."""
    from bench.common import time_launch_way

    def refused(*_):
        raise RuntimeError("out of resources: shared memory")

    row = time_launch_way(refused, [(torch.zeros(2),)], torch.zeros(2), 8, 3, "qkv 64/4096/8")
    assert row == {"error": "RuntimeError: out of resources: shared memory"}
    assert "qkv 64/4096/8 failed: RuntimeError: out of resources" in capsys.readouterr().out
