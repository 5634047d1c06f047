"""50 ModelDeployments x 3 regions at once: all Ready, and then the operator stays quiet."""

from __future__ import annotations

import collections
import json
import pathlib
import time

import pytest
from operator_e2e import (
    Kube,
    cluster_env,
    is_ready,
    model_deployment,
    operator_requests,
    wait_until,
)

FLEETS = 50
REGIONS = {"us-east": 1, "eu-west": 1, "ap-south": 1}
STEADY_WINDOW = 60.0  # seconds of quiet in which the operator's requests are counted
# The Lease is renewed every 5 s (12 a minute); anything else in steady state would be polling.
MOST_STEADY_REQUESTS = 15


def ready_count(kube: Kube, namespace: str) -> int:
    return sum(is_ready(md) for md in kube.items("modeldeployments", namespace))


@pytest.mark.all_gpus
def test_fifty_deployments_in_three_regions_become_ready_and_stay_quiet(
    installed, operator, namespace, capsys
):
    audit = pathlib.Path(cluster_env()["STATE_DIR"], "logs", "audit.jsonl")
    fleets = [model_deployment(f"model-{i:02d}", REGIONS) for i in range(FLEETS)]
    started = time.monotonic()
    installed.apply(fleets, namespace)
    wait_until(
        f"all {FLEETS} to be Ready",
        lambda: ready_count(installed, namespace) == FLEETS,
        timeout=240,
        every=1.0,
    )
    took = time.monotonic() - started
    pods = installed.items("pods", namespace)
    assert len(pods) == FLEETS * len(REGIONS)
    assert all(p["status"]["phase"] == "Running" for p in pods)

    time.sleep(5)  # the last status writes and events land
    seen = {r["auditID"] for r in operator_requests(audit)}
    time.sleep(STEADY_WINDOW)
    steady = [r for r in operator_requests(audit) if r["auditID"] not in seen]
    kinds = collections.Counter(f"{r['verb']} {r['objectRef'].get('resource', '')}" for r in steady)
    figures = {
        "fleets": FLEETS,
        "regions": len(REGIONS),
        "seconds_to_ready": round(took, 1),
        "steady_window_seconds": STEADY_WINDOW,
        "steady_requests": len(steady),
        "steady_requests_by_kind": dict(kinds),
    }
    with capsys.disabled():
        print(f"\noperator scale: {json.dumps(figures)}")
    assert len(steady) <= MOST_STEADY_REQUESTS, kinds
