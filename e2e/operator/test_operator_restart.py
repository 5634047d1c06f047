"""Operators dying mid-reconcile, and two replicas at once: no duplicates, no fighting, convergence."""

from __future__ import annotations

import collections
import signal
import time

from operator_e2e import Kube, is_ready, lease_holder, model_deployment, wait_until

OWNER = "serving.meridian.dev/deployment"
REGIONS = {"us-east": 1, "eu-west": 1, "ap-south": 1}


def all_ready(kube: Kube, namespace: str, count: int) -> bool:
    items = kube.items("modeldeployments", namespace)
    return len(items) == count and all(is_ready(md) for md in items)


def assert_exactly_what_the_specs_ask(kube: Kube, namespace: str, names: list[str]) -> None:
    deployments = kube.items("deployments", namespace)
    assert sorted(d["metadata"]["name"] for d in deployments) == sorted(
        f"{name}-{region}" for name in names for region in REGIONS
    )
    # One ReplicaSet per Deployment: no template was written twice with different content.
    replicasets = collections.Counter(
        rs["metadata"]["ownerReferences"][0]["name"] for rs in kube.items("replicasets", namespace)
    )
    assert set(replicasets.values()) == {1}, replicasets
    pods = [p for p in kube.items("pods", namespace) if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == len(names) * sum(REGIONS.values())
    for deployment in deployments:
        owners = deployment["metadata"]["ownerReferences"]
        assert len(owners) == 1 and owners[0]["kind"] == "ModelDeployment"


def test_killed_mid_reconcile_a_restarted_operator_converges_without_duplicates(
    installed, operators, operator, namespace
):
    names = [f"fleet-{i:02d}" for i in range(20)]
    installed.apply([model_deployment(name, REGIONS) for name in names], namespace)
    # Kill as soon as it has started creating children, before it can have finished.
    wait_until(
        "the operator to start creating children",
        lambda: installed.items("deployments", namespace),
        30,
        every=0.05,
    )
    operators.stop(operator, signal.SIGKILL)
    ready_at_kill = sum(is_ready(md) for md in installed.items("modeldeployments", namespace))
    assert ready_at_kill < len(names), "the kill came after the work was done: nothing was tested"

    restarted = operators.start("e2e-restarted")
    # The killed leader never released its Lease: the new one waits it out (15 s), then acts.
    wait_until(
        "the restarted operator to lead", lambda: lease_holder(installed) == "e2e-restarted", 60
    )
    wait_until("every fleet to be Ready", lambda: all_ready(installed, namespace, len(names)), 90)
    assert_exactly_what_the_specs_ask(installed, namespace, names)
    assert restarted.poll() is None


def test_a_standby_replica_waits_and_takes_over(installed, operators, operator, namespace):
    standby = operators.start("e2e-standby")
    wait_until(
        "the standby to wait for the Lease", lambda: "waiting to lead" in operators.log(standby), 30
    )
    leader = lease_holder(installed)
    assert leader != "e2e-standby"

    installed.apply(model_deployment("one", REGIONS), namespace)
    wait_until("one to be Ready", lambda: all_ready(installed, namespace, 1), 60)
    assert "the spec" not in operators.log(standby) and "created" not in operators.log(standby)

    # A clean stop hands the Lease over at once.
    started = time.monotonic()
    operators.stop(operator)
    wait_until("the standby to lead", lambda: lease_holder(installed) == "e2e-standby", 30)
    takeover = time.monotonic() - started
    installed.apply(model_deployment("two", REGIONS), namespace)
    wait_until(
        "two to be Ready under the new leader", lambda: all_ready(installed, namespace, 2), 60
    )
    assert_exactly_what_the_specs_ask(installed, namespace, ["one", "two"])
    assert takeover < 15
