"""The model configurations and `python -m chattts_triton.repo_config` (chattts_triton/triton/repo_config.py): the
generated configs against the source of truth, each configure flag reaching its model and service and surviving a
re-configure, nonsense refused; queues and batching delays. No server is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chattts_triton.config import ENSEMBLE, ENSEMBLE_INPUTS, GPT, MANIFEST, PREPROCESS, STREAM, VOCODER, Arch
from chattts_triton.memory import MAX_SLOTS
from chattts_triton.triton import repo_config as rc


def test_repository_configs_parse_and_match_the_source_of_truth(tiny_repo):
    man = rc.read_manifest(tiny_repo)
    expected = rc.build_configs(Arch.from_json(man["arch"]), rc.Deployment(**man["deployment"]))
    for name, cfg in expected.items():
        parsed = rc.parse_pbtxt((Path(tiny_repo) / name / "config.pbtxt").read_text())
        assert parsed == cfg
    ens = expected[ENSEMBLE]
    assert {i.name for i in ens.input} == set(ENSEMBLE_INPUTS)
    assert [o.name for o in ens.output] == ["AUDIO", "SPOKEN_TEXT"] and ens.max_batch_size > 0
    # every composing model batches dynamically
    assert all(expected[m].HasField("dynamic_batching") for m in rc.MODELS)


def test_configure_sets_gpu_instance_groups(tiny_repo, tmp_path):
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    assert rc.main(["--repo", str(repo), "--gpus", "0,1", "--instances", "2"]) == 0
    voc = rc.parse_pbtxt((repo / VOCODER / "config.pbtxt").read_text())
    gpt = rc.parse_pbtxt((repo / GPT / "config.pbtxt").read_text())
    assert voc.instance_group[0].kind == voc.instance_group[0].KIND_GPU
    assert list(voc.instance_group[0].gpus) == [0, 1] and voc.instance_group[0].count == 2
    assert list(gpt.instance_group[0].gpus) == [0, 1] and gpt.instance_group[0].count == 1
    assert rc.main(["--repo", str(repo), "--gpus", ""]) == 0
    voc = rc.parse_pbtxt((repo / VOCODER / "config.pbtxt").read_text())
    assert voc.instance_group[0].kind == voc.instance_group[0].KIND_CPU


def test_configure_gpt_compile_reaches_both_engine_models_and_persists(tiny_repo, tmp_path):
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)

    def compile_params():
        return [rc.parse_pbtxt((repo / m / "config.pbtxt").read_text()).parameters["gpt_compile"].string_value
                for m in (GPT, STREAM)]

    assert compile_params() == ["1", "1"]  # the export's default (CPU instances ignore it)
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--no-gpt-compile"]) == 0
    assert compile_params() == ["0", "0"]
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--gpt-slots", "64"]) == 0  # kept unless told
    assert compile_params() == ["0", "0"]
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--gpt-compile"]) == 0
    assert compile_params() == ["1", "1"]
    _reconfigured_as_exported_before(repo, "gpt_compile")  # exported before the option: TorchScript step kept
    assert compile_params() == ["0", "0"]


@pytest.mark.parametrize("name,default", [("compile_prefill", False), ("packed_prefill", True)])
def test_configure_an_engine_prefill_switch_reaches_both_engine_services_and_is_kept(tiny_repo, tmp_path,
                                                                                    monkeypatch, name, default):
    """--gpt-compile-prefill (opt-in) and --gpt-packed-prefill (on by default) set their parameter on both engine
    models; the other value, once given, is kept by a re-configure that does not name it, and the service factory
    hands each to the GPT service (which compiles or packs prefills only with the compiled step)."""
    import shutil

    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.triton.backend import ModelContext, gpt_service

    key, flag = f"gpt_{name}", f"--gpt-{name.replace('_', '-')}"
    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)

    def params():
        return [rc.parse_pbtxt((repo / m / "config.pbtxt").read_text()).parameters[key].string_value
                for m in (GPT, STREAM)]

    seen = []
    monkeypatch.setattr(gpt_runtime, "GPTService", lambda *a, **kw: seen.append(kw))
    assert params() == [str(int(default))] * 2
    gpt_service(ModelContext.from_repo(repo, GPT))
    assert rc.main(["--repo", str(repo), "--gpus", "0", flag.replace("--", "--no-") if default else flag]) == 0
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--gpt-slots", "64"]) == 0  # kept unless told
    assert params() == [str(int(not default))] * 2
    gpt_service(ModelContext.from_repo(repo, GPT))
    assert rc.main(["--repo", str(repo), "--gpus", "0", flag if default else flag.replace("--", "--no-")]) == 0
    assert params() == [str(int(default))] * 2
    assert [kw[name] for kw in seen] == [default, not default]


def _switched_on_and_kept(tiny_repo, tmp_path, flag, model, key):
    """A copy of the repository where `flag` (off by default: `model`'s parameter `key` reads "0") was
    switched on and survives a re-configure that does not name it; returns it and a reader of `key`."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)

    def param():
        return rc.parse_pbtxt((repo / model / "config.pbtxt").read_text()).parameters[key].string_value

    assert param() == "0"
    assert rc.main(["--repo", str(repo), "--gpus", "0", flag]) == 0
    assert param() == "1"
    assert rc.main(["--repo", str(repo), "--gpus", "0"]) == 0  # kept unless told
    assert param() == "1"
    return repo, param


def _reconfigured_as_exported_before(repo: Path, key: str) -> None:
    """Re-configure `repo` (naming no setting) as if it had been exported before the setting `key` existed."""
    man = json.loads((repo / MANIFEST).read_text())
    del man["deployment"][key]
    (repo / MANIFEST).write_text(json.dumps(man))
    assert rc.main(["--repo", str(repo), "--gpus", "0"]) == 0


def _keyword_seen(monkeypatch, cls, key: str) -> list:
    """The `key` keyword each construction of `cls` gets, in order (the construction itself unchanged)."""
    seen, real_init = [], cls.__init__

    def init(self, *a, **kw):
        seen.append(kw[key])
        real_init(self, *a, **kw)

    monkeypatch.setattr(cls, "__init__", init)
    return seen


def test_configure_stream_engine_priority_reaches_the_stream_models_engine_only(tiny_repo, tmp_path, monkeypatch):
    """--stream-engine-priority (opt-in) sets chattts_stream's parameter, kept by a re-configure that does not name
    it; the stream model's GPT service gets high_priority and chattts_gpt's does not (nothing of its process shares
    its GPU); a CPU engine has no CUDA stream to launch on whatever it says."""
    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.triton.backend import ModelContext, gpt_service, stream_service

    repo, _ = _switched_on_and_kept(tiny_repo, tmp_path, "--stream-engine-priority", STREAM, "stream_engine_priority")
    assert "stream_engine_priority" not in rc.parse_pbtxt((repo / GPT / "config.pbtxt").read_text()).parameters
    asked = _keyword_seen(monkeypatch, gpt_runtime.GPTService, "high_priority")
    gpt_service(ModelContext.from_repo(repo, GPT)).close()
    svc = stream_service(ModelContext.from_repo(repo, STREAM))
    try:
        assert asked == [False, True] and svc.gpt.engine.launch_stream is None  # a CPU instance
    finally:
        svc.close()


def test_configure_codec_compile_reaches_the_vocoder_and_the_stream_models_codec(tiny_repo, tmp_path, monkeypatch):
    """--codec-compile (opt-in) sets chattts_vocoder's and chattts_stream's parameter, kept by a re-configure that does
    not name it, and both services build their VocoderService with compile_codec; a CPU instance has no graphs, so
    its calls stay on the artifacts whatever it says."""
    from chattts_triton.runtime import vocoder as vocoder_runtime
    from chattts_triton.triton.backend import ModelContext, stream_service, vocoder_service

    repo, _ = _switched_on_and_kept(tiny_repo, tmp_path, "--codec-compile", VOCODER, "codec_compile")
    assert rc.parse_pbtxt((repo / STREAM / "config.pbtxt").read_text()).parameters["codec_compile"].string_value == "1"
    assert "codec_compile" not in rc.parse_pbtxt((repo / GPT / "config.pbtxt").read_text()).parameters
    asked = _keyword_seen(monkeypatch, vocoder_runtime.VocoderService, "compile_codec")
    voc = vocoder_service(ModelContext.from_repo(repo, VOCODER))
    assert voc.graphs is None and voc.graph_nets == (voc.decoder, voc.dvae, voc.vocos)  # a CPU instance
    svc = stream_service(ModelContext.from_repo(repo, STREAM))
    try:
        assert asked == [True, True] and svc.voc.graph_nets[0] is svc.voc.decoder
    finally:
        svc.close()


def test_configure_gpt_gemv_on_by_default_off_when_told_kept_and_read_by_both_engine_models(tiny_repo, tmp_path,
                                                                                            monkeypatch):
    """chattts_gpt's and chattts_stream's gpt_gemv is on by default and both GPT services get it; --no-gpt-gemv
    turns it off in both, a re-configure that does not name it keeps that; a repository exported before the
    option keeps its GEMMs. A CPU instance serves the TorchScript step, whose model has no such switch, whatever
    it says."""
    import shutil

    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.triton.backend import ModelContext, gpt_service, stream_service

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)

    def params() -> list[str]:
        return [rc.parse_pbtxt((repo / m / "config.pbtxt").read_text()).parameters["gpt_gemv"].string_value
                for m in (GPT, STREAM)]

    assert params() == ["1", "1"]
    assert "gpt_gemv" not in rc.parse_pbtxt((repo / VOCODER / "config.pbtxt").read_text()).parameters
    asked = _keyword_seen(monkeypatch, gpt_runtime.GPTService, "gemv")
    gpt_service(ModelContext.from_repo(repo, GPT)).close()
    svc = stream_service(ModelContext.from_repo(repo, STREAM))
    try:
        assert asked == [True, True] and svc.gpt.engine.graph_step is None  # a CPU instance: no compiled step
    finally:
        svc.close()
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--no-gpt-gemv"]) == 0
    assert rc.main(["--repo", str(repo), "--gpus", "0"]) == 0  # kept unless told
    assert params() == ["0", "0"] and rc.read_manifest(repo)["deployment"]["gpt_gemv"] is False
    gpt_service(ModelContext.from_repo(repo, GPT)).close()
    assert asked == [True, True, False]
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--gpt-gemv"]) == 0
    assert params() == ["1", "1"]
    _reconfigured_as_exported_before(repo, "gpt_gemv")  # exported before the option: its GEMMs kept
    assert params() == ["0", "0"]


