"""The python-backend adapter (`backend.make_model`) against a stand-in `triton_python_backend_utils`:
what the real stub would see, without a server."""

from __future__ import annotations

import gc
import json
import threading
import time

import numpy as np
import pytest

from chattts_triton.config import GPT
from chattts_triton.triton import backend
from tests.reliability_util import wait_for


class FakePb:
    """The parts of triton_python_backend_utils the adapter uses; every metric write is recorded
    with the thread that made it (on the real stub each is an IPC round trip holding the GIL)."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self):
        self.writes = []  # (metric name, value, thread name)
        pb = self

        class TritonError(Exception):
            UNAVAILABLE, INVALID_ARG, INTERNAL, CANCELLED = range(4)

            def __init__(self, msg, code=0):
                super().__init__(msg)

        class MetricFamily:
            GAUGE = 1

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels):
                family = self

                class Metric:
                    def set(self, value):
                        pb.writes.append((family.name, value, threading.current_thread().name))

                return Metric()

        class Tensor:
            def __init__(self, name, array):
                self._name, self.array = name, array

            def name(self):
                return self._name

            def as_numpy(self):
                return self.array

        class InferenceResponse:
            def __init__(self, output_tensors=None, error=None):
                self.output_tensors, self.error = output_tensors, error

        self.TritonError, self.MetricFamily = TritonError, MetricFamily
        self.Tensor, self.InferenceResponse = Tensor, InferenceResponse



class FakeRequest:
    def __init__(self, pb, value):
        self.tensors = [pb.Tensor("X", np.array([value])), pb.Tensor("NOT_CONFIGURED", np.array([0]))]
        self.sent = []

    def inputs(self):
        return list(self.tensors)

    def get_response_sender(self):
        request = self

        class Sender:
            def send(self, response=None, flags=0):
                request.sent.append((response, flags))

        return Sender()


class HeldService:
    """Keeps every call until the test answers it."""

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def execute(self, calls):
        with self.lock:
            self.calls.extend(calls)

    def stats(self):
        with self.lock:
            return {"engine_active": len(self.calls)}


@pytest.fixture(autouse=True)
def _collector_as_before():
    """An instance's initialize freezes the process's objects and counts its collections: in a Triton stub that is
    the process's start-up; here it is pytest's process, which gets its collector back after each test."""
    yield
    gc.unfreeze()
    if backend.GC_PAUSES in gc.callbacks:
        gc.callbacks.remove(backend.GC_PAUSES)


def _model(tiny_repo, pb, service):
    cls = backend.make_model(pb, lambda ctx: service)
    model = cls()
    model.initialize({"model_config": json.dumps({"input": [{"name": "X"}], "output": [{"name": "Y"}]}),
                      "model_name": GPT, "model_repository": str(tiny_repo / GPT), "model_version": "1"})
    return model


def test_gauges_are_written_by_the_metrics_thread_only_and_follow_the_in_flight_count(tiny_repo):
    """A request's admission and reply only count (no metric IPC on Triton's or the results thread);
    the metrics thread publishes the in-flight count within INFLIGHT_PUBLISH_S of a change, a few
    writes for many requests, and the service's stats every STATS_PERIOD_S; finalize drains."""
    pb, service = FakePb(), HeldService()
    model = _model(tiny_repo, pb, service)
    def inflight():
        return [v for n, v, _ in pb.writes if n == backend.INFLIGHT_METRIC]
    requests = [FakeRequest(pb, i) for i in range(200)]
    for lo in range(0, 200, 8):  # batches of 8, as Triton's dynamic batcher hands them over
        assert model.execute(requests[lo:lo + 8]) is None
    assert wait_for(lambda: inflight() and inflight()[-1] == 200, 5, 0.01)
    assert wait_for(lambda: ("chattts_engine_active", 200) in [(n, v) for n, v, _ in pb.writes], 5, 0.01)

    def answer(calls):
        for c in calls:
            c.reply({"Y": c.inputs["X"] * 2})
            c.reply({"Y": c.inputs["X"] * 3})  # a service replying twice: the first reply is the one sent

    repliers = [threading.Thread(target=answer, args=(service.calls[k::4],), name=f"results-{k}") for k in range(4)]
    for t in repliers:
        t.start()
    for t in repliers:
        t.join()
    assert wait_for(lambda: inflight()[-1] == 0, 5, 0.01)
    assert all(len(r.sent) == 1 and r.sent[0][1] == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL for r in requests)
    assert [int(r.sent[0][0].output_tensors[0].array[0]) for r in requests] == [2 * i for i in range(200)]
    assert all(set(c.inputs) == {"X"} for c in service.calls)  # only the configured inputs reach the service
    assert {thread for _, _, thread in pb.writes} == {"chattts-metrics"}
    assert len(inflight()) < 40  # not two per request
    model.finalize()  # nothing in flight: returns at once


