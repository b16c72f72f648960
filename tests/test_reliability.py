"""Reliability of the served `chattts` ensemble (issue #7): validation gaps, overload, lifecycle, security.

Validation runs against the shared tiny server; everything destructive (overload, SIGTERM, killed
stub, restricted APIs) starts its own server on a copy of the tiny repository.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from chattts_triton.config import GPT, LIMITS, SAMPLE_RATE, VOCODER, samples_for_codes
from chattts_triton.launcher.tritonserver import LOCALHOST
from chattts_triton.model.speaker import sample_random_speaker
from chattts_triton.triton import repo_config as rc
from tests.reliability_util import (
    contract_inputs,
    grpc_synth,
    http_status,
    private_server,
    raw_input,
    shm_regions,
    stub_processes,
    wait_for,
)
from tests.test_streaming import contract as stream_contract
from tests.test_streaming import grpc_stream

pytestmark = pytest.mark.e2e

NAN, INF = float("nan"), float("inf")
TONE = (0.3 * np.sin(2 * np.pi * 220 * np.arange(SAMPLE_RATE) / SAMPLE_RATE)).astype(np.float32)


def _invalid(e: InferenceServerException) -> bool:
    return "INVALID_ARG" in str(e.status()) or str(e.status()) == "400"


# --- 1. validation gaps (complements BAD in test_e2e_serving.py) ---------------------------------
def _speaker_of_wrong_width():
    return sample_random_speaker(1, 768)  # the full model's width; the tiny server's GPT is narrower


BAD_MORE = [
    (dict(TEXT="\t\n  \r"), "TEXT"),
    (dict(TEXT="你" * (LIMITS.max_text_chars + 1)), "TEXT"),
    (dict(TEXT=b"ok \xc3\x28 bad"), "UTF-8"),
    (dict(TEXT=b"\xed\xa0\x80 surrogate"), "TEXT"),  # UTF-8-encoded lone surrogate is invalid UTF-8
    (dict(TEXT="bell\x07"), "TEXT"),
    (dict(TEXT="ansi \x1b[31m red"), "TEXT"),
    (dict(TEXT="hi [uv_break"), "TEXT"),
    (dict(TEXT="hi uv_break]"), "TEXT"),
    (dict(TEXT="hi [[uv_break]]"), "TEXT"),
    (dict(TEXT="hi [laugh_]"), "laugh_"),
    (dict(TEXT="hi [Stts]"), "TEXT"),  # reserved token: the server adds it itself
    (dict(TEXT="hi", PROMPT="[speed_5"), "PROMPT"),
    (dict(TEXT="hi", PROMPT="speed_5"), "PROMPT"),
    (dict(TEXT="hi", PROMPT="[speed_5]\x00"), "PROMPT"),
    (dict(TEXT="hi", SPEAKER=b"\xff\xfe"), "SPEAKER"),
    (dict(TEXT="hi", SPEAKER="蘁" * 50), "SPEAKER"),
    (dict(TEXT="hi", SPEAKER=_speaker_of_wrong_width()), "SPEAKER"),
    (dict(TEXT="hi", SPEAKER_TEXT=""), "SPEAKER_TEXT"),
    (dict(TEXT="hi", SPEAKER_SAMPLE="", SPEAKER_AUDIO=TONE), "SPEAKER"),
    (dict(TEXT="hi", TEMPERATURE=-0.5), "TEMPERATURE"),
    (dict(TEXT="hi", TEMPERATURE=INF), "TEMPERATURE"),
    (dict(TEXT="hi", TEMPERATURE=-INF), "TEMPERATURE"),
    (dict(TEXT="hi", TOP_P=0.0), "TOP_P"),
    (dict(TEXT="hi", TOP_P=-0.1), "TOP_P"),
    (dict(TEXT="hi", TOP_P=NAN), "TOP_P"),
    (dict(TEXT="hi", TOP_P=INF), "TOP_P"),
    (dict(TEXT="hi", TOP_K=-3), "TOP_K"),
    (dict(TEXT="hi", REPETITION_PENALTY=NAN), "REPETITION_PENALTY"),
    (dict(TEXT="hi", REPETITION_PENALTY=INF), "REPETITION_PENALTY"),
    (dict(TEXT="hi", REPETITION_PENALTY=0.0), "REPETITION_PENALTY"),
    (dict(TEXT="hi", MAX_NEW_TOKENS=0), "MAX_NEW_TOKENS"),
    (dict(TEXT="hi", MAX_NEW_TOKENS=-1), "MAX_NEW_TOKENS"),
    (dict(TEXT="hi", MAX_NEW_TOKENS=LIMITS.max_new_tokens + 1), "MAX_NEW_TOKENS"),
    (dict(TEXT="hi", MIN_NEW_TOKENS=-1), "MIN_NEW_TOKENS"),
    (dict(TEXT="hi", MIN_NEW_TOKENS=LIMITS.max_new_tokens + 1), "MIN_NEW_TOKENS"),
    (dict(TEXT="hi", SPEAKER_AUDIO=np.full(4800, np.nan, np.float32)), "SPEAKER_AUDIO"),
    (dict(TEXT="hi", SPEAKER_AUDIO=np.where(np.arange(SAMPLE_RATE) == 777, -np.inf, TONE).astype(np.float32)),
     "SPEAKER_AUDIO"),
    (dict(TEXT="hi", SPEAKER_AUDIO=np.zeros(100, np.float32)), "SPEAKER_AUDIO"),
    (dict(TEXT="hi", SPEAKER_AUDIO=np.zeros(int(LIMITS.max_reference_audio_seconds * SAMPLE_RATE) + 1, np.float32)),
     "SPEAKER_AUDIO"),
    # REFINE_* floats are checked whether or not REFINE_TEXT is on
    *[(dict(TEXT="hi", REFINE_TEXT=refine, **{name: v}), name)
      for name in ("REFINE_TEMPERATURE", "REFINE_TOP_P", "REFINE_REPETITION_PENALTY")
      for v, refine in ((NAN, False), (INF, True), (-1.0, False))],
    (dict(TEXT="hi", REFINE_TOP_K=0), "REFINE_TOP_K"),
    (dict(TEXT="hi", REFINE_MAX_NEW_TOKENS=0, REFINE_TEXT=True), "REFINE_MAX_NEW_TOKENS"),
    (dict(TEXT="hi", REFINE_PROMPT="[nope]"), "REFINE_PROMPT"),
]


@pytest.mark.parametrize("values,word", BAD_MORE, ids=[f"{w}{i}" for i, (_, w) in enumerate(BAD_MORE)])
def test_more_bad_inputs_get_invalid_argument_naming_the_input(served_tiny, values, word):
    with pytest.raises(InferenceServerException) as e:
        grpc_synth(served_tiny.grpc_url, **values)
    assert _invalid(e.value), (e.value.status(), e.value.message())
    assert word.lower() in e.value.message().lower()


def _grpc_raw(server, tensors):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return c.infer("chattts", tensors)
    finally:
        c.close()


def _text(n_rows: int, n_cols: int = 1, module=grpcclient):
    arr = np.array([[b"hi"] * n_cols] * n_rows, dtype=object)
    return raw_input(module, "TEXT", arr, "BYTES")


WRONG_SHAPES_AND_TYPES = {
    "text_1x2": lambda m: [_text(1, 2, m)],
    "text_int32": lambda m: [raw_input(m, "TEXT", np.array([[1]], np.int32), "INT32")],
    "temperature_int32": lambda m: [_text(1, 1, m), raw_input(m, "TEMPERATURE", np.array([[1]], np.int32), "INT32")],
    "temperature_fp64": lambda m: [_text(1, 1, m), raw_input(m, "TEMPERATURE", np.array([[0.3]], np.float64), "FP64")],
    "top_k_fp32": lambda m: [_text(1, 1, m), raw_input(m, "TOP_K", np.array([[2.0]], np.float32), "FP32")],
    "seed_1x3": lambda m: [_text(1, 1, m), raw_input(m, "SEED", np.array([[1, 2, 3]], np.int64), "INT64")],
    "no_batch_dim": lambda m: [raw_input(m, "TEXT", np.array([b"hi"], dtype=object), "BYTES")],
    "unknown_input": lambda m: [_text(1, 1, m), raw_input(m, "VOLUME", np.array([[1.0]], np.float32), "FP32")],
    "no_text": lambda m: [raw_input(m, "SEED", np.array([[1]], np.int64), "INT64")],
    "batch_over_max": lambda m: [_text(rc.Deployment().max_batch_size + 1, 1, m)],
    "batch_2_text_1": lambda m: [_text(2, 1, m), raw_input(m, "SEED", np.array([[1]], np.int64), "INT64")],
}


@pytest.mark.parametrize("case", sorted(WRONG_SHAPES_AND_TYPES))
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_wrong_dtypes_and_shapes_are_rejected_before_any_work(served_tiny, case, protocol):
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(served_tiny.grpc_url if protocol == "grpc" else served_tiny.http_url)
    with pytest.raises(InferenceServerException) as e:
        client.infer("chattts", WRONG_SHAPES_AND_TYPES[case](module))
    assert _invalid(e.value), (e.value.status(), e.value.message())
    assert client.is_server_live()


def test_a_batch_of_two_utterances_is_one_clean_error(served_tiny):
    """max_batch_size > 0 lets a client send [2, 1]: the contract is one utterance per request."""
    tensors = [_text(2), raw_input(grpcclient, "MAX_NEW_TOKENS", np.array([[2], [2]], np.int32), "INT32")]
    with pytest.raises(InferenceServerException) as e:
        _grpc_raw(served_tiny, tensors)
    assert _invalid(e.value) and "exactly one value" in e.value.message()


def test_extreme_but_valid_sampling_values_give_finite_audio(served_tiny):
    for kw in (dict(TEMPERATURE=100.0), dict(TEMPERATURE=1e-6), dict(TOP_P=1e-6), dict(TOP_K=1 << 30),
               dict(REPETITION_PENALTY=100.0), dict(TOP_K=1, TOP_P=1.0), dict(SEED=-(1 << 63)),
               dict(SEED=(1 << 63) - 1)):
        audio = grpc_synth(served_tiny.grpc_url, TEXT="你好", MAX_NEW_TOKENS=6, MIN_NEW_TOKENS=6, **{"SEED": 1, **kw})
        assert audio.shape == (samples_for_codes(6),) and np.isfinite(audio).all(), kw


# --- 2. overload ---------------------------------------------------------------------------------
FRAMES = 400  # long enough that a request is clearly slower than a rejection on the tiny CPU model
OVERLOAD_FRAMES = 1800  # ≈ 38 s of audio: an admitted request clearly outlasts a rejection on the faster engine


@pytest.fixture(scope="module")
def small_server(tiny_assets, tmp_path_factory):
    """2 engine slots, at most 4 generations in flight, short Triton queues with a timeout; two
    instances of each batching model (preprocess, vocoder), so the drain counts across instances."""
    server = private_server(tiny_assets, tmp_path_factory.mktemp("small"), gpt_slots=2, gpt_max_pending=4,
                            max_queue_size=8, queue_timeout_us=5_000_000, gpt_context=2048, instances=2)
    with server:
        yield server


def test_overload_rejects_excess_quickly_and_completes_admitted(small_server):
    url = small_server.grpc_url
    req = dict(TEXT="你好", SEED=1, MAX_NEW_TOKENS=OVERLOAD_FRAMES, MIN_NEW_TOKENS=OVERLOAD_FRAMES)
    t0 = time.monotonic()
    grpc_synth(url, **req)
    normal_s = time.monotonic() - t0
    n = 2 * 4  # twice what the GPT admits (running + waiting)

    def one(i):
        t = time.monotonic()
        try:
            audio = grpc_synth(url, **{**req, "SEED": i})
            return "ok", time.monotonic() - t, audio
        except InferenceServerException as e:
            return e.status(), time.monotonic() - t, e.message()

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    ok = [r for r in results if r[0] == "ok"]
    rejected = [r for r in results if r[0] != "ok"]
    timings = ([(r[0][-11:], round(r[1], 2)) for r in results], round(normal_s, 2))
    assert len(ok) >= 4 and rejected, timings
    for status, _, msg in rejected:
        assert status == "StatusCode.UNAVAILABLE" and "busy" in msg, (status, msg)
    # a rejection costs the preprocess step only: well under what an admitted request takes
    slowest_rejection = max(r[1] for r in rejected)
    assert slowest_rejection < 0.5 * min(normal_s, min(r[1] for r in ok)), timings
    for _, _, audio in ok:
        assert audio.shape == (samples_for_codes(OVERLOAD_FRAMES),) and np.isfinite(audio).all()
    print(f"\noverload: alone {normal_s:.2f}s; {len(ok)} ok in "
          f"{min(r[1] for r in ok):.2f}-{max(r[1] for r in ok):.2f}s, "
          f"{len(rejected)} UNAVAILABLE in ≤ {slowest_rejection:.3f}s")

    # HTTP: 503 while saturated, then the server serves again
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(one, 100 + i) for i in range(4)]
        time.sleep(0.3 * normal_s)
        h = httpclient.InferenceServerClient(small_server.http_url)
        with pytest.raises(InferenceServerException) as e:
            h.infer("chattts", contract_inputs(httpclient, **req))
        assert str(e.value.status()) == "503", (e.value.status(), e.value.message())
        assert all(f.result()[0] == "ok" for f in busy)
    assert np.isfinite(grpc_synth(url, TEXT="好", MAX_NEW_TOKENS=3)).all()


BURST = 512  # the engine's admission bound in the burst tests: the burst refused on the H200 (512 clients from idle)


@pytest.fixture(scope="module")
def burst_server(tiny_assets, tmp_path_factory):
    """An engine of BURST slots admitting BURST generations, every queue at its default (from that bound)."""
    server = private_server(tiny_assets, tmp_path_factory.mktemp("burst"), gpt_slots=BURST, gpt_max_pending=BURST,
                            gpt_context=256)
    with server:
        yield server


def _burst(url: str, n: int, frames: int, seed0: int = 0):
    """n requests sent together over one asyncio gRPC channel, as a load tool's clients start together:
    per request ("ok", samples, seconds) or (status, message, seconds)."""
    import asyncio

    import tritonclient.grpc.aio as aioclient

    async def run():
        client = aioclient.InferenceServerClient(url)

        async def one(i):
            t0 = time.monotonic()
            try:
                r = await client.infer("chattts", contract_inputs(aioclient, TEXT="你好", SEED=seed0 + i,
                                                                  MAX_NEW_TOKENS=frames, MIN_NEW_TOKENS=frames))
                return "ok", r.as_numpy("AUDIO").shape[-1], time.monotonic() - t0
            except InferenceServerException as e:
                return str(e.status()), e.message(), time.monotonic() - t0

        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await client.close()

    return asyncio.run(run())


def _in_engine(server) -> int:
    """Generations the GPT engine holds (running + waiting), from its gauges."""
    _, body = http_status(server.metrics_url.split("//", 1)[1].split("/", 1)[0], "/metrics")
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
                   if line.startswith(("chattts_engine_active{", "chattts_engine_waiting{"))
                   and f'model="{GPT}"' in line))


def test_a_burst_of_what_the_engine_admits_from_idle_is_all_served(burst_server):
    """From idle, BURST requests at once, all finishing in the same step (equal lengths): each Triton queue
    on the way (the preprocess model's, the GPT's, then the vocoder's, which they all reach together) holds
    them; none is refused below the engine's bound."""
    frames = 16
    results = _burst(burst_server.grpc_url, BURST, frames)
    refused = [r for r in results if r[0] != "ok"]
    assert not refused, f"{len(refused)} of {BURST} refused, e.g. {refused[:2]}"
    assert {r[1] for r in results} == {samples_for_codes(frames)}
    print(f"\nburst of {BURST}: all served in {max(r[2] for r in results):.1f} s")


def test_one_past_the_bound_is_refused_fast_naming_it_and_the_admitted_finish(burst_server):
    import threading

    # long enough to hold the engine full while the extra request comes, even when a loaded host spreads the burst's
    # admissions out (too few frames and the first requests finish before the last are admitted)
    frames = 120
    box = []
    t = threading.Thread(target=lambda: box.append(_burst(burst_server.grpc_url, BURST, frames, seed0=1000)))
    t.start()
    seen = []
    try:
        full = wait_for(lambda: seen.append(_in_engine(burst_server)) or seen[-1] >= BURST, 120, 0.2)
        if full:
            (status, message, took), = _burst(burst_server.grpc_url, 1, frames, seed0=5000)
    finally:
        t.join(600)
    if not full:  # say what the burst met: refusals, errors, or admissions spread out so that some had finished
        outcomes = collections.Counter(r[0] for r in box[0]) if box else "the burst did not return"
        pytest.fail(f"the engine never held {BURST}: at most {max(seen)} (last {seen[-10:]}); the burst: {outcomes}, "
                    f"e.g. {[r for r in box[0] if r[0] != 'ok'][:2] if box else ''}")
    assert status == "StatusCode.UNAVAILABLE" and f"{BURST} generations in flight" in message, (status, message)
    results = box[0]
    assert all(r[0] == "ok" and r[1] == samples_for_codes(frames)
               for r in results), [r for r in results if r[0] != "ok"][:2]
    assert took < 0.5 * min(r[2] for r in results), (took, min(r[2] for r in results))
    print(f"\none past {BURST}: UNAVAILABLE in {took:.3f} s; the {BURST} admitted took "
          f"{min(r[2] for r in results):.1f}-"
          f"{max(r[2] for r in results):.1f} s")


def test_max_new_tokens_beyond_the_context_is_invalid(small_server):
    with pytest.raises(InferenceServerException) as e:
        grpc_synth(small_server.grpc_url, TEXT="你好", MAX_NEW_TOKENS=2048)  # + the prompt > the 2048-token context
    assert _invalid(e.value) and "context" in e.value.message()


def test_every_instance_publishes_its_own_gauges_and_the_engine_counters_advance(small_server):
    """Instances of one model are separate processes: each needs its own series (else the drain
    reads one instance's in-flight count for all). The GPT engine's counters follow its work."""
    import urllib.request

    from loadtest.sweep import ENGINE_COUNTERS, engine_window, parse_engine_counters

    def text():
        with urllib.request.urlopen(small_server.metrics_url, timeout=5) as r:
            return r.read().decode()

    lines = [line for line in text().splitlines() if line.startswith("chattts_inflight_requests{")]
    assert lines and all('instance="' in line for line in lines)
    vocoder = {line.split('instance="')[1].split('"')[0] for line in lines if f'model="{VOCODER}"' in line}
    assert len(vocoder) == 2
    time.sleep(0.6)  # the gauges refresh every 0.25 s: let earlier requests' counts land first
    before = parse_engine_counters(text())
    assert list(before) and all(set(c) == set(ENGINE_COUNTERS) for c in before.values())
    t0 = time.monotonic()
    grpc_synth(small_server.grpc_url, TEXT="你好", SEED=1, MAX_NEW_TOKENS=40, MIN_NEW_TOKENS=40)
    time.sleep(0.6)  # the gauges refresh every 0.25 s
    after = parse_engine_counters(text())
    steps = sum(c["engine_steps"] for c in after.values()) - sum(c["engine_steps"] for c in before.values())
    assert steps >= 39  # the first token comes from the prefill
    w = engine_window(before, after, time.monotonic() - t0)
    assert w["engine_batch"] == pytest.approx(1.0) and 0 < w["engine_step_ms"] and 0 < w["engine_busy"] <= 1
    assert 0 < w["engine_step_device_ms"] <= w["engine_step_ms"]


# --- 3. lifecycle --------------------------------------------------------------------------------
class ServeCLI:
    """`python -m chattts_triton.serve` as a child process (the production entry point)."""

    def __init__(self, repo, tmp, *args, env=None, exit_timeout=60):
        from chattts_triton.launcher.tritonserver import free_ports

        self.http, self.grpc, self.metrics = free_ports(3, LOCALHOST)
        self.log = tmp / "server.log"
        self.out = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chattts_triton.serve", "--repo", str(repo), "--http-port", str(self.http),
             "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics), "--log-file", str(self.log),
             "--exit-timeout", str(exit_timeout), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)
        for line in self.proc.stdout:
            self.out.append(line)
            if line.startswith("tritonserver pid") or self.proc.poll() is not None:
                break
        assert self.proc.poll() is None and self.out[-1].startswith("tritonserver pid"), "".join(self.out)
        self.server_pid = int(self.out[-1].split()[2])

    http_url = property(lambda self: f"{LOCALHOST}:{self.http}")
    grpc_url = property(lambda self: f"{LOCALHOST}:{self.grpc}")

    def stop(self, timeout_s=120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rest, _ = self.proc.communicate(timeout=timeout_s)
        self.out.append(rest or "")
        return self.proc.returncode

    def text(self) -> str:
        return "".join(self.out)


def _group_stub_regions(pgid):
    class _S:
        pid = pgid
    return [s["region"] for s in stub_processes(_S()).values()]


def test_sigterm_under_load_drains_then_exits_zero_without_leaking_shm(tiny_assets, tmp_path):
    from tests.conftest import export_repo

    repo = export_repo(tiny_assets, tmp_path / "repo", gpt_slots=2)
    cli = ServeCLI(repo, tmp_path)
    try:
        regions = _group_stub_regions(cli.server_pid)
        assert len(regions) == len(rc.MODELS) + 1 and all(r in shm_regions() for r in regions)  # + chattts_stream
        req = dict(TEXT="你好", MAX_NEW_TOKENS=FRAMES, MIN_NEW_TOKENS=FRAMES)
        pool = concurrent.futures.ThreadPoolExecutor(6)
        futures = [pool.submit(grpc_synth, cli.grpc_url, SEED=i, **req) for i in range(5)]
        stream = pool.submit(grpc_stream, cli, stream_contract(n=FRAMES, seed=9))
        time.sleep(1.0)  # all admitted (5 > 2 slots: some wait in the engine)
        t0 = time.monotonic()
        cli.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(InferenceServerException) as e:  # nothing new is admitted
            grpc_synth(cli.grpc_url, TEXT="你好", MAX_NEW_TOKENS=2)
        assert e.value.status() == "StatusCode.UNAVAILABLE" and "shutting down" in e.value.message()
        chunks, error = grpc_stream(cli, stream_contract(n=2))  # nor a new stream
        assert not chunks and "UNAVAILABLE: server is shutting down" in str(error)
        for f in futures:  # every admitted request completes
            audio = f.result(timeout=120)
            assert audio.shape == (samples_for_codes(FRAMES),) and np.isfinite(audio).all()
        chunks, error = stream.result(timeout=120)  # and so does the stream in flight, every chunk of it
        assert (error is None and np.concatenate(chunks).shape == (samples_for_codes(FRAMES),
                                                                   )), (str(error), error.status() if error else None,
                                                                        len(chunks))
        assert wait_for(lambda: http_status(cli.http_url, "/v2/health/ready")[0] != 200, 30)
        code = cli.proc.wait(timeout=60 + 15)
        print(f"\nexit {code} {time.monotonic() - t0:.1f}s after SIGTERM")
        assert code == 0, cli.text()
        pool.shutdown()
    finally:
        cli.stop()
    assert not set(regions) & set(shm_regions())


def test_plain_triton_sigterm_fails_ensemble_requests_in_flight(tiny_assets, tmp_path):
    """Why serve.py drains first: Triton 2.51 alone rejects an in-flight ensemble request at its next
    step once signalled. If this starts passing requests, a newer Triton fixed it: drop the workaround."""
    server = private_server(tiny_assets, tmp_path, gpt_slots=2, exit_timeout_s=60)
    with server:
        # still generating when the signal comes (FRAMES can finish within the 1 s wait on a fast box)
        req = dict(TEXT="你好", MAX_NEW_TOKENS=1500, MIN_NEW_TOKENS=1500)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # a deadline: where the generation outlasts the exit timeout (a loaded box), Triton 2.51 can crash in its
            # own exit and never answer; the test then fails instead of hanging
            futures = [pool.submit(grpc_synth, server.grpc_url, 110, SEED=i, **req) for i in range(2)]
            time.sleep(1.0)
            server.send_signal(signal.SIGTERM)
            errors = []
            for f in futures:
                with pytest.raises(InferenceServerException) as e:
                    f.result(timeout=120)
                errors.append(e.value.message())
        assert all("Server is stopping" in m for m in errors), errors
        assert server.wait(timeout=75) == 0


def _outcome(fn, *args, **kw):
    try:
        return bool(np.isfinite(fn(*args, **kw)).all())
    except InferenceServerException as e:
        return f"{e.status()}: {e.message()[:150]}"


LONG = dict(TEXT="你好", MAX_NEW_TOKENS=1500, MIN_NEW_TOKENS=1500)  # still generating when the stub is killed


def test_plain_triton_does_not_restart_a_killed_stub(tiny_assets, tmp_path):
    """What Triton 2.51 does when the chattts_gpt stub dies (why serve.py watches its stubs): the
    requests it held hang until the client's deadline, later ones fail at once with INTERNAL "Stub
    process ... is not healthy", no new stub is started, and the server stays live and ready."""
    server = private_server(tiny_assets, tmp_path, gpt_slots=2, exit_timeout_s=3)  # what it held never ends
    with server:
        url = server.grpc_url
        gpt = next(s for s in stub_processes(server).values() if s["model"] == GPT)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_outcome, grpc_synth, url, 10, SEED=i, **LONG) for i in range(2)]
            time.sleep(1.5)
            os.kill(gpt["pid"], signal.SIGKILL)
            held = [f.result() for f in held]
        after = [_outcome(grpc_synth, url, 10, TEXT="你好", MAX_NEW_TOKENS=4) for _ in range(2)]
        live = http_status(server.http_url, "/v2/health/live")[0]
        ready = http_status(server.http_url, "/v2/health/ready")[0]
        new = next((s for s in stub_processes(server).values() if s["model"] == GPT), None)
        print(f"\nheld: {held}\nafter: {after}\nlive {live} ready {ready} new stub {new}")
        regions = [s["region"] for s in stub_processes(server).values()] + [gpt["region"]]
    leaked = set(regions) & set(shm_regions())
    serve_module().remove_shm_regions(leaked)  # TritonServer.stop() leaves them after a dead stub
    print(f"shm regions left by the stop: {len(leaked)} of {len(regions)}")
    assert all("DEADLINE_EXCEEDED" in h for h in held), held
    assert all("INTERNAL" in a and "not healthy" in a for a in after), after
    assert live == 200 and ready == 200 and new is None


