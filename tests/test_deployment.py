"""One source for every setting (chattts_triton/triton/deployment.py): each `Deployment` field carries its default,
help, type, bounds and flag; `make configure`, `python -m export` and `python -m bench.run` build their flags from
the fields, one name everywhere, and no default is written twice."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from chattts_triton.triton import deployment as d
from chattts_triton.triton import repo_config as rc
from chattts_triton.triton.deployment import CONFIGURE, EXPORT, Deployment

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name: f for f in dataclasses.fields(Deployment)}


def _parser_of(main) -> argparse.ArgumentParser:
    """The parser `main([])` builds, taken at its parse_args (which then ends the call)."""
    captured = {}

    def parse(self, argv=None, namespace=None):
        captured["ap"] = self
        raise SystemExit(0)

    orig = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = parse
    try:
        with pytest.raises(SystemExit):
            main([])
    finally:
        argparse.ArgumentParser.parse_args = orig
    return captured["ap"]


def _export_parser() -> argparse.ArgumentParser:
    import export.__main__ as ex

    return _parser_of(ex.main)


def _bench_parser() -> argparse.ArgumentParser:
    import bench.run as br

    return _parser_of(br.main)


def _flags(ap: argparse.ArgumentParser) -> dict:
    return {a.dest: a for a in ap._actions if a.option_strings}


PARSERS = {"configure": rc.parser, "export": _export_parser, "bench.run": _bench_parser}


def test_every_field_carries_its_help_and_a_setting():
    for name, f in FIELDS.items():
        s = d.spec(f)
        assert isinstance(s, d.Setting) and len(s.help) > 10, name
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, name


@pytest.mark.parametrize("command", PARSERS)
def test_every_field_has_a_flag_of_its_name_in_each_command(command):
    flags = _flags(PARSERS[command]())
    export_only = {n for n, f in FIELDS.items() if d.spec(f).export_only}
    want = set(FIELDS) - (export_only if command == "configure" else set())
    assert want <= set(flags), sorted(want - set(flags))
    for name in want:
        assert flags[name].option_strings[0] == "--" + name.replace("_", "-"), name
    if command == "configure":  # what the artifacts fix is no configure flag
        assert export_only == {"dtype", "artifact_format"} and not export_only & set(flags)


@pytest.mark.parametrize("command", PARSERS)
def test_each_flag_defaults_to_its_field(command):
    """Where a command writes a repository (export, bench.run) a flag's default is its field's (bench.run names its
    one exception, the GPU it serves on); configure keeps the repository's value of an omitted flag, but those that
    `reset` (--gpus, --instances), which default to their field's."""
    from bench.run import SERVED_DEFAULTS

    flags = _flags(PARSERS[command]())
    for name, f in FIELDS.items():
        if name not in flags:
            continue
        got = flags[name].default
        if command == "configure":
            assert got == (d.default(f) if d.spec(f).reset else None), name
        elif command == "bench.run" and name in SERVED_DEFAULTS:
            assert got == SERVED_DEFAULTS[name] != d.default(f), name
        else:
            assert got == d.flag_default(f), name
    assert flags["dtype" if command != "configure" else "gpus"].default == ("auto" if command != "configure" else [])


def test_no_command_writes_a_setting_flag_by_hand():
    """The flags of the fields come from `add_flags` only: no `add_argument("--<field>"` is left in the commands,
    and no field's flag has a second spelling."""
    dashed = {"--" + n.replace("_", "-") for n in FIELDS}
    for path in ("chattts_triton/triton/repo_config.py", "export/__main__.py", "bench/run.py"):
        for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                names = {a.value for a in node.args if isinstance(a, ast.Constant)}
                assert not names & dashed, (path, names)
    for command, make in PARSERS.items():
        for name, action in _flags(make()).items():
            if name in FIELDS:
                assert all(o.lstrip("-").replace("no-", "", 1).replace("-", "_") == name
                           for o in action.option_strings), (command, action.option_strings)


