"""The GPT engine's cumulative counters, in one place.

`Engine.stats()` reports them, each as `engine_<field>` (seconds rounded to the µs), beside the gauges it
reads off its state (running, waiting, free pages, ...); the Triton backend publishes them all as
`chattts_engine_*` gauges (`triton/backend.py` STAT_HELP says what each means). Only the engine's loop
thread writes them; readers on other threads see each value as of some recent step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineStats:
    # decode steps: busy time = step + prefill seconds; mean batch = step_rows / steps (with overlap, a row that the
    # step before takes to max_tokens is not counted in the next one, which runs it for nothing)
    steps: int = 0
    step_rows: int = 0
    step_seconds: float = 0.0  # the loop's time in decode steps: launch and bookkeeping (wall per step = this / steps)
    # of step_seconds: the step's launch plus the wait for its flags on the host (without overlap, launch to the
    # step's host sync; with it, ~0 while the host is behind the GPU); the rest is host bookkeeping
    step_device_seconds: float = 0.0
    # CUDA, every GPU_TIMING_EVERY-th step: the step's span on the GPU's own clock (events around its launch).
    # Set beside step_device_seconds it separates a slow GPU (kernels, other processes' time slices) from a
    # host that comes back late (the launch, or the GIL held by another thread)
    step_gpu_seconds: float = 0.0
    step_gpu_samples: int = 0
    # the same sampled steps, where replayed from a graph, on events the graph records itself
    # (graphs.graph_events): the GPU's span of the replay alone, without the host's launch around it
    step_graph_seconds: float = 0.0
    step_graph_samples: int = 0
    # every GIL_PROBE_EVERY-th step: how long the engine thread waits to take the GIL back once it lets it
    # go (a `time.sleep(0)` right after the step's host sync: Linux's timer slack uncontended, long enough for
    # a waiting thread to take the GIL, as it does during a host sync; a release of a few µs is mostly taken
    # back first). Each torch call, graph replay and host sync lets the GIL go; while the process's other
    # threads (Triton's requests, replies) hold it, the engine waits up to the interpreter's switch interval
    # each time. A GPU clock read through events recorded from Python includes such waits too
    gil_wait_seconds: float = 0.0
    gil_wait_samples: int = 0
    # running rows' cadence: from one decode step's end to the next's, where rows of the first run on into the
    # second (not after an idle wait, nor from a step whose rows all ended). On CUDA on the GPU's clock (an event
    # after every step), on the CPU on the host's (its ops are synchronous). What runs between two steps (a prefill,
    # a resume, the host's bookkeeping, other processes' time slices) lengthens it; the largest is the worst stall
    # a running stream or utterance met (since start-up's warm-up, `Engine.restart_step_gaps`)
    step_gaps: int = 0
    step_gap_seconds: float = 0.0
    step_gap_max_seconds: float = 0.0
    # batched prefills run, the prompts they admitted and their wall time
    prefill_seconds: float = 0.0
    prefills: int = 0
    prefill_rows: int = 0
    # running rows cancelled (a client gone, a barge-in): slots released, the seconds from each cancel() to its
    # release (sum and largest), and releases after more than one decode step had begun since the cancel (bound: 0)
    cancel_releases: int = 0
    cancel_release_seconds: float = 0.0
    cancel_release_max_seconds: float = 0.0
    cancel_release_late: int = 0
    # requests suspended for want of KV pages, and resumed
    preemptions: int = 0
    resumes: int = 0

    def report(self) -> dict[str, float]:
        """Each counter as `engine_<name>`; seconds rounded to the µs."""
        out: dict[str, float] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f"engine_{f.name}"] = round(v, 6) if isinstance(v, float) else v
        return out