def test_serve_exits_when_a_stub_dies_so_the_supervisor_restarts_it(tiny_assets, tmp_path):
    from tests.conftest import export_repo

    repo = export_repo(tiny_assets, tmp_path / "repo", gpt_slots=2)
    cli = ServeCLI(repo, tmp_path)
    try:
        class _S:
            pid = cli.server_pid
        stubs = stub_processes(_S())
        regions = [s["region"] for s in stubs.values()]
        gpt = next(s for s in stubs.values() if s["model"] == GPT)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_outcome, grpc_synth, cli.grpc_url, 60, SEED=i, **LONG) for i in range(2)]
            time.sleep(1.5)
            t0 = time.monotonic()
            os.kill(gpt["pid"], signal.SIGKILL)
            code = cli.proc.wait(timeout=30)
            took = time.monotonic() - t0
            held = [f.result() for f in held]
        print(f"\nserve exited {code} {took:.1f}s after the kill; held: {held}")
        assert code == serve_module().STUB_DIED_EXIT
        assert all(h is not True and "UNAVAILABLE" in h for h in held), held  # failed fast, not at the deadline
        assert took < 20
        assert http_status(cli.http_url, "/v2/health/live")[0] is None  # the whole server is gone
    finally:
        cli.stop()
    assert not set(regions) & set(shm_regions())
    assert "died" in cli.text()


