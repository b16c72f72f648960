"""Locust load test of the `chattts` Triton ensemble.

Users: `TritonGrpcUser` (tritonclient.grpc on gevent) and `TritonHttpUser` (tritonclient.http, which is
geventhttpclient underneath). Each is a closed loop: one request in flight per user, no think time.
Every request is reported to Locust (request_type "grpc"/"http", name "<model> <length bucket>",
response_length = audio samples * 4); at test stop the TTS figures (audio seconds, real-time factor,
failures by Triton status) are printed when Locust quits and, with --tts-stats-out, written as JSON.

Streaming users `TritonGrpcStreamUser` / `TritonHttpStreamUser` (`ChatTTSClient.stream` on the decoupled
--tts-stream-model; gRPC stream / HTTP server-sent events) report three entries per request:
"stream first chunk" (time to the first audio), "stream chunk gap" (one per later chunk: time since
the previous one) and "stream total" (the whole request, its failures, response_length = samples * 4);
the TTS summary adds their percentiles and how many streams would have stalled a player that starts
at the first chunk.

    locust -f loadtest/locustfile.py --headless -u 4 -r 1 -t 60s --host 127.0.0.1:8001 TritonGrpcUser

or `python -m loadtest.run` (see there). Options: --tts-model, --tts-stream-model, --tts-corpus,
--tts-max-new-tokens, --tts-min-new-tokens, --tts-seed, --tts-timeout (per request; per chunk for
streams), --tts-stats-out (also as CHATTTS_* env variables).
"""

# Order matters: locust monkey-patches the standard library with gevent on import, and gRPC must be
# switched to gevent before any channel exists. Nothing here imports torch.
import locust  # noqa: F401, I001  imported first, for its gevent monkey-patching (see above)
from locust import User, constant, events, task
from locust.runners import WorkerRunner

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # locust only adds this file's folder

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from client.client import DEFAULT_URLS, ChatTTSClient
from client.contract import (
    MODEL,
    SAMPLE_RATE,
    STREAM_MODEL,
    audio_from_result,
    build_inputs,
    requested_outputs,
    to_infer_inputs,
)
from client.errors import to_chattts_error
from loadtest.corpus import DEFAULT_CORPUS, length_bucket, load_corpus
from loadtest.tts_stats import TTSStats, format_summary, write_json

TTS = TTSStats()
_state = {"started": None, "wall_s": None, "corpus": None, "rng": random.Random()}


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    g = parser.add_argument_group("chattts")
    g.add_argument("--tts-model", default=MODEL, env_var="CHATTTS_MODEL", help="Triton model name")
    g.add_argument("--tts-stream-model", default=STREAM_MODEL, env_var="CHATTTS_STREAM_MODEL",
                   help="decoupled model of the streaming users")  # fmt: skip
    g.add_argument("--tts-corpus", default=str(DEFAULT_CORPUS), env_var="CHATTTS_CORPUS",
                   help="utterances, one per line")
    g.add_argument("--tts-max-new-tokens", type=int, default=None, env_var="CHATTTS_MAX_NEW_TOKENS",
                   help="MAX_NEW_TOKENS of every request (with --tts-min-new-tokens: force a length)")  # fmt: skip
    g.add_argument("--tts-min-new-tokens", type=int, default=None, env_var="CHATTTS_MIN_NEW_TOKENS")
    g.add_argument("--tts-seed", type=int, default=None, env_var="CHATTTS_SEED",
                   help="SEED of every request; also makes the order of utterances reproducible")  # fmt: skip
    g.add_argument("--tts-timeout", type=float, default=300.0, env_var="CHATTTS_TIMEOUT_S", help="seconds per request")
    g.add_argument("--tts-stats-out", default="", env_var="CHATTTS_TTS_STATS_OUT",
                   help="write the TTS summary JSON here")


@events.init.add_listener
def _on_init(environment, **_):
    opts = environment.parsed_options
    if opts is None:  # used as a library without a command line
        return
    _state["corpus"] = load_corpus(opts.tts_corpus)
    _state["rng"] = random.Random(opts.tts_seed)


@events.test_start.add_listener
def _on_test_start(environment, **_):
    TTS.reset()
    _state["started"] = time.monotonic()


@events.report_to_master.add_listener
def _on_report_to_master(client_id, data, **_):
    data["chattts_tts"] = TTS.drain()


@events.worker_report.add_listener
def _on_worker_report(client_id, data, **_):
    TTS.merge(data.get("chattts_tts"))


@events.test_stop.add_listener
def _on_test_stop(environment, **_):
    if _state["started"] is not None:
        _state["wall_s"] = time.monotonic() - _state["started"]


@events.quitting.add_listener
def _on_quitting(environment, **_):
    # At quitting, not test_stop: a master has then received the workers' last reports.
    if isinstance(environment.runner, WorkerRunner) or _state["started"] is None:
        return  # the master reports the merged figures
    summary = TTS.summary(wall_s=_state.get("wall_s"))
    print(format_summary(summary), flush=True)
    opts = environment.parsed_options
    if opts is not None and opts.tts_stats_out:
        write_json(opts.tts_stats_out, summary)