def test_a_stats_gauge_is_written_when_its_value_changes_only(tiny_repo):
    """Each gauge write is an IPC round trip with the GIL held: the metrics thread sets a stat's
    gauge when its value changed, not every STATS_PERIOD_S."""
    pb, service = FakePb(), HeldService()
    model = _model(tiny_repo, pb, service)
    def active():
        return [v for n, v, _ in pb.writes if n == "chattts_engine_active"]
    time.sleep(6 * backend.STATS_PERIOD_S)  # six periods, one value
    assert active() == [0]
    requests = [FakeRequest(pb, i) for i in range(3)]
    model.execute(requests)
    assert wait_for(lambda: active() == [0, 3], 5, 0.01)
    time.sleep(3 * backend.STATS_PERIOD_S)
    assert active() == [0, 3]
    for c in service.calls:
        c.reply({"Y": c.inputs["X"]})
    model.finalize()


def test_finalize_waits_for_the_requests_in_flight(tiny_repo):
    pb, service = FakePb(), HeldService()
    model = _model(tiny_repo, pb, service)
    requests = [FakeRequest(pb, i) for i in range(3)]
    model.execute(requests)
    done = threading.Event()
    t = threading.Thread(target=lambda: (model.finalize(), done.set()))
    t.start()
    assert not done.wait(0.3)  # three requests unanswered
    for c in service.calls:
        c.reply({"Y": c.inputs["X"]})
    assert done.wait(5) and all(len(r.sent) == 1 for r in requests)
    t.join()


class SlowCloseService(HeldService):
    """close() as a drain that waits: the stream model's codec thread, a preprocess still running."""

    def close(self):
        stuck_in_the_drain()


def stuck_in_the_drain():
    time.sleep(0.8)


def test_a_finalize_that_outlasts_its_bound_writes_every_threads_stack_to_the_log(tiny_repo, capfd, monkeypatch):
    """A drain still running after FINALIZE_STACKS_S puts every thread's stack on stderr (the server's log), so that
    the wait Triton's exit timeout cuts short has a place; a finalize within it writes nothing."""
    monkeypatch.setattr(backend, "FINALIZE_STACKS_S", 0.3)
    pb = FakePb()
    _model(tiny_repo, pb, SlowCloseService()).finalize()
    err = capfd.readouterr().err
    assert "most recent call first" in err and "stuck_in_the_drain" in err, err[-3000:]
    _model(tiny_repo, pb, HeldService()).finalize()
    time.sleep(0.5)  # past the bound: a watchdog left armed would write now
    assert "most recent call first" not in capfd.readouterr().err


def test_every_model_process_writes_its_stacks_to_the_log_on_the_launchers_signal(tiny_repo, capfd):
    """initialize registers STACKS_SIGNAL (the launcher sends it to the stubs of a drain that outlasts half its exit
    timeout): the process's stacks reach stderr, the server's log."""
    import faulthandler
    import os

    from chattts_triton.config import STACKS_SIGNAL

    try:
        model = _model(tiny_repo, FakePb(), HeldService())
        os.kill(os.getpid(), STACKS_SIGNAL)
        time.sleep(0.2)
        err = capfd.readouterr().err
        assert "most recent call first" in err and "test_every_model_process_writes_its_stacks" in err, err[-2000:]
        model.finalize()
    finally:
        faulthandler.unregister(STACKS_SIGNAL)


