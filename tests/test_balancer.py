"""BalancedChatTTSClient: least-outstanding balancing, failover, recovery (fakes), and one e2e run
across two real tritonservers with one stopped mid-run."""

from __future__ import annotations

import asyncio
import threading
import time
import zlib

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from client import (
    AsyncBalancedChatTTSClient,
    BalancedChatTTSClient,
    ChatTTSClient,
    ChatTTSError,
    ChatTTSUnavailableError,
    cli,
)
from client.balancer import parse_urls
from tests.test_client import FakeModel, FakeServers, Sleeps, free_port

URLS = ["a:1", "b:2", "c:3"]


def server_error(status: str) -> InferenceServerException:
    return InferenceServerException(f"scripted {status}", status=f"StatusCode.{status}")


def audio_for(text: str) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(text.encode())).uniform(-1, 1, 50).astype(np.float32)


class FakeEndpoint:
    """A transport for one endpoint. `script` items are consumed per request, in order: an exception
    to raise, or a threading.Event to wait for (a request held in flight). `ready` answers probes."""

    def __init__(self, name: str, script=(), ready: bool = True):
        self.name, self.script, self.ready = name, list(script), ready
        self.texts, self.probes = [], 0
        self.lock = threading.Lock()
        self.in_flight = threading.Semaphore(0)  # released once per request that started

    def infer(self, arrays):
        with self.lock:
            self.texts.append(arrays["TEXT"][0, 0].decode())
            action = self.script.pop(0) if self.script else None
        self.in_flight.release()
        if isinstance(action, threading.Event):
            assert action.wait(10)
        elif isinstance(action, BaseException):
            raise action
        return audio_for(arrays["TEXT"][0, 0].decode())

    def is_ready(self):
        self.probes += 1
        if isinstance(self.ready, BaseException):
            raise self.ready
        return self.ready

    def statistics(self, model):
        return {"name": self.name}

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def balanced(endpoints, **kw):
    kw.setdefault("sleep", Sleeps())
    return BalancedChatTTSClient([f"{e.name}:1" for e in endpoints], transports=endpoints, **kw)


def served_by(endpoints):
    return [len(e.texts) for e in endpoints]


# --- urls ---------------------------------------------------------------------------------------
def test_urls_from_a_list_or_a_comma_separated_string():
    assert parse_urls("a:1, b:2,") == ["a:1", "b:2"]
    assert parse_urls(URLS) == URLS
    bad_urls = [("", "at least one"), ("a:1,a:1", "distinct"), ("grpc://a:1", "without a scheme"), ([3], "HOST:PORT")]
    for bad, match in bad_urls:
        with pytest.raises(ValueError, match=match):
            parse_urls(bad)
    with pytest.raises(ValueError, match="cooldown_s"):
        BalancedChatTTSClient(URLS, cooldown_s=-1, transports=[FakeEndpoint(u) for u in URLS])
    with pytest.raises(ValueError, match="3 transports for 2 urls"):
        BalancedChatTTSClient(URLS[:2], transports=[FakeEndpoint(u) for u in URLS])


def test_cli_builds_a_balanced_client_for_several_urls(monkeypatch, tmp_path):
    built = []

    class Stop(Exception):
        pass

    def record(cls):
        def make(url, **kw):
            built.append((cls, url))
            raise Stop

        return make

    monkeypatch.setattr(cli, "ChatTTSClient", record(ChatTTSClient))
    monkeypatch.setattr(cli, "BalancedChatTTSClient", record(BalancedChatTTSClient))
    for url in ("h1:8001,h2:8001", "h1:8001"):
        with pytest.raises(Stop):
            cli.main(["hi", "-o", str(tmp_path / "x.wav"), "--url", url])
    assert built == [(BalancedChatTTSClient, "h1:8001,h2:8001"), (ChatTTSClient, "h1:8001")]


# --- balancing ----------------------------------------------------------------------------------
def test_ties_go_round_robin():
    eps = [FakeEndpoint(n) for n in "abc"]
    with balanced(eps) as c:
        for i in range(7):
            assert np.array_equal(c.synthesize(f"t{i}", split=False), audio_for(f"t{i}"))
    assert [e.texts for e in eps] == [["t0", "t3", "t6"], ["t1", "t4"], ["t2", "t5"]]


