"""The gateway's Prometheus metrics (`GET /metrics`), in a registry of its own per app. With several worker
processes (`python -m gateway --workers N`) each writes its values to files in PROMETHEUS_MULTIPROC_DIR
(prometheus_client's multiprocess mode) and `GET /metrics`, whichever worker answers it, sums them all."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own name for it

# seconds: a request of a few pieces on a CPU takes seconds, a first chunk on a GPU tens of milliseconds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("chattts_gateway_requests", "speech requests answered, by format, mode and HTTP status",
                                ["format", "mode", "status"], registry=r)
        self.inflight = Gauge("chattts_gateway_inflight", "speech requests being answered", registry=r,
                              multiprocess_mode="livesum")  # the live workers' sum
        self.latency = Histogram("chattts_gateway_request_seconds", "from the request to its last byte",
                                 ["format", "mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram("chattts_gateway_first_byte_seconds",
                                    "from the request to the first audio byte handed to the server (streams)",
                                    ["format"], buckets=LATENCY_BUCKETS, registry=r)
        self.audio_seconds = Counter("chattts_gateway_audio_seconds", "seconds of audio sent", ["format"], registry=r)
        self.encode_seconds = Counter("chattts_gateway_encode_seconds", "time spent encoding audio", ["format"],
                                      registry=r)
        self.pieces = Counter("chattts_gateway_pieces", "Triton requests made for speech requests (pieces of text)",
                              registry=r)
        self.errors = Counter("chattts_gateway_triton_errors", "failed Triton calls, by canonical status",
                              ["status"], registry=r)
        self.stream_aborts = Counter("chattts_gateway_stream_aborts",
                                     "streamed responses ended before their audio was complete, by reason "
                                     "(client_gone, "
                                     "a Triton status in lower case, internal)", ["reason"], registry=r)

    def exposition(self) -> bytes:
        """The text `GET /metrics` answers: this app's registry, or every worker's (multiprocess mode)."""
        if os.environ.get(MULTIPROC_ENV):
            every = CollectorRegistry()
            MultiProcessCollector(every)
            return generate_latest(every)
        return generate_latest(self.registry)

    def close(self) -> None:
        """A worker's end: its live gauges (requests in flight) leave the sum (files of a worker that crashed stay)."""
        if os.environ.get(MULTIPROC_ENV):
            mark_process_dead(os.getpid())