def test_configure_gpt_gemv_tune_off_by_default_on_when_told_kept_and_off_for_a_repository_exported_before(
        tiny_repo, tmp_path, monkeypatch):
    """chattts_gpt's and chattts_stream's gpt_gemv_tune is off by default; --gpt-gemv-tune turns it on in both and
    both GPT services get it, a re-configure that does not name it keeps it; a repository exported before the option
    keeps its heuristic launch configurations."""
    import shutil

    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.triton.backend import ModelContext, gpt_service

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)

    def params(name: str) -> list[str]:
        return [rc.parse_pbtxt((repo / m / "config.pbtxt").read_text()).parameters[name].string_value
                for m in (GPT, STREAM)]

    assert params("gpt_gemv_tune") == ["0", "0"]
    asked = _keyword_seen(monkeypatch, gpt_runtime.GPTService, "gemv_tune")
    gpt_service(ModelContext.from_repo(repo, GPT)).close()
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--gpt-gemv-tune"]) == 0
    assert rc.main(["--repo", str(repo), "--gpus", "0"]) == 0  # kept unless told
    assert params("gpt_gemv_tune") == ["1", "1"] and params("gpt_gemv") == ["1", "1"]
    gpt_service(ModelContext.from_repo(repo, GPT)).close()
    assert asked == [False, True]
    _reconfigured_as_exported_before(repo, "gpt_gemv_tune")
    assert params("gpt_gemv_tune") == ["0", "0"]


