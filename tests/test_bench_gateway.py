"""bench.gateway end to end, briefly, against the served tiny repository: every table it promises is filled."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e


def test_bench_gateway_measures_both_paths_and_every_encoder(served_tiny, tmp_path):
    from bench.gateway import main
    from gateway.audio import FORMATS

    out = tmp_path / "gw"
    assert main(["--repo", str(served_tiny.model_repository), "--grpc-url", served_tiny.grpc_url, "--out", str(out),
                 "--requests", "3", "--concurrency", "4", "--seconds", "1.5", "--phases", "1", "--encode-repeats", "1",
                 "--tokens", "8"]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["c1_wav"]["direct_p50_ms"] > 0 and res["c1_wav"]["gateway_p50_ms"] > 0
    assert set(res["c1_first_byte"]) == {"pcm", "mp3"}
    tp = res["throughput"]
    assert tp["errors"] == {"direct": 0, "gateway": 0} and tp["direct_rps"] > 0 and tp["gateway_rps"] > 0
    assert tp["gateway_cpu_ms_per_request"] > 0 and len(tp["phase_ratios"]) == 1
    enc = res["encoding"]
    assert set(enc["formats"]) == set(FORMATS)
    assert all(f["decoded_samples"] >= enc["samples"] for f in enc["formats"].values())  # every file decodes whole
    md = out.with_suffix(".md").read_text()
    assert "| concurrency 4, whole wav |" in md and "| mp3 |" in md