def test_least_outstanding_endpoint_is_chosen():
    gates = [threading.Event() for _ in range(3)]
    eps = [FakeEndpoint(n, [gate]) for n, gate in zip("abc", gates, strict=True)]
    with balanced(eps) as c:
        try:
            _check_least_outstanding(c, eps, gates)
        finally:
            for gate in gates:
                gate.set()


def _check_least_outstanding(c, eps, gates):
    threads = []
    for i, ep in enumerate(eps):  # one held request on each endpoint
        threads.append(threading.Thread(target=c.synthesize, args=(f"held{i}",), kwargs={"split": False}))
        threads[-1].start()
        assert ep.in_flight.acquire(timeout=5)
    assert [s["outstanding"] for s in c.endpoint_stats()] == [1, 1, 1]
    gates[1].set()  # b finishes: now the only idle endpoint
    threads[1].join(5)
    # round robin alone would pick a (after c); the fewest outstanding is b
    c.synthesize("next", split=False)
    c.synthesize("then", split=False)  # b is idle again, a and c still busy
    assert eps[1].texts == ["held1", "next", "then"]
    gates[0].set(), gates[2].set()
    for t in threads:
        t.join(5)
    assert [s["outstanding"] for s in c.endpoint_stats()] == [0, 0, 0]
    assert [s["served"] for s in c.endpoint_stats()] == [1, 3, 1]


# --- failover -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "failure", [server_error("UNAVAILABLE"), ConnectionRefusedError("refused")], ids=["UNAVAILABLE", "refused"]
)
def test_unavailable_or_connection_failure_fails_over_and_marks_down(failure):
    eps = [FakeEndpoint("a", [failure]), FakeEndpoint("b")]
    clock = Clock()
    sleeps = Sleeps()
    with balanced(eps, clock=clock, sleep=sleeps) as c:
        assert np.array_equal(c.synthesize("one", split=False), audio_for("one"))  # a failed, b answered
        assert [e.texts for e in eps] == [["one"], ["one"]]
        a = c.endpoint_stats()[0]
        assert (a["up"], a["failures"], a["served"]) == (False, 1, 0) and "UNAVAILABLE" in a["last_error"]
        for i in range(4):  # within the cool-down everything goes to b, a is not even probed
            c.synthesize(f"t{i}", split=False)
        assert served_by(eps) == [1, 5] and eps[0].probes == 0
    assert sleeps == []  # failover is immediate, no backoff


@pytest.mark.parametrize(
    "failure, status",
    [
        (server_error("INVALID_ARGUMENT"), "INVALID_ARGUMENT"),
        (server_error("INTERNAL"), "INTERNAL"),
        (TimeoutError("slow"), "DEADLINE_EXCEEDED"),
    ],
)
def test_other_errors_are_raised_without_resending(failure, status):
    eps = [FakeEndpoint("a", [failure]), FakeEndpoint("b")]
    with balanced(eps) as c:
        with pytest.raises(ChatTTSError) as e:
            c.synthesize("x", split=False)
        assert e.value.status == status and "a:1" in e.value.message
        assert served_by(eps) == [1, 0]
        assert [s["up"] for s in c.endpoint_stats()] == [True, True]


def test_batch_fails_over_per_item_and_keeps_order():
    eps = [FakeEndpoint("a", [server_error("UNAVAILABLE")]), FakeEndpoint("b"), FakeEndpoint("c")]
    texts = [f"item {i}" for i in range(12)]
    with balanced(eps, max_concurrency=4) as c:
        out = c.synthesize_batch(texts)
    assert all(np.array_equal(o, audio_for(t)) for o, t in zip(out, texts, strict=True))
    assert sum(served_by(eps)) == 12 + 1  # the one failed attempt was re-sent


