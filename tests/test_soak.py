"""Soak (`make soak`): a long run at 70 % of saturation on the tiny CPU server, via loadtest.soak.

Duration from env CHATTTS_SOAK_SECONDS (default 1800). Targets: RSS growth over the second half
≤ 100 MB, no failed request, p99 of the last window within 10 % of the first.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest

from chattts_triton.launcher.serve import Launched
from loadtest.soak import TARGETS, soak, summary

pytestmark = [pytest.mark.e2e, pytest.mark.soak]


def test_soak_at_70_percent_of_saturation(tiny_assets, tmp_path):
    from tests.conftest import export_repo

    duration = float(os.environ.get("CHATTTS_SOAK_SECONDS", "1800"))
    out = os.environ.get("CHATTTS_SOAK_OUT")
    repo = export_repo(tiny_assets, tmp_path / "repo", gpt_slots=4)
    with Launched(repo, tmp_path / "server.log") as server:  # the launcher, as the container runs it
        r = soak(server.grpc_url, server.server_pid, duration, load_fraction=0.7, frames=60,
                 calibrate_s=min(30.0, duration / 6), sample_s=10.0, concurrency=8)
        r.restarts = server.restarts
    assert r.restarts == 0, server.output[-10:]
    print("\n" + summary(r))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "soak.json"), "w") as f:
            json.dump(asdict(r), f, indent=2)
    assert r.completed > 0
    assert r.failed == TARGETS["failed"], r.errors
    assert r.rss_growth_second_half_mb <= TARGETS["rss_growth_mb"]
    assert r.p99_drift <= TARGETS["p99_drift"]