def test_configure_vocoder_graphs_on_by_default_off_when_told_kept_and_read_by_the_service(tiny_repo, tmp_path,
                                                                                           monkeypatch):
    """chattts_vocoder's vocoder_graphs is on by default; --no-vocoder-graphs turns it off, a re-configure
    that does not name it keeps that, and its service reads it. The stream model keeps its own (on); a
    CPU instance makes no graphs whatever the flag."""
    import shutil

    from chattts_triton.runtime import vocoder as vocoder_runtime
    from chattts_triton.triton.backend import ModelContext, vocoder_service

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)

    def graphs_param():
        return rc.parse_pbtxt((repo / VOCODER / "config.pbtxt").read_text()).parameters["vocoder_graphs"].string_value

    asked = []
    monkeypatch.setattr(vocoder_runtime.VocoderService, "__init__",
                        lambda self, *a, graphs=False, **kw: asked.append(graphs))
    assert graphs_param() == "1"
    vocoder_service(ModelContext.from_repo(repo, VOCODER))
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--no-vocoder-graphs"]) == 0
    assert rc.main(["--repo", str(repo), "--gpus", "0"]) == 0  # kept unless told
    vocoder_service(ModelContext.from_repo(repo, VOCODER))
    assert asked == [True, False] and graphs_param() == "0"
    assert rc.read_manifest(repo)["deployment"]["vocoder_graphs"] is False
    monkeypatch.undo()
    assert rc.main(["--repo", str(repo), "--gpus", "0", "--vocoder-graphs"]) == 0
    assert graphs_param() == "1"
    assert vocoder_service(ModelContext.from_repo(repo, VOCODER)).graphs is None  # a CPU instance
    assert rc.parse_pbtxt((repo / STREAM / "config.pbtxt").read_text()).parameters.get("vocoder_graphs") is None
    _reconfigured_as_exported_before(repo, "vocoder_graphs")  # exported before the option: eager vocoder kept
    assert graphs_param() == "0"


