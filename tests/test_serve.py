"""The launcher's pure parts (chattts_triton/launcher/serve.py): the admin APIs' restriction and the drain's count.
What it does with a real server is tests/test_reliability.py's (drain, stub watchdog, admin key)."""

from __future__ import annotations

from chattts_triton.config import ENSEMBLE


def test_restriction_is_on_by_default_for_a_non_loopback_host():
    from chattts_triton.launcher import serve

    assert serve.restricted_args("127.0.0.1", False, "k") == []
    args = serve.restricted_args("0.0.0.0", False, "k")
    assert args == [f"--http-restricted-api={serve.RESTRICTED_APIS}:{serve.ADMIN_HEADER}=k",
                    f"--grpc-restricted-protocol={serve.RESTRICTED_APIS}:{serve.ADMIN_HEADER}=k"]
    assert serve.restricted_args("127.0.0.1", True, "k") == args


def test_drain_counts_our_gauges_plus_triton_queues_but_not_the_ensemble():
    from chattts_triton.launcher import serve

    assert serve.ENSEMBLE == ENSEMBLE
    text = "\n".join([
        "# HELP chattts_inflight_requests requests admitted and not yet answered",
        'chattts_inflight_requests{model="chattts_gpt"} 2',
        'chattts_inflight_requests{model="chattts_vocoder"} 0',
        'nv_inference_pending_request_count{model="chattts_vocoder",version="1"} 3',
        'nv_inference_pending_request_count{model="chattts",version="1"} 7',
    ])
    assert serve.parse_inflight(text) == 5
    assert serve.parse_inflight('nv_inference_pending_request_count{model="x",version="1"} 3') is None  # no gauge


class _Server:
    """Stands in for a TritonServer: `returncode` set when the test says it exited."""

    def __init__(self, pid: int = 0):
        self.pid = pid
        self.returncode = None


def _watch_a_stop(monkeypatch, exits_after_s: float, exit_timeout: float) -> list[float]:
    """`watch` of a signalled server that exits `exits_after_s` after its drain began: when it asked the stubs."""
    import threading
    import time
    from pathlib import Path

    from chattts_triton.launcher import serve

    asked, server = [], _Server()
    t0 = time.monotonic()
    monkeypatch.setattr(serve, "quiesce", lambda *a, **k: True)
    monkeypatch.setattr(serve, "ask_stubs_for_stacks", lambda s, waited: asked.append(time.monotonic() - t0))
    threading.Timer(exits_after_s, lambda: setattr(server, "returncode", 0)).start()
    assert serve.watch(server, set(), [15], lambda: None, Path("unused"), exit_timeout) == []
    return asked


def test_a_drain_that_outlasts_half_the_exit_timeout_asks_the_stubs_for_their_stacks_once(monkeypatch):
    asked = _watch_a_stop(monkeypatch, exits_after_s=1.5, exit_timeout=1.0)
    assert len(asked) == 1 and 0.5 <= asked[0] < 1.4, asked


def test_a_drain_within_half_the_exit_timeout_asks_nothing(monkeypatch):
    assert _watch_a_stop(monkeypatch, exits_after_s=0.2, exit_timeout=2.0) == []


def test_the_stubs_asked_write_every_threads_stack_to_their_stderr(monkeypatch):
    """What the stub of a python model does on the launcher's signal (backend.dump_stacks_on_signal), in a process
    of its own: its stacks reach its stderr, the server's log."""
    import subprocess
    import sys
    import time

    from chattts_triton.launcher import serve

    code = ("import sys, time\nfrom chattts_triton.triton.backend import dump_stacks_on_signal\n"
            "assert dump_stacks_on_signal()\nprint('ready', flush=True)\n"
            "def waiting_in_the_drain():\n    time.sleep(30)\nwaiting_in_the_drain()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        monkeypatch.setattr(serve, "python_stubs", lambda server_pid: {proc.pid: ["triton_python_backend_stub"]})
        assert serve.ask_stubs_for_stacks(_Server(pid=1), 30.0) == [proc.pid]
        time.sleep(0.5)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "most recent call first" in err and "waiting_in_the_drain" in err, err[-2000:]