# --- recovery -----------------------------------------------------------------------------------
def test_down_endpoint_is_probed_after_the_cool_down_and_comes_back():
    eps = [FakeEndpoint("a", [server_error("UNAVAILABLE")], ready=False), FakeEndpoint("b")]
    clock = Clock()
    with balanced(eps, clock=clock, cooldown_s=5.0) as c:
        c.synthesize("fail", split=False)
        clock.now += 4.9
        c.synthesize("early", split=False)
        c.wait_for_probes(5)
        assert eps[0].probes == 0
        clock.now += 0.2  # cool-down over: the next request starts a probe, which fails (not ready)
        c.synthesize("probe1", split=False)
        c.wait_for_probes(5)
        assert eps[0].probes == 1 and not c.endpoint_stats()[0]["up"]
        clock.now += 1.0  # a failed probe restarts the cool-down
        c.synthesize("quiet", split=False)
        c.wait_for_probes(5)
        assert eps[0].probes == 1
        eps[0].ready = True
        clock.now += 5.0
        c.synthesize("probe2", split=False)  # the probe runs in the background
        c.wait_for_probes(5)
        assert eps[0].probes == 2 and c.endpoint_stats()[0]["up"]
        for i in range(4):
            c.synthesize(f"back{i}", split=False)
    assert eps[0].texts[0] == "fail" and eps[1].texts[:4] == ["fail", "early", "probe1", "quiet"]
    assert [sum(t.startswith("back") for t in e.texts) for e in eps] == [2, 2]  # shared again


def test_probe_that_raises_counts_as_not_ready():
    eps = [FakeEndpoint("a", [ConnectionResetError()], ready=ConnectionRefusedError()), FakeEndpoint("b")]
    clock = Clock()
    with balanced(eps, clock=clock, cooldown_s=1.0) as c:
        c.synthesize("x", split=False)
        clock.now += 2
        c.synthesize("y", split=False)
        c.wait_for_probes(5)
        assert eps[0].probes == 1 and [s["up"] for s in c.endpoint_stats()] == [False, True]
        assert c.is_ready()  # b still answers
        assert [s["up"] for s in c.endpoint_stats()] == [False, True]


# --- all down -----------------------------------------------------------------------------------
def test_all_down_is_unavailable_after_the_retries():
    eps = [FakeEndpoint(n, [server_error("UNAVAILABLE")], ready=False) for n in "ab"]
    sleeps = Sleeps()
    with balanced(eps, retries=2, backoff_s=0.5, sleep=sleeps) as c:
        with pytest.raises(ChatTTSUnavailableError) as e:
            c.synthesize("x", split=False)
        assert not c.is_ready()
    assert "all 2 endpoint(s) down" in str(e.value) and "gave up after 3 attempt(s)" in str(e.value)
    assert sleeps == [0.5, 1.0]
    assert served_by(eps) == [1, 1]  # each tried once; the retries found both still not ready
    assert [e.probes for e in eps] == [2 + 1, 2 + 1]  # each retry probed both (still down), then is_ready


def test_when_all_are_down_a_ready_one_is_used_without_waiting_for_the_cool_down():
    eps = [FakeEndpoint(n, [server_error("UNAVAILABLE")]) for n in "abc"]  # each fails once, then recovers
    sleeps, clock = Sleeps(), Clock()
    with balanced(eps, cooldown_s=10.0, retries=0, sleep=sleeps, clock=clock) as c:
        with pytest.raises(ChatTTSUnavailableError, match="all 3 endpoint"):
            c.synthesize("x", split=False)  # a, b, c fail: nothing left for this request
        assert [s["up"] for s in c.endpoint_stats()] == [False, False, False]
        # the next request probes a (ready again) at once instead of failing for the whole cool-down
        assert np.array_equal(c.synthesize("y", split=False), audio_for("y"))
        assert [s["up"] for s in c.endpoint_stats()] == [True, False, False]
        assert [e.probes for e in eps] == [1, 0, 0]
        clock.now += 11  # b and c were not left claimed: their regular probes run after the cool-down
        c.synthesize("z", split=False)
        c.wait_for_probes(5)
        assert [e.probes for e in eps] == [1, 1, 1] and [s["up"] for s in c.endpoint_stats()] == [True, True, True]
    assert eps[0].texts[:2] == ["x", "y"] and sleeps == []


# --- threads ------------------------------------------------------------------------------------
def test_many_threads_one_endpoint_failing_nothing_lost():
    eps = [
        FakeEndpoint("a", [server_error("UNAVAILABLE")] * 3),
        FakeEndpoint("b"),
        FakeEndpoint("c", [ConnectionResetError()]),
    ]
    texts = [f"text {i}" for i in range(200)]
    results = {}

    def worker(k):
        for t in texts[k::8]:
            results[t] = c.synthesize(t, split=False)

    with balanced(eps, cooldown_s=0.0) as c:  # no cool-down: a comes back and fails again, repeatedly
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        c.wait_for_probes(5)
        stats = c.endpoint_stats()
    assert len(results) == 200 and all(np.array_equal(results[t], audio_for(t)) for t in texts)
    assert [s["outstanding"] for s in stats] == [0, 0, 0]
    assert sum(s["served"] for s in stats) == 200
    assert sum(served_by(eps)) == 200 + 4  # each scripted failure was re-sent once


