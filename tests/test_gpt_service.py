"""The GPT model's service (chattts_triton/runtime/gpt.py): its compiled step, and the TorchScript step it falls
back to."""

from __future__ import annotations

import logging

import pytest
import torch

from chattts_triton.runtime.engine import Engine, GenRequest
from tests.engine_util import greedy


@pytest.mark.parametrize("compile_fails", [False, True])
def test_gpt_service_compiles_the_step_or_falls_back_to_torchscript(tiny_repo, monkeypatch, caplog, compile_fails):
    """`compile_step` serves the eager module through torch.compile; if compiling fails at warm-up
    (say, no C compiler in the image) the model still loads, on the exported TorchScript step, and the
    failed engine (its KV cache: GBs on a GPU) is gone, not kept beside the one that serves."""
    import weakref

    from chattts_triton.config import GPT, Arch
    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.triton.repo_config import read_manifest

    man = read_manifest(tiny_repo)
    arch = Arch.from_json(man["arch"])
    monkeypatch.setattr(gpt_runtime, "compile_applies", lambda device: True)  # CPU stands in for CUDA here
    real_warm_up = Engine.warm_up

    def warm_up(self, *args, **kw):
        if compile_fails and self.graph_step is not None:
            raise RuntimeError("inductor: no working C compiler")
        return real_warm_up(self, *args, **kw)

    monkeypatch.setattr(Engine, "warm_up", warm_up)
    engines = []
    real_init = Engine.__init__

    def init(self, *args, **kw):
        engines.append(weakref.ref(self))
        real_init(self, *args, **kw)

    monkeypatch.setattr(Engine, "__init__", init)
    caplog.set_level(logging.INFO)
    svc = gpt_runtime.GPTService(tiny_repo / GPT / "1" / "gpt.pt", arch, torch.device("cpu"), "fp32", max_slots=2,
                              max_context=256, max_new_tokens=32, text_eos_id=man["tokens"]["text_eos_id"],
                              spk_emb_id=man["tokens"]["spk_emb_id"], compile_step=True)
    try:
        assert isinstance(svc.engine.model, torch.jit.ScriptModule) == compile_fails
        assert (svc.engine.graph_step is None) == compile_fails
        assert ("serving the TorchScript step instead" in caplog.text) == compile_fails
        assert len(engines) == 1 + compile_fails and [e() for e in engines if e() is not None] == [svc.engine]
        r = svc.engine.generate(GenRequest(torch.arange(1, 9), greedy(6, 6), None))
        assert r.finish_reason == "max_tokens" and r.tokens.shape == (6, arch.num_vq)
    finally:
        svc.engine.stop()


@pytest.mark.parametrize("failed", ["prefill", "code"])
def test_only_a_failed_decode_graph_sends_a_compiled_engine_back_to_torchscript(tiny_repo, monkeypatch, failed):
    """A warm-up graph that could not be captured: a decode bucket's means the compiled step cannot be
    served as measured (TorchScript instead); a prefill bucket's runs no compiled code and just runs
    eagerly, so the compiled step stays. (CPU has no graphs: the warm-up's outcome is stood in for.)"""
    from chattts_triton.config import GPT, Arch
    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.runtime.engine import CudaGraphs
    from chattts_triton.triton.repo_config import read_manifest

    man = read_manifest(tiny_repo)
    monkeypatch.setattr(gpt_runtime, "compile_applies", lambda device: True)
    real_warm_up = Engine.warm_up

    def warm_up(self, *args, **kw):
        real_warm_up(self, *args, **kw)
        if self.graph_step is not None:
            def ok():
                return None
            self.graphs = CudaGraphs(self, capture=False)
            self.graphs.graphs.update({("prefill", 1, 16): None if failed == "prefill" else ok,
                                       ("code", 1, 128): None if failed == "code" else ok})

    monkeypatch.setattr(Engine, "warm_up", warm_up)
    svc = gpt_runtime.GPTService(tiny_repo / GPT / "1" / "gpt.pt", Arch.from_json(man["arch"]),
                                 torch.device("cpu"), "fp32",
                              max_slots=2, max_context=256, max_new_tokens=32, text_eos_id=man["tokens"]["text_eos_id"],
                              spk_emb_id=man["tokens"]["spk_emb_id"], compile_step=True)
    try:
        assert isinstance(svc.engine.model, torch.jit.ScriptModule) == (failed == "code")
    finally:
        svc.engine.stop()


def test_an_fp8_cache_is_refused_at_load_where_it_cannot_run_naming_the_setting(monkeypatch):
    """kv_cache_dtype fp8 needs a GPU that converts e4m3 in registers (compute capability 8.9) and the compiled
    step: elsewhere the load fails with what to configure, not with a kernel's error at the first request."""
    from chattts_triton.runtime.device import check_kv_cache_supported

    check_kv_cache_supported(torch.device("cpu"), "auto", False)  # the precision's cache runs everywhere
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 runs on GPUs only.*--kv-cache-dtype auto"):
        check_kv_cache_supported(torch.device("cpu"), "fp8", True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9 or later; NVIDIA A100 has 8.0"):
        check_kv_cache_supported(torch.device("cuda"), "fp8", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="needs the compiled step"):
        check_kv_cache_supported(torch.device("cuda"), "fp8", False)
    check_kv_cache_supported(torch.device("cuda"), "fp8", True)


def test_with_an_fp8_cache_a_step_that_fails_to_compile_fails_the_load(tiny_repo, monkeypatch):
    """The TorchScript step the service falls back to cannot read an fp8 cache: a failed compile is the load's
    error, not a fallback that would serve another cache. (CPU stands in for CUDA here.)"""
    from chattts_triton.config import GPT, Arch
    from chattts_triton.runtime import gpt as gpt_runtime
    from chattts_triton.triton.repo_config import read_manifest

    man = read_manifest(tiny_repo)
    monkeypatch.setattr(gpt_runtime, "compile_applies", lambda device: True)
    monkeypatch.setattr(gpt_runtime, "check_kv_cache_supported", lambda *a: None)
    real_warm_up = Engine.warm_up
    caches = []

    def warm_up(self, *args, **kw):
        caches.append(self.cache_dtype)
        if self.graph_step is not None:
            raise RuntimeError("inductor: no working C compiler")
        return real_warm_up(self, *args, **kw)

    monkeypatch.setattr(Engine, "warm_up", warm_up)
    with pytest.raises(RuntimeError, match="no working C compiler"):
        gpt_runtime.GPTService(tiny_repo / GPT / "1" / "gpt.pt", Arch.from_json(man["arch"]), torch.device("cpu"),
                               "fp32", max_slots=2, max_context=256, max_new_tokens=32,
                               text_eos_id=man["tokens"]["text_eos_id"], spk_emb_id=man["tokens"]["spk_emb_id"],
                               compile_step=True, kv_cache_dtype="fp8")
    assert caches == [torch.float8_e4m3fn]  # one engine, the compiled one, and no TorchScript one after it
