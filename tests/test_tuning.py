"""runtime/tuning.py: inductor's coordinate-descent tuning kept to kernels that write nothing large in place."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from chattts_triton.runtime import tuning


class _Autotuner:
    """Stands in for inductor's CachingAutotuner: records what its own tuning was asked to tune."""

    def __init__(self, arg_names, mutated, fail=False):
        self.fn = SimpleNamespace(arg_names=arg_names)
        self.mutated_arg_names = mutated
        self.inductor_meta = {"kernel_name": "triton_red_fused_test"}
        self.fail = fail
        self.tuned = []

    def coordinate_descent_tuning(self, launcher, *args, **kwargs):
        if self.fail:
            raise RuntimeError("out of resources")
        self.tuned.append(args)
        return SimpleNamespace(config=SimpleNamespace(name="tuned"))


def _launcher():
    return SimpleNamespace(config=SimpleNamespace(name="heuristic"))


@pytest.fixture
def autotuner_class():
    class Patched(_Autotuner):
        pass
    assert tuning.tune_pure_kernels_only(Patched)
    return Patched


def test_written_bytes_counts_only_the_tensors_a_kernel_writes_in_place():
    cache, out, x = torch.zeros(64, 1024), torch.zeros(8), torch.zeros(3, 5)
    assert tuning.written_bytes(["cache", "out", "x", "n"], ["cache", "x"], [cache, out, x, 7]) == (64 * 1024 + 15) * 4
    assert tuning.written_bytes(["cache", "out"], [], [cache, out]) == 0


def test_a_kernel_writing_a_large_buffer_in_place_keeps_its_heuristic_configuration_and_is_not_asked_again(
        autotuner_class, monkeypatch):
    monkeypatch.setattr(tuning, "MAX_CLONED_BYTES", 1024)
    k = autotuner_class(["in_ptr0", "out_ptr0"], ["out_ptr0"])
    launcher = _launcher()
    got = k.coordinate_descent_tuning(launcher, torch.zeros(4), torch.zeros(512))
    assert got is launcher and k.tuned == []
    assert launcher.config.found_by_coordesc  # inductor's `run` asks again only for an unsettled configuration


def test_a_kernel_writing_a_small_buffer_or_nothing_in_place_is_tuned(autotuner_class, monkeypatch):
    monkeypatch.setattr(tuning, "MAX_CLONED_BYTES", 1024)
    scratch = autotuner_class(["in_ptr0", "in_out_ptr0"], ["in_out_ptr0"])
    assert scratch.coordinate_descent_tuning(_launcher(), torch.zeros(512), torch.zeros(16)).config.name == "tuned"
    pure = autotuner_class(["in_ptr0", "out_ptr0"], [])
    assert pure.coordinate_descent_tuning(_launcher(), torch.zeros(512), torch.zeros(512)).config.name == "tuned"
    assert len(scratch.tuned) == len(pure.tuned) == 1


def test_a_kernel_whose_arguments_cannot_be_named_is_left_alone_if_it_writes_any(autotuner_class):
    k = autotuner_class([], ["out_ptr0"])
    launcher = _launcher()
    assert k.coordinate_descent_tuning(launcher, torch.zeros(4)) is launcher and k.tuned == []


def test_a_failed_tuning_keeps_the_heuristic_configuration_and_says_so(autotuner_class, caplog):
    k = autotuner_class(["in_ptr0", "out_ptr0"], [], fail=True)
    launcher = _launcher()
    with caplog.at_level(logging.WARNING, logger=tuning.__name__):
        assert k.coordinate_descent_tuning(launcher, torch.zeros(4), torch.zeros(4)) is launcher
    assert launcher.config.found_by_coordesc
    assert "triton_red_fused_test" in caplog.text and "heuristic configuration" in caplog.text


def test_patching_twice_wraps_once(autotuner_class):
    first = autotuner_class.coordinate_descent_tuning
    assert tuning.tune_pure_kernels_only(autotuner_class)
    assert autotuner_class.coordinate_descent_tuning is first


def test_a_class_without_the_hook_is_not_patched_and_the_one_row_step_is_then_not_tuned(monkeypatch):
    assert not tuning.tune_pure_kernels_only(type("NoHook", (), {}))
    assert tuning.one_row_options("aot_eager") == {}  # only inductor takes the option
    monkeypatch.setattr(tuning, "tune_pure_kernels_only", lambda cls=None: False)
    assert tuning.one_row_options("inductor") == {}


def test_inductor_gets_the_tuning_option_and_its_own_autotuner_is_patched():
    heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    assert tuning.one_row_options("inductor") == {"options": {"coordinate_descent_tuning": True}}
    assert getattr(heuristics.CachingAutotuner.coordinate_descent_tuning, tuning.PATCH_MARK, False)
    import torch._inductor.config as inductor_config
    assert hasattr(inductor_config, "coordinate_descent_tuning")  # the option names a setting this torch has