class _TritonUser(User):
    abstract = True
    wait_time = constant(0)
    protocol = ""
    module = None

    def on_start(self):
        opts = self.environment.parsed_options
        self.model = opts.tts_model if opts else MODEL
        self.timeout_s = opts.tts_timeout if opts else 300.0
        self.options = {
            "max_new_tokens": opts.tts_max_new_tokens if opts else None,
            "min_new_tokens": opts.tts_min_new_tokens if opts else None,
            "seed": opts.tts_seed if opts else None,
        }
        self.url = (self.host or DEFAULT_URLS[self.protocol]).split("://", 1)[-1].rstrip("/")
        self.client = self.make_client()

    def on_stop(self):
        self.client.close()

    def make_client(self):
        raise NotImplementedError

    def next_text(self) -> str:
        return _state["rng"].choice(_state["corpus"] or load_corpus())


class _TritonUnaryUser(_TritonUser):
    abstract = True

    def infer(self, inputs):
        raise NotImplementedError

    @task
    def synthesize(self):
        text = self.next_text()
        inputs = to_infer_inputs(self.module, build_inputs(text, self.options))
        samples, error = 0, None
        start = time.perf_counter()
        try:
            samples = audio_from_result(self.infer(inputs)).size
        except Exception as exc:  # noqa: BLE001  every failure is reported, none kills the user
            error = to_chattts_error(exc, self.protocol)
        elapsed = time.perf_counter() - start
        self.environment.events.request.fire(
            request_type=self.protocol,
            name=f"{self.model} {length_bucket(text)}",
            response_time=elapsed * 1000.0,
            response_length=samples * 4,
            exception=error,
            context={"text_chars": len(text)},
        )
        if error is None:
            TTS.record_success(elapsed, samples)
        else:
            TTS.record_failure(error.status)


class TritonGrpcUser(_TritonUnaryUser):
    protocol = "grpc"
    module = grpcclient

    def make_client(self):
        return grpcclient.InferenceServerClient(self.url)

    def infer(self, inputs):
        return self.client.infer(
            self.model, inputs, outputs=requested_outputs(grpcclient), client_timeout=self.timeout_s
        )


class TritonHttpUser(_TritonUnaryUser):
    protocol = "http"
    module = httpclient

    def make_client(self):
        return httpclient.InferenceServerClient(
            self.url, connection_timeout=min(self.timeout_s, 10.0), network_timeout=self.timeout_s
        )

    def infer(self, inputs):
        return self.client.infer(self.model, inputs, outputs=requested_outputs(httpclient))


class _TritonStreamUser(_TritonUser):
    """Streams each utterance through `ChatTTSClient.stream` (one request, no retries)."""

    abstract = True
    FIRST, GAP, TOTAL = "stream first chunk", "stream chunk gap", "stream total"

    def make_client(self):
        opts = self.environment.parsed_options
        self.model = opts.tts_stream_model if opts else STREAM_MODEL
        return ChatTTSClient(self.url, protocol=self.protocol, stream_model=self.model, timeout_s=self.timeout_s,
                             retries=0)

    def _fire(self, name: str, seconds: float, length: int = 0, error=None, **context) -> None:
        self.environment.events.request.fire(
            request_type=self.protocol, name=name, response_time=seconds * 1000.0,
            response_length=length, exception=error, context=context,
        )  # fmt: skip

    @task
    def stream(self):
        text = self.next_text()
        samples, error, gaps, stalled = 0, None, [], False
        start = time.perf_counter()
        first = last = None
        try:
            for chunk in self.client.stream(text, split=False, **self.options):
                now = time.perf_counter()
                if first is None:
                    first = now
                    self._fire(self.FIRST, now - start, chunk.size * 4)
                else:
                    gaps.append(now - last)
                    self._fire(self.GAP, now - last, chunk.size * 4)
                    # a player started at the first chunk has run dry if the audio so far is shorter than the wait
                    stalled = stalled or now > first + samples / SAMPLE_RATE
                samples += chunk.size
                last = now
        except Exception as exc:  # noqa: BLE001  every failure is reported, none kills the user
            error = to_chattts_error(exc, self.protocol)
        elapsed = time.perf_counter() - start
        self._fire(self.TOTAL, elapsed, samples * 4, error, text_chars=len(text), bucket=length_bucket(text))
        if error is None:
            TTS.record_success(elapsed, samples)
            TTS.record_stream(None if first is None else first - start, gaps, stalled)
        else:
            TTS.record_failure(error.status)


class TritonGrpcStreamUser(_TritonStreamUser):
    protocol = "grpc"


class TritonHttpStreamUser(_TritonStreamUser):
    protocol = "http"
