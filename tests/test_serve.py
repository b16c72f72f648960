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