@pytest.mark.parametrize("flag,key,field", [("--stream-codec-stream", "codec_stream", "stream_codec_stream"),
                                             ("--stream-first-chunks-first", "first_chunks_first",
                                              "stream_first_chunks_first")])
def test_configure_stream_options_reach_the_stream_service_and_persist(tiny_repo, tmp_path, monkeypatch, flag,
                                                                       key, field):
    """The stream model's opt-in switches (off by default) set chattts_stream's parameter, which its
    service gets; a CPU service has no CUDA stream to use whatever --stream-codec-stream says."""
    from chattts_triton.runtime import streaming
    from chattts_triton.triton.backend import ModelContext, stream_service

    repo, param = _switched_on_and_kept(tiny_repo, tmp_path, flag, STREAM, field)
    assert rc.read_manifest(repo)["deployment"][field] is True
    asked, real_init = [], streaming.StreamService.__init__

    def init(self, *a, **kw):
        asked.append(kw[key])
        real_init(self, *a, **kw)

    monkeypatch.setattr(streaming.StreamService, "__init__", init)
    svc = stream_service(ModelContext.from_repo(repo, STREAM))
    try:
        assert asked == [True] and svc.codec_stream is None  # a CPU instance
        assert svc.first_chunks_first == (key == "first_chunks_first")
    finally:
        svc.close()
    assert rc.main(["--repo", str(repo), "--gpus", "0", flag.replace("--", "--no-", 1)]) == 0
    assert param() == "0"


def test_configure_admission_policy_reaches_the_engines_and_refuses_nonsense(tiny_repo, tmp_path, capsys):
    import shutil

    from chattts_triton.triton.backend import ModelContext, gpt_service

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    assert rc.main(["--repo", str(repo), "--gpt-admit-batch", "8", "--gpt-admit-wait-steps", "12"]) == 0
    for model in (GPT, STREAM):
        params = rc.parse_pbtxt((repo / model / "config.pbtxt").read_text()).parameters
        assert (params["gpt_admit_batch"].string_value, params["gpt_admit_wait_steps"].string_value) == ("8", "12")
    svc = gpt_service(ModelContext.from_repo(repo, GPT))
    try:
        assert (svc.engine.scheduler.admit_batch, svc.engine.scheduler.admit_wait_steps) == (8, 12)
    finally:
        svc.close()
    with pytest.raises(SystemExit) as e:
        rc.main(["--repo", str(repo), "--gpt-admit-batch", "0"])
    assert e.value.code == 2 and "gpt_admit_batch must be ≥ 1" in capsys.readouterr().err
    assert rc.parse_pbtxt((repo / GPT / "config.pbtxt").read_text()).parameters["gpt_admit_batch"].string_value == "8"