def serve_module():
    from chattts_triton.launcher import serve

    return serve


# --- 4. security defaults ------------------------------------------------------------------------
def _non_loopback_ip():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _reachable(host, port) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def test_default_binding_is_loopback_and_model_control_is_off(served_tiny):
    cmd = served_tiny.command()
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}={LOCALHOST}" in cmd
    assert "--model-control-mode=none" in cmd
    ip = _non_loopback_ip()
    for port in (served_tiny.http_port, served_tiny.grpc_port, served_tiny.metrics_port):
        assert _reachable(LOCALHOST, port)
        if ip:
            assert not _reachable(ip, port), (ip, port)
    for action in ("load", "unload"):
        status, body = http_status(served_tiny.http_url, f"/v2/repository/models/chattts/{action}", "POST", b"{}")
        assert status is not None and status >= 400, (status, body)
    g = grpcclient.InferenceServerClient(served_tiny.grpc_url)
    with pytest.raises(InferenceServerException):
        g.unload_model("chattts")
    assert g.is_model_ready("chattts")


def test_serve_cli_restricts_admin_apis_behind_a_key(tiny_repo, tmp_path):
    from chattts_triton.launcher import serve

    key_file = tmp_path / "admin.key"
    log = tmp_path / "server.log"
    env = {**os.environ, "CHATTTS_ADMIN_KEY_FILE": str(key_file)}
    env.pop("CHATTTS_ADMIN_KEY", None)
    from chattts_triton.launcher.tritonserver import free_ports

    ports = [str(p) for p in free_ports(3, LOCALHOST)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "chattts_triton.serve", "--repo", str(tiny_repo), "--http-port", ports[0],
         "--grpc-port", ports[1], "--metrics-port", ports[2], "--log-file", str(log), "--restrict-apis"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if "ready" in line and "pid" in line or proc.poll() is not None:
                break
        assert proc.poll() is None, "".join(out)
        key = key_file.read_text().strip()
        assert len(key) >= 32 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        url = f"{LOCALHOST}:{ports[0]}"
        header = {serve.ADMIN_HEADER: key}
        for path, method, body in (("/v2/systemsharedmemory/status", "GET", None), ("/v2/logging", "GET", None),
                                   ("/v2/trace/setting", "GET", None), ("/v2/repository/index", "POST", b"{}")):
            denied, _ = http_status(url, path, method, body)
            allowed, _ = http_status(url, path, method, body, headers=header)
            wrong, _ = http_status(url, path, method, body, headers={serve.ADMIN_HEADER: "x" + key})
            assert (denied not in (200, None) and wrong not in (200, None)
                    and allowed == 200), (path, denied, wrong, allowed)
        g = grpcclient.InferenceServerClient(f"{LOCALHOST}:{ports[1]}")
        with pytest.raises(InferenceServerException):
            g.get_system_shared_memory_status()
        assert g.get_system_shared_memory_status(headers={serve.GRPC_ADMIN_HEADER: key}) is not None
        # inference is open
        assert np.isfinite(grpc_synth(f"{LOCALHOST}:{ports[1]}", TEXT="你好", MAX_NEW_TOKENS=3)).all()
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)
        out.append(rest or "")
    assert proc.returncode == 0, "".join(out)
    assert key not in "".join(out) and key not in log.read_text(errors="replace")