def test_no_default_literal_is_repeated():
    """A field's default is written once: in the field. Nothing else in the package assigns a module-level name to a
    field's default value by hand beside it (config.py keeps only the engine's admission policy, which the runtime
    below this wing defaults to and the fields name)."""
    import chattts_triton.config as config

    assert not hasattr(config, "GIL_SWITCH_INTERVAL_US") and not hasattr(config.LIMITS, "max_batch_size")
    assert FIELDS["gpt_admit_batch"].default == config.ADMIT_BATCH
    # each field's default is a literal written in the field, or (the engine's admission policy) config.py's name
    tree = ast.parse((ROOT / "chattts_triton/triton/deployment.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Deployment")
    named = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign):
            call = stmt.value
            assert isinstance(call, ast.Call) and call.func.id == "setting", stmt.target.id
            if call.args:
                arg = call.args[0]
                if not isinstance(arg, ast.Constant):
                    named[stmt.target.id] = ast.unparse(arg)
    assert named == {"gpt_admit_batch": "ADMIT_BATCH", "gpt_admit_wait_steps": "ADMIT_WAIT_STEPS"}
    # the stubs' parameters default to the field where they are the deployment's (old repositories)
    from chattts_triton.triton.params import EngineParams

    params = {f.name: f.default for f in dataclasses.fields(EngineParams)}
    for name in ("gpt_admit_batch", "gpt_admit_wait_steps", "gil_switch_interval_us"):
        assert params[name] == FIELDS[name].default


def test_bounds_are_checked_on_the_command_line_and_in_the_deployment(capsys):
    ap = argparse.ArgumentParser()
    d.add_flags(ap, EXPORT)
    assert ap.parse_args(["--gpt-slots", "auto", "--gpus", "0,1", "--gpu-memory-gb", "15"]).gpt_slots == "auto"
    for argv, why in ((["--gpt-slots", "0"], "gpt_slots must be ≥ 1, got 0"),
                      (["--gil-switch-interval-us", "2000000"], "gil_switch_interval_us must be in [0, 1000000]"),
                      (["--gpu-memory-gb", "0"], "gpu_memory_gb must be > 0"),
                      (["--instances", "0"], "instances must be ≥ 1"),
                      (["--gpt-context", "x"], "'x' is not a whole number"),
                      (["--gpus", "a"], "not a comma-separated list")):
        with pytest.raises(SystemExit):
            ap.parse_args(argv)
        assert why in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="queue_timeout_us must be ≥ 0"):
        Deployment(queue_timeout_us=-1).check()
    Deployment().check()


def test_from_args_reads_auto_as_none_and_configure_keeps_what_is_omitted():
    ap = argparse.ArgumentParser()
    d.add_flags(ap, EXPORT)
    dep = d.from_args(ap.parse_args(["--gpus", "0", "--gpt-slots", "16", "--no-vocoder-graphs"]))
    assert dep == Deployment(gpus=[0], gpt_slots=16, vocoder_graphs=False, dtype="auto")
    assert d.from_args(ap.parse_args([])) == Deployment(dtype="auto")  # export resolves it
    cp = argparse.ArgumentParser()
    d.add_flags(cp, CONFIGURE)
    base = Deployment(gpus=[0, 1], instances=2, gpt_slots=16, gpt_compile=False, dtype="bf16")
    dep = d.from_args(cp.parse_args(["--gpt-slots", "auto", "--stream-fade-frames", "2"]), base, CONFIGURE)
    assert dep == dataclasses.replace(base, gpus=[], instances=1, gpt_slots=None, stream_fade_frames=2)
    assert base.gpt_slots == 16  # not changed in place


def test_docs_list_every_setting_as_the_fields_say():
    assert d.settings_table() in (ROOT / "docs/deployment.md").read_text(encoding="utf-8")


def test_an_fp8_cache_is_configured_for_both_engines_and_only_where_the_compiled_step_runs(capsys):
    """kv_cache_dtype: the GPT and stream engines read the same setting (one plan for every process on the GPU);
    fp8 without GPUs or without --gpt-compile is refused naming the setting, and a value outside its choices at
    the flag."""
    from chattts_triton.config import GPT, STREAM

    ap = argparse.ArgumentParser()
    d.add_flags(ap, EXPORT)
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    for bad in (Deployment(kv_cache_dtype="fp8"), Deployment(kv_cache_dtype="fp8", gpus=[0], gpt_compile=False)):
        with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs GPUs .* and --gpt-compile"):
            bad.check()
    params = rc.model_params(Deployment(kv_cache_dtype="fp8", gpus=[0]))
    assert params[GPT].kv_cache_dtype == params[STREAM].kv_cache_dtype == "fp8"
    assert rc.model_params(Deployment(gpus=[0]))[GPT].kv_cache_dtype == "auto"
    assert Deployment.from_manifest({"deployment": {"gpus": [0]}}).kv_cache_dtype == "auto"  # exported before it