def test_configure_batching_delay_of_the_vocoder_only(tiny_repo, tmp_path, capsys):
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)

    def delays():
        return {m: rc.parse_pbtxt((repo / m / "config.pbtxt").read_text()).dynamic_batching.max_queue_delay_microseconds
                for m in (PREPROCESS, GPT, VOCODER, STREAM)}

    assert set(delays().values()) == {0}  # by default none waits
    assert rc.main(["--repo", str(repo), "--max-queue-delay-us", "1500"]) == 0
    assert delays() == {PREPROCESS: 0, GPT: 0, VOCODER: 1500, STREAM: 0}
    assert rc.main(["--repo", str(repo)]) == 0  # kept unless told
    assert delays()[VOCODER] == 1500
    with pytest.raises(SystemExit) as e:
        rc.main(["--repo", str(repo), "--max-queue-delay-us", "-1"])
    assert e.value.code == 2 and "max_queue_delay_us must be ≥ 0" in capsys.readouterr().err
    assert delays()[VOCODER] == 1500


def test_configure_stream_schedule_persists_and_refuses_a_fade_longer_than_the_lookahead(tiny_repo, tmp_path, capsys):
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)

    def params():
        p = rc.parse_pbtxt((repo / STREAM / "config.pbtxt").read_text()).parameters
        return {k: p[k].string_value for k in ("stream_first_chunk_frames", "stream_first_lookahead_frames",
                                               "stream_fade_frames")}

    assert params() == {"stream_first_chunk_frames": "8", "stream_first_lookahead_frames": "8",
                        "stream_fade_frames": "4"}
    assert rc.main(["--repo", str(repo), "--stream-first-lookahead-frames", "0", "--stream-fade-frames", "2"]) == 0
    assert rc.main(["--repo", str(repo), "--stream-first-chunk-frames", "4"]) == 0  # the others are kept
    assert params() == {"stream_first_chunk_frames": "4", "stream_first_lookahead_frames": "0",
                        "stream_fade_frames": "2"}
    with pytest.raises(SystemExit):
        rc.main(["--repo", str(repo), "--stream-first-lookahead-frames", "2", "--stream-fade-frames", "3"])
    assert "fade must be" in capsys.readouterr().err
    assert params()["stream_fade_frames"] == "2"  # nothing written
    manifest = repo / MANIFEST  # exported before the early first chunk: it keeps exact chunks
    man = json.loads(manifest.read_text())
    for k in ("stream_first_lookahead_frames", "stream_fade_frames"):
        del man["deployment"][k]
    manifest.write_text(json.dumps(man))
    assert rc.main(["--repo", str(repo), "--gpus", ""]) == 0
    assert params()["stream_first_lookahead_frames"] == "0" and params()["stream_fade_frames"] == "0"


def test_configure_gil_switch_interval_reaches_the_engine_processes_and_refuses_nonsense(tiny_repo, tmp_path, capsys):
    """The switch interval is written to both engine models and set by the service factory in the
    process that hosts the engine (0 leaves Python's own)."""
    import shutil
    import sys

    from chattts_triton.triton.backend import ModelContext, gpt_service, set_switch_interval
    from chattts_triton.triton.deployment import setting_of

    GIL_SWITCH_INTERVAL_US = rc.Deployment.gil_switch_interval_us  # the field's default and bound
    GIL_SWITCH_INTERVAL_MAX_US = int(setting_of("gil_switch_interval_us").max)

    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    def params(model):
        return rc.parse_pbtxt((repo / model / "config.pbtxt").read_text()).parameters
    assert params(GPT)["gil_switch_interval_us"].string_value == str(GIL_SWITCH_INTERVAL_US)
    old = sys.getswitchinterval()
    try:
        assert rc.main(["--repo", str(repo), "--gil-switch-interval-us", "750"]) == 0
        assert [params(m)["gil_switch_interval_us"].string_value for m in (GPT, STREAM)] == ["750", "750"]
        assert "gil_switch_interval_us" not in params(VOCODER)
        sys.setswitchinterval(0.005)
        gpt_service(ModelContext.from_repo(repo, GPT)).close()
        assert sys.getswitchinterval() == pytest.approx(750e-6)
        assert rc.main(["--repo", str(repo), "--gil-switch-interval-us", "0"]) == 0
        sys.setswitchinterval(0.005)
        gpt_service(ModelContext.from_repo(repo, GPT)).close()
        assert sys.getswitchinterval() == pytest.approx(0.005)  # 0: Python's own left alone
    finally:
        sys.setswitchinterval(old)
    with pytest.raises(SystemExit) as e:
        rc.main(["--repo", str(repo), "--gil-switch-interval-us", "-1"])
    assert e.value.code == 2 and "gil_switch_interval_us must be in" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="gil_switch_interval_us must be in"):  # a hand-edited config, at load
        set_switch_interval(GIL_SWITCH_INTERVAL_MAX_US + 1)
    assert params(GPT)["gil_switch_interval_us"].string_value == "0"


