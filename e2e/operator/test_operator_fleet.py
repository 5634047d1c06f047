"""A fleet's life on the real control plane: created, degraded, broken and healed, changed, deleted."""

from __future__ import annotations

import time

import pytest
from operator_e2e import Kube, condition, is_ready, model_deployment, read_example, wait_until

OWNER = "serving.meridian.dev/deployment"
REGION = "serving.meridian.dev/region"


def md(kube: Kube, namespace: str, name: str) -> dict:
    return kube.json("get", "md", name, "-n", namespace)


def ready(kube: Kube, namespace: str, name: str) -> dict | None:
    current = md(kube, namespace, name)
    return current if is_ready(current) else None


def children(kube: Kube, namespace: str, name: str, kinds: str = "deploy,svc,cm") -> dict:
    found = kube.json("get", kinds, "-n", namespace, "-l", f"{OWNER}={name}")["items"]
    return {(c["kind"], c["metadata"]["name"]): c for c in found}


def events(kube: Kube, namespace: str, name: str) -> list[tuple[str, str]]:
    found = kube.items("events", namespace)
    return [
        (e["reason"], e["message"])
        for e in found
        if e["involvedObject"]["kind"] == "ModelDeployment" and e["involvedObject"]["name"] == name
    ]


@pytest.fixture
def model_volume(installed: Kube, namespace: str):
    """The PersistentVolumeClaim `models` the three-region example reads its weights from."""
    volume = f"models-{namespace}"
    installed.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {
                    "capacity": {"storage": "10Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "hostPath": {"path": "/srv/models"},
                    "storageClassName": "",
                    "claimRef": {"namespace": namespace, "name": "models"},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "models", "namespace": namespace},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "resources": {"requests": {"storage": "10Gi"}},
                    "storageClassName": "",
                    "volumeName": volume,
                },
            },
        ]
    )
    yield "models"
    installed("delete", "pv", volume, "--wait=false", check=False)


def test_three_regions_become_ready_with_pods_only_in_their_region(
    installed, operator, namespace, model_volume
):
    example = read_example("three-regions.yaml")
    name = example["metadata"]["name"]
    started = time.monotonic()
    installed.apply(example, namespace)
    current = wait_until("the example to be Ready", lambda: ready(installed, namespace, name), 60)
    took = time.monotonic() - started

    nodes = {n["metadata"]["name"]: n for n in installed.json("get", "nodes")["items"]}
    pods = installed.items("pods", namespace, f"{OWNER}={name}")
    assert sorted(p["metadata"]["labels"][REGION] for p in pods) == sorted(
        ["us-east"] * 2 + ["eu-west"] * 2 + ["ap-south"]
    )
    for pod in pods:
        node = nodes[pod["spec"]["nodeName"]]
        region = node["metadata"]["labels"]["topology.kubernetes.io/region"]
        assert region == pod["metadata"]["labels"][REGION]
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == [model_volume]

    # Owner references clean up; no finalizer can leave the resource stuck if the operator is gone.
    assert not current["metadata"].get("finalizers")
    status = current["status"]
    assert (status["replicas"], status["readyReplicas"]) == (5, 5)
    assert [(r["name"], r["phase"], r["readyReplicas"]) for r in status["regions"]] == [
        ("us-east", "Ready", 2),
        ("eu-west", "Ready", 2),
        ("ap-south", "Ready", 1),
    ]
    row = installed("get", "md", name, "-n", namespace, "--no-headers").split()
    assert row[:6] == [name, "smollm2-135m-instruct", "us-east,eu-west,ap-south", "5", "5", "True"]

    told = events(installed, namespace, name)
    reasons = {reason for reason, _ in told}
    assert {"Created", "RegionReady", "Ready"} <= reasons, told
    created = f"region ap-south: created ConfigMap {name}-ap-south-engine, Service {name}-ap-south, Deployment {name}-ap-south"
    assert ("Created", created) in told
    assert took < 60


@pytest.mark.all_gpus
def test_a_region_short_of_gpus_is_degraded_and_named(installed, operator, namespace):
    # eu-west has 8 nodes of 8 GPUs: nine 8-GPU workers cannot all fit.
    body = model_deployment(
        "big", {"us-east": 1, "eu-west": 9, "ap-south": 1}, resources={"gpus": 8}
    )
    installed.apply(body, namespace)

    def degraded():
        current = md(installed, namespace, "big")
        return current if condition(current, "Degraded").get("status") == "True" else None

    current = wait_until("eu-west to be reported Degraded", degraded, 60)
    regions = {r["name"]: r for r in current["status"]["regions"]}
    assert regions["eu-west"]["phase"] == "Degraded"
    assert "cannot be scheduled" in regions["eu-west"]["message"]
    assert "Insufficient nvidia.com/gpu" in regions["eu-west"]["message"]
    assert condition(current, "Degraded")["message"].startswith("region eu-west Degraded")
    assert condition(current, "Ready")["status"] == "False"
    wait_until(
        "us-east and ap-south to be Ready",
        lambda: all(
            r["phase"] == "Ready"
            for r in md(installed, namespace, "big")["status"]["regions"]
            if r["name"] != "eu-west"
        ),
        30,
    )
    pending = [
        p
        for p in installed.items("pods", namespace, f"{OWNER}=big,{REGION}=eu-west")
        if p["status"]["phase"] == "Pending"
    ]
    assert pending
    assert "RegionDegraded" in {r for r, _ in events(installed, namespace, "big")}


