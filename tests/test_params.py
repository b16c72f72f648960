"""Each model's parameters (chattts_triton.triton.params): one name per setting from Deployment to the flag to the
config.pbtxt key, written and read back by one schema; repositories configured before read the same settings."""

from __future__ import annotations

import dataclasses

import pytest

from chattts_triton.config import GPT, PREPROCESS, STREAM, TINY_ARCH, VOCODER
from chattts_triton.triton import repo_config as rc
from chattts_triton.triton.params import GPTParams, Params, PreprocessParams, StreamParams, VocoderParams

SCHEMAS = {PREPROCESS: PreprocessParams, GPT: GPTParams, STREAM: StreamParams, VOCODER: VocoderParams}
# what repo_config wrote before the schema, for Deployment(gpus=[0], gpt_slots=16, stream_first_lookahead_frames=0)
BEFORE = {
    PREPROCESS: {"artifact_format": "torchscript", "gpt_model": "chattts_gpt", "max_pending": "64"},
    GPT: {"admit_batch": "32", "admit_wait_steps": "4", "cache_tokens": "auto", "compile_prefill": "0",
          "compile_step": "1",
          "dtype": "fp32", "engine_role": "gpt", "gil_switch_interval_us": "200", "gpu_memory_gb": "auto",
          "max_context": "3072", "max_new_tokens": "2048", "max_pending": "64", "max_slots": "16",
          "vocoder_instances": "1"},
    STREAM: {"admit_batch": "32", "admit_wait_steps": "4", "artifact_format": "torchscript", "cache_tokens": "auto",
             "chunk_frames": "32", "codec_stream": "0", "compile_prefill": "0", "compile_step": "1", "dtype": "fp32",
             "engine_role": "stream", "fade_frames": "4", "first_chunk_frames": "8", "first_chunks_first": "0",
             "first_lookahead_frames": "0", "gil_switch_interval_us": "200", "gpu_memory_gb": "auto",
             "lookahead_frames": "0", "max_context": "3072", "max_new_tokens": "2048", "max_pending": "auto",
             "max_slots": "auto", "vocoder_instances": "1"},
    VOCODER: {"artifact_format": "torchscript", "codec_graphs": "1", "dtype": "fp32", "gpu_memory_gb": "auto"},
}
DEPLOYMENT = dict(gpus=[0], gpt_slots=16, stream_first_lookahead_frames=0)


def _as_triton(texts):
    return {k: {"string_value": v} for k, v in texts.items()}


def _written(dep: rc.Deployment):
    cfgs = rc.build_configs(TINY_ARCH, dep)
    return {m: {k: v.string_value for k, v in cfgs[m].parameters.items()} for m in SCHEMAS}


def test_each_model_reads_back_what_repo_config_wrote():
    dep = rc.Deployment(**DEPLOYMENT)
    want = rc.model_params(dep)
    for model, texts in _written(dep).items():
        assert set(texts) == {f.name for f in dataclasses.fields(SCHEMAS[model])}, model
        assert SCHEMAS[model].read(model, _as_triton(texts)) == want[model]
    assert want[GPT].gpt_slots == 16 and want[GPT].gpt_compile is True and want[STREAM].slots is None
    assert want[VOCODER].vocoder_graphs is True and want[PREPROCESS].max_pending == 64


def test_a_repository_configured_before_the_schema_keeps_its_settings():
    """Its keys (max_slots, compile_step, codec_graphs ...) read as the settings the same deployment writes today."""
    want = rc.model_params(rc.Deployment(**DEPLOYMENT))
    for model, texts in BEFORE.items():
        assert SCHEMAS[model].read(model, _as_triton(texts)) == want[model], model


def test_a_repository_older_still_gets_the_defaults_it_was_served_with():
    """A parameter its config lacks reads as the behaviour before it existed (vocoder graphs off, the step not
    compiled, no admission bound); one with no such default is an error naming it."""
    voc = VocoderParams.read(VOCODER, _as_triton({"artifact_format": "onnx"}))
    assert voc == VocoderParams(artifact_format="onnx", vocoder_graphs=False)
    gpt = GPTParams.read(GPT, _as_triton({"max_slots": "8", "max_context": "3072", "max_new_tokens": "2048"}))
    assert (gpt.gpt_slots, gpt.gpt_compile, gpt.gpt_max_pending, gpt.ROLE) == (8, False, 0, "gpt")
    with pytest.raises(RuntimeError, match="chattts_gpt: parameter 'gpt_context' missing from config.pbtxt"):
        GPTParams.read(GPT, _as_triton({"gpt_slots": "8", "max_new_tokens": "2048"}))
    with pytest.raises(RuntimeError, match="parameter 'vocoder_graphs' is invalid"):
        VocoderParams.read(VOCODER, _as_triton({"vocoder_graphs": "yes"}))


def test_every_parameter_is_a_deployment_field_or_worked_out_from_one():
    """One name per setting: a schema field that is no Deployment field is one of the few worked out by
    repo_config.model_params (an engine's size per role, the vocoders it shares a GPU with, ...)."""
    deployment = {f.name for f in dataclasses.fields(rc.Deployment)}
    derived = {"gpt_model", "max_pending", "max_new_tokens", "instances"}
    for schema in SCHEMAS.values():
        for f in dataclasses.fields(schema):
            assert f.name in deployment | derived, f"{schema.__name__}.{f.name}"
    with pytest.raises(TypeError, match="no Deployment field"):
        PreprocessParams.of(rc.Deployment())
    with pytest.raises(TypeError, match="has no parameter bogus"):
        VocoderParams.of(rc.Deployment(), bogus=1)


def test_every_configure_flag_is_named_after_its_deployment_field():
    deployment = {f.name for f in dataclasses.fields(rc.Deployment)}
    flags = [a for a in rc.parser()._actions if a.option_strings and a.dest not in ("help", "repo")]
    assert flags and all(a.dest in deployment and a.option_strings[0] == "--" + a.dest.replace("_", "-") for a in flags)


def test_texts_write_none_as_auto_and_flags_as_digits():
    p = GPTParams(gpt_context=3072, max_new_tokens=2048, gpt_slots=None, gpt_compile=True)
    assert p.texts()["gpt_slots"] == "auto" and p.texts()["gpt_compile"] == "1"
    assert isinstance(p, Params) and GPTParams.read(GPT, _as_triton(p.texts())) == p


def test_model_context_refuses_a_parameter_its_config_does_not_have(tiny_repo):
    from chattts_triton.triton.backend import ModelContext

    assert ModelContext.from_repo(tiny_repo, STREAM, stream_slots=3).params(StreamParams).slots == 3
    with pytest.raises(KeyError, match="has no parameter 'max_slots'"):
        ModelContext.from_repo(tiny_repo, STREAM, max_slots=3)
