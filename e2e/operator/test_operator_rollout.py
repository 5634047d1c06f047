"""Changes that restart workers go region by region; pipeline replicas are StatefulSets."""

from __future__ import annotations

import time

from operator_e2e import Kube, is_ready, model_deployment, read_example, wait_until

OWNER = "serving.meridian.dev/deployment"
TEMPLATE_HASH = "serving.meridian.dev/template-hash"
REGIONS = {"us-east": 2, "eu-west": 2, "ap-south": 2}


def ready(kube: Kube, namespace: str, name: str) -> dict | None:
    current = kube.json("get", "md", name, "-n", namespace)
    return current if is_ready(current) else None


def test_a_new_image_rolls_out_one_region_at_a_time(installed, operator, namespace):
    installed.apply(model_deployment("wave", REGIONS), namespace)
    wait_until("wave to be Ready", lambda: ready(installed, namespace, "wave"), 60)
    old = {
        d["metadata"]["labels"]["serving.meridian.dev/region"]: d["metadata"]["annotations"][
            TEMPLATE_HASH
        ]
        for d in installed.items("deployments", namespace, f"{OWNER}=wave")
    }

    patch = '{"spec": {"image": "meridian:0.2.0"}}'
    installed("patch", "md", "wave", "-n", namespace, "--type=merge", "-p", patch)
    # Watch which region takes the new template when, and whether the regions before it were done.
    adopted: list[str] = []
    waiting_seen = set()
    deadline = time.monotonic() + 90
    while len(adopted) < len(REGIONS) and time.monotonic() < deadline:
        deployments = {
            d["metadata"]["labels"]["serving.meridian.dev/region"]: d
            for d in installed.items("deployments", namespace, f"{OWNER}=wave")
        }
        for region in REGIONS:
            moved = deployments[region]["metadata"]["annotations"][TEMPLATE_HASH] != old[region]
            if moved and region not in adopted:
                for earlier in adopted:
                    status = deployments[earlier]["status"]
                    assert status.get("updatedReplicas") == status.get("readyReplicas") == 2, (
                        f"{region} changed before {earlier} had rolled out: {status}"
                    )
                adopted.append(region)
        md = installed.json("get", "md", "wave", "-n", namespace)
        waiting_seen |= {r["name"] for r in md["status"]["regions"] if r["phase"] == "Waiting"}
        time.sleep(0.2)
    assert adopted == list(REGIONS)
    assert "ap-south" in waiting_seen
    current = wait_until(
        "wave to be Ready on the new image", lambda: ready(installed, namespace, "wave"), 60
    )
    assert current["status"]["readyReplicas"] == 6
    for pod in installed.items("pods", namespace, f"{OWNER}=wave"):
        if not pod["metadata"].get("deletionTimestamp"):
            assert pod["spec"]["containers"][0]["image"] == "meridian:0.2.0"


def test_the_pipeline_example_runs_each_replica_as_a_statefulset(installed, operator, namespace):
    example = read_example("pipeline-parallel.yaml")
    name = example["metadata"]["name"]
    installed.apply(example, namespace)
    current = wait_until(
        "the pipeline example to be Ready", lambda: ready(installed, namespace, name), 60
    )
    assert [(r["name"], r["readyReplicas"]) for r in current["status"]["regions"]] == [
        ("us-east", 1),
        ("eu-west", 1),
    ]
    statefulsets = installed.items("statefulsets", namespace, f"{OWNER}={name}")
    assert sorted(s["metadata"]["name"] for s in statefulsets) == [
        f"{name}-eu-west-g0",
        f"{name}-us-east-g0",
    ]
    pods = installed.items("pods", namespace, f"{OWNER}={name}")
    assert len(pods) == 4  # two replicas (one per region) of two pipeline stages
    for pod in pods:
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    endpoints = installed.items(
        "endpointslices", namespace, f"kubernetes.io/service-name={name}-us-east"
    )
    addresses = [
        a for slice_ in endpoints for e in slice_.get("endpoints") or [] for a in e["addresses"]
    ]
    assert len(addresses) == 1  # requests enter at rank 0 only