def test_children_heal_change_and_go_with_the_deployment(installed, operator, namespace):
    installed.apply(
        model_deployment("chat", {"us-east": 1, "eu-west": 1, "ap-south": 1}), namespace
    )
    wait_until("chat to be Ready", lambda: ready(installed, namespace, "chat"), 60)
    before = children(installed, namespace, "chat")
    assert len(before) == 9

    # Deleted children come back.
    installed("delete", "deployment", "chat-eu-west", "-n", namespace)
    installed("delete", "service", "chat-us-east", "-n", namespace)
    wait_until(
        "the deleted Deployment and Service to come back",
        lambda: len(children(installed, namespace, "chat")) == 9,
        30,
    )
    wait_until("chat to be Ready again", lambda: ready(installed, namespace, "chat"), 60)

    # An edit to a field the operator sets is put back.
    installed("scale", "deployment", "chat-ap-south", "--replicas=4", "-n", namespace)
    wait_until(
        "the operator to put replicas back to 1",
        lambda: (
            installed.json("get", "deployment", "chat-ap-south", "-n", namespace)["spec"][
                "replicas"
            ]
            == 1
        ),
        30,
    )
    assert "Restored" in {r for r, _ in events(installed, namespace, "chat")}

    # Scaling in the spec converges.
    patch = '{"spec": {"regions": [{"name": "us-east", "replicas": 3}, {"name": "eu-west", "replicas": 1}, {"name": "ap-south", "replicas": 1}]}}'
    installed("patch", "md", "chat", "-n", namespace, "--type=merge", "-p", patch)
    current = wait_until(
        "chat to be Ready at 5 replicas", lambda: ready(installed, namespace, "chat"), 60
    )
    assert current["status"]["readyReplicas"] == 5
    assert len(installed.items("pods", namespace, f"{OWNER}=chat,{REGION}=us-east")) == 3

    # Removing a region removes exactly its children.
    kept = {k: v["metadata"]["uid"] for k, v in children(installed, namespace, "chat").items()}
    patch = '{"spec": {"regions": [{"name": "us-east", "replicas": 3}, {"name": "ap-south", "replicas": 1}]}}'
    installed("patch", "md", "chat", "-n", namespace, "--type=merge", "-p", patch)
    wait_until(
        "eu-west's children to go",
        lambda: len(children(installed, namespace, "chat")) == 6,
        30,
    )
    after = {k: v["metadata"]["uid"] for k, v in children(installed, namespace, "chat").items()}
    assert after == {k: uid for k, uid in kept.items() if "eu-west" not in k[1]}
    wait_until(
        "eu-west's pods to go",
        lambda: not installed.items("pods", namespace, f"{OWNER}=chat,{REGION}=eu-west"),
        30,
    )
    wait_until(
        "the status to drop eu-west",
        lambda: (
            [r["name"] for r in md(installed, namespace, "chat")["status"]["regions"]]
            == ["us-east", "ap-south"]
        ),
        30,
    )

    # Deleting the ModelDeployment leaves nothing behind.
    installed("delete", "md", "chat", "-n", namespace)
    wait_until(
        "every child and pod to go",
        lambda: (
            not installed.json(
                "get", "deploy,rs,sts,svc,cm,pods", "-n", namespace, "-l", f"{OWNER}=chat"
            )["items"]
        ),
        60,
    )


def test_a_spec_the_operator_cannot_serve_is_degraded_until_fixed(installed, operator, namespace):
    body = model_deployment("odd", {"us-east": 1}, engine={"extraArgs": ["--port", "9000"]})
    installed.apply(body, namespace)

    def invalid():
        current = md(installed, namespace, "odd")
        return current if condition(current, "Degraded").get("reason") == "InvalidSpec" else None

    current = wait_until("the InvalidSpec condition", invalid, 30)
    message = condition(current, "Degraded")["message"]
    assert "region us-east: engine.extraArgs must not contain --port" in message
    assert not children(installed, namespace, "odd")
    assert ("InvalidSpec", message) in events(installed, namespace, "odd")

    body["spec"]["engine"] = {"extraArgs": ["--seed", "1"]}
    installed.apply(body, namespace)
    current = wait_until(
        "the fixed spec to be Ready", lambda: ready(installed, namespace, "odd"), 60
    )
    assert condition(current, "Degraded")["status"] == "False"