class SlowStatsService(HeldService):
    """stats() as slow as a CUDA memory-stats read that the process's teardown would interrupt; records when each
    read ran."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def stats(self):
        start = time.monotonic()
        time.sleep(0.15)
        self.reads.append((start, time.monotonic()))
        return super().stats()


def test_finalize_returns_after_the_metrics_threads_last_stats_read(tiny_repo):
    """Teardown follows finalize: a stats read (torch.cuda's) still running then fails in a dying CUDA runtime and
    crashed the stub, so that a SIGTERM'd server exited 1. finalize joins the metrics thread."""
    pb, service = FakePb(), SlowStatsService()
    model = _model(tiny_repo, pb, service)
    assert wait_for(lambda: len(service.reads) >= 3, 5, 0.01)  # publishing every STATS_PERIOD_S
    threads = [t for t in threading.enumerate() if t.name == "chattts-metrics"]
    assert len(threads) == 1
    model.finalize()
    ended = time.monotonic()
    assert not threads[0].is_alive()
    n = len(service.reads)
    time.sleep(2 * backend.STATS_PERIOD_S)
    assert len(service.reads) == n and all(end <= ended for _, end in service.reads)


@pytest.mark.parametrize("publish_s,poll_s,polls", [(backend.INFLIGHT_PUBLISH_S, 0.2, 3)])
def test_the_drain_sees_a_request_before_it_calls_the_server_idle(publish_s, poll_s, polls):
    """serve.quiesce needs `polls` zero readings `poll_s` apart: a request admitted before the first
    shows in the gauge before the last, since the gauge lags by at most `publish_s`."""
    import inspect

    from chattts_triton.launcher import serve

    sig = inspect.signature(serve.quiesce).parameters
    assert (sig["poll_s"].default, sig["quiet_polls"].default) == (poll_s, polls)
    assert publish_s < (polls - 1) * poll_s


def test_package_logs_reach_tritons_log_at_their_level():
    """Records of chattts_triton's loggers go to the stub's pb_utils.Logger: DEBUG as verbose (tritonserver
    --log-verbose 1 shows them: the characters normalisation removed), the others at their level; once per process."""
    import logging

    calls = []

    class Logger:
        log_verbose = staticmethod(lambda m: calls.append(("verbose", m)))
        log_info = staticmethod(lambda m: calls.append(("info", m)))
        log_warn = staticmethod(lambda m: calls.append(("warn", m)))
        log_error = staticmethod(lambda m: calls.append(("error", m)))

    pb = FakePb()
    pb.Logger = Logger
    root = logging.getLogger("chattts_triton")
    handlers, level = list(root.handlers), root.level
    try:
        backend.forward_logs(FakePb())  # a stub without a Logger: nothing changes
        assert root.handlers == handlers
        backend.forward_logs(pb)
        backend.forward_logs(pb)
        assert sum(isinstance(h, backend.TritonLogHandler) for h in root.handlers) == 1
        log = logging.getLogger("chattts_triton.runtime.preprocess")
        log.debug("removed %d", 3)
        log.info("warm")
        log.warning("slow")
        log.error("broken")
        assert calls == [("verbose", "chattts_triton.runtime.preprocess: removed 3"),
                         ("info", "chattts_triton.runtime.preprocess: warm"),
                         ("warn", "chattts_triton.runtime.preprocess: slow"),
                         ("error", "chattts_triton.runtime.preprocess: broken")]
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_start_up_objects_are_frozen_and_the_collectors_pauses_published(tiny_repo):
    """After its service is built, an instance freezes the objects alive (compiled graphs and captured CUDA graphs
    live as long as the process: a full collection would scan them all, stalling the engine) and publishes the
    collector's pauses from then on: their count, summed and longest time."""
    gc.unfreeze()
    pb, service = FakePb(), HeldService()
    model = _model(tiny_repo, pb, service)
    try:
        assert gc.get_freeze_count() > 1000  # pytest's own objects at least
        assert backend.GC_PAUSES in gc.callbacks
        before = model._stats()["gc_pauses"]
        gc.collect()
        s = model._stats()
        assert s["gc_pauses"] >= before + 1 and s["gc_pause_max_seconds"] > 0
        assert s["gc_pause_seconds"] >= s["gc_pause_max_seconds"]
        assert wait_for(lambda: any(n == "chattts_gc_pause_max_seconds" and v > 0 for n, v, _ in pb.writes), 5,
                        0.01)
        assert all(k in backend.STAT_HELP for k in ("gc_pauses", "gc_pause_seconds", "gc_pause_max_seconds"))
    finally:
        model.finalize()