# --- async --------------------------------------------------------------------------------------
class AsyncFakeEndpoint(FakeEndpoint):
    async def infer(self, arrays):
        with self.lock:
            self.texts.append(arrays["TEXT"][0, 0].decode())
            action = self.script.pop(0) if self.script else None
        if isinstance(action, asyncio.Event):
            await action.wait()
        elif isinstance(action, BaseException):
            raise action
        return audio_for(arrays["TEXT"][0, 0].decode())

    async def is_ready(self):
        return FakeEndpoint.is_ready(self)

    async def statistics(self, model):
        return {"name": self.name}

    async def close(self):
        pass


def test_async_twin_balances_fails_over_and_recovers():
    async def main():
        gate = asyncio.Event()
        eps = [
            AsyncFakeEndpoint("a", [gate]),
            AsyncFakeEndpoint("b", [server_error("UNAVAILABLE")]),
            AsyncFakeEndpoint("c"),
        ]
        clock = Clock()
        async with AsyncBalancedChatTTSClient(["a:1", "b:1", "c:1"], transports=eps, clock=clock, cooldown_s=1.0) as c:
            held = asyncio.ensure_future(c.synthesize("held", split=False))
            for _ in range(100):  # let it reach the transport (a few task hops)
                if eps[0].texts:
                    break
                await asyncio.sleep(0)
            assert [s["outstanding"] for s in c.endpoint_stats()] == [1, 0, 0]
            out = await c.synthesize_batch(["p", "q"])  # p: b fails -> c (a is busy); q: c
            assert [np.array_equal(o, audio_for(t)) for o, t in zip(out, "pq", strict=True)] == [True, True]
            assert [s["up"] for s in c.endpoint_stats()] == [True, False, True]
            gate.set()
            assert np.array_equal(await held, audio_for("held"))
            clock.now += 2
            await c.synthesize("r", split=False)
            await c.wait_for_probes()
            assert c.endpoint_stats()[1]["up"] and eps[1].probes == 1
            assert set((await c.inference_statistics()).keys()) == {"a:1", "b:1", "c:1"}
        return eps

    eps = asyncio.run(main())
    assert eps[0].texts[0] == "held" and eps[1].texts == ["p"] and sorted(eps[2].texts[:2]) == ["p", "q"]


# --- the real transports against fake servers ---------------------------------------------------
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_real_transports_fail_over_from_a_dead_port(protocol, servers):
    dead = f"127.0.0.1:{free_port()}"
    with BalancedChatTTSClient([dead, servers.url(protocol)], protocol=protocol, timeout_s=5, retries=0) as c:
        texts = [f"hello {i}" for i in range(6)]
        out = c.synthesize_batch(texts)
        assert all(np.array_equal(o, FakeModel.audio_for(t.encode())) for o, t in zip(out, texts, strict=True))
        dead_stats, live_stats = c.endpoint_stats()
    assert not dead_stats["up"] and "UNAVAILABLE" in dead_stats["last_error"] and dead in dead_stats["last_error"]
    assert live_stats["served"] == 6


def test_real_grpc_transport_fails_over_when_a_server_goes_away():
    first, second = FakeServers(), FakeServers()
    first_running = True
    try:
        with BalancedChatTTSClient([first.grpc_url, second.grpc_url], timeout_s=5, retries=0) as c:
            before = [c.synthesize(f"before {i}", split=False) for i in range(4)]
            assert (len(first.model.requests), len(second.model.requests)) == (2, 2)
            first.stop()
            first_running = False
            after = [c.synthesize(f"after {i}", split=False) for i in range(4)]
            stats = c.endpoint_stats()
    finally:
        if first_running:
            first.stop()
        second.stop()
    expected = [FakeModel.audio_for(f"{w} {i}".encode()) for w in ("before", "after") for i in range(4)]
    assert all(np.array_equal(o, e) for o, e in zip(before + after, expected, strict=True))
    assert [s["up"] for s in stats] == [False, True] and [s["served"] for s in stats] == [2, 6]