def test_only_models_that_batch_in_triton_wait_to_form_a_batch():
    """The GPT and stream models batch in their engines and the preprocess model prepares each request
    on its own: Triton's batching delay would only add latency to them."""
    cfgs = rc.build_configs(_tiny_arch(), rc.Deployment(max_queue_delay_us=1500))
    delays = {m: cfgs[m].dynamic_batching.max_queue_delay_microseconds for m in rc.MODELS + (STREAM,)}
    assert delays[GPT] == delays[STREAM] == delays[PREPROCESS] == 0
    assert delays[VOCODER] == 1500


def test_every_queue_holds_twice_what_the_engines_admit():
    """No Triton queue may refuse a request the GPT engine would admit (a burst then got "Exceeds maximum
    queue size" below the engine's bound): each is bounded, at twice the engines' admission bound — sized
    at the largest batch where the engines size themselves from the GPU at load."""
    for dep, bound in ((rc.Deployment(gpt_slots=3), 12), (rc.Deployment(gpt_slots=3, gpt_max_pending=5), 5),
                       (rc.Deployment(gpus=[0, 1]), 2 * 4 * MAX_SLOTS["gpt"]),
                       (rc.Deployment(gpus=[0], gpt_slots=100), 400)):
        cfgs = rc.build_configs(_tiny_arch(), dep)
        for m in rc.MODELS:
            assert cfgs[m].dynamic_batching.default_queue_policy.max_queue_size == 2 * bound, (dep, m)
        assert cfgs[PREPROCESS].parameters["max_pending"].string_value == str(bound)
    cfgs = rc.build_configs(_tiny_arch(), rc.Deployment(gpt_slots=3))
    assert cfgs[GPT].parameters["gpt_max_pending"].string_value == "12"  # 4 × slots by default
    gpu = rc.build_configs(_tiny_arch(), rc.Deployment(gpus=[0]))
    assert {k: gpu[GPT].parameters[k].string_value for k in ("gpt_slots", "gpt_max_pending", "gpt_cache_tokens")} == \
        {"gpt_slots": "auto", "gpt_max_pending": "auto", "gpt_cache_tokens": "auto"}
    assert gpu[STREAM].dynamic_batching.default_queue_policy.max_queue_size == 2 * 2 * MAX_SLOTS["stream"]
    explicit = rc.build_configs(_tiny_arch(), rc.Deployment(gpt_slots=3, max_queue_size=7))
    assert all(explicit[m].dynamic_batching.default_queue_policy.max_queue_size == 7 for m in rc.MODELS)


def test_an_engine_without_admission_bound_is_not_bounded_in_front_either():
    """gpt_max_pending 0 (no bound): the preprocess model refuses nothing either (it answered "server busy: 32
    requests in flight" at the CPU's default size); the queues stay bounded, sized as at the largest batch."""
    cfgs = rc.build_configs(_tiny_arch(), rc.Deployment(gpt_max_pending=0))
    assert cfgs[PREPROCESS].parameters["max_pending"].string_value == "0"
    assert cfgs[GPT].parameters["gpt_max_pending"].string_value == "0"
    assert all(cfgs[m].dynamic_batching.default_queue_policy.max_queue_size > 0 for m in rc.MODELS)


def _tiny_arch():
    from chattts_triton.config import TINY_ARCH

    return TINY_ARCH


def test_requests_of_different_lengths_may_share_an_execution():
    """Utterances differ in length: a model whose batch may only hold one shape executes them one by one.
    Every input with a variable dimension of the python models allows ragged batches; the ensemble's do not
    (it forms no batches)."""
    cfgs = rc.build_configs(_tiny_arch(), rc.Deployment())
    for m in rc.MODELS + (STREAM,):
        for i in cfgs[m].input:
            assert i.allow_ragged_batch == (-1 in i.dims), (m, i.name)
    assert {i.name for i in cfgs[VOCODER].input if i.allow_ragged_batch} == {"CODES", "HIDDENS"}
    assert not any(i.allow_ragged_batch for i in cfgs[ENSEMBLE].input)