# --- e2e: two real servers, one stopped mid-run -------------------------------------------------
E2E_REQUESTS, E2E_THREADS, STOP_AFTER, RESUME_AT = 40, 4, 10, 20
E2E_TOKENS = {"max_new_tokens": 8, "min_new_tokens": 8}  # short, fixed length


def e2e_request(i: int):
    return f"Request number {i}.", {"seed": 1000 + i, "split": False, **E2E_TOKENS}


@pytest.mark.e2e
def test_two_servers_one_stopped_mid_run_no_request_lost(tiny_repo, tmp_path):  # noqa: C901  an e2e race: the stopper and the workers are closures over the run's state
    from chattts_triton.launcher.tritonserver import LOCALHOST, TritonServer, free_ports

    ports = free_ports(6, LOCALHOST)  # distinct ports for both servers, so they can start at once
    servers = [
        TritonServer(tiny_repo, http_port=ports[3 * k], grpc_port=ports[3 * k + 1], metrics_port=ports[3 * k + 2],
                     log_file=tmp_path / f"tritonserver-{k}.log", startup_timeout_s=300)
        for k in range(2)
    ]  # fmt: skip
    try:
        for server in servers:  # from this thread: the servers get SIGTERM when their starting thread ends
            server.start(wait=False)
        for server in servers:
            server.wait_ready()
        doomed, survivor = servers
        for server in servers:  # a server's first request is slow (warm-up); keep that out of the race
            with ChatTTSClient(server.grpc_url) as single:
                single.synthesize("Warm up.", seed=1, split=False, **E2E_TOKENS)
        results, errors = {}, []
        completed = [0]
        stopped = threading.Event()
        at_stop = {}
        next_index = iter(range(E2E_REQUESTS))
        index_lock = threading.Lock()

        with BalancedChatTTSClient([doomed.grpc_url, survivor.grpc_url], timeout_s=60, cooldown_s=0.5) as c:

            def stop_mid_run():
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # STOP_AFTER done, and both servers have answered
                    at_stop["stats"] = c.endpoint_stats()
                    if completed[0] >= STOP_AFTER and all(s["served"] > 0 for s in at_stop["stats"]):
                        break
                    time.sleep(0.01)
                doomed.stop()  # SIGTERM: drains in-flight requests, then the process is gone
                stopped.set()

            def worker():
                while True:
                    with index_lock:
                        i = next(next_index, None)
                    if i is None:
                        return
                    if i >= RESUME_AT:  # the second half runs with the first server gone for sure
                        stopped.wait(60)
                    text, options = e2e_request(i)
                    try:
                        results[i] = c.synthesize(text, **options)
                    except Exception as exc:  # noqa: BLE001  recorded, asserted below
                        errors.append((i, exc))
                    with index_lock:
                        completed[0] += 1

            stopper = threading.Thread(target=stop_mid_run)
            workers = [threading.Thread(target=worker) for _ in range(E2E_THREADS)]
            for t in [stopper, *workers]:
                t.start()
            for t in [stopper, *workers]:
                t.join(120)
            final = c.endpoint_stats()

        assert errors == [] and sorted(results) == list(range(E2E_REQUESTS))  # no request lost
        assert stopped.is_set() and doomed.returncode is not None
        served_before_stop = [s["served"] for s in at_stop["stats"]]
        assert all(n > 0 for n in served_before_stop), at_stop["stats"]  # both servers took requests
        # stopped before the second half was sent (on a busy box the slower server's first answer may come
        # only as the first half ends: then nothing was in flight at the stop, and the second half still fails over)
        assert sum(served_before_stop) <= RESUME_AT
        doomed_final, survivor_final = final
        assert doomed_final["failures"] >= 1 and not doomed_final["up"], final  # failover happened
        assert doomed_final["served"] + survivor_final["served"] == E2E_REQUESTS
        assert survivor_final["served"] >= E2E_REQUESTS - RESUME_AT

        with ChatTTSClient(survivor.grpc_url) as single:  # the same requests, one server, one at a time
            for i in range(E2E_REQUESTS):
                text, options = e2e_request(i)
                expected = single.synthesize(text, **options)
                assert results[i].shape == expected.shape and results[i].size > 0, i
                assert np.allclose(results[i], expected, atol=1e-5), i
    finally:
        for server in servers:
            server.stop()
