"""ModelDeployments as the API server would hand them to the operator (CRD defaults applied)."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml

from meridian.operator.rollout import observe_child

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "modeldeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill in the CRD's defaults the way the API server does before storing an object."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = with_defaults(sub, value[key])
    if isinstance(value, list) and "items" in schema:
        return [with_defaults(schema["items"], item) for item in value]
    return value


def model_deployment(
    spec: dict[str, Any], name: str = "chat", uid: str = "uid-1"
) -> dict[str, Any]:
    body = {
        "apiVersion": "serving.meridian.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": "serving", "uid": uid, "generation": 1},
        "spec": spec,
    }
    return with_defaults(SCHEMA, body)


def served(
    child: dict[str, Any], *, ready: int | None = None, generation: int = 1
) -> dict[str, Any]:
    """A child as the watch would report it: server defaults added, a workload's status filled in.

    ready: pods ready (default: all of them, rolled out).
    """
    body = copy.deepcopy(child)
    body["metadata"].update(generation=generation, uid=f"uid-{child['metadata']['name']}")
    if child["kind"] in ("Deployment", "StatefulSet"):
        body["spec"].setdefault("progressDeadlineSeconds", 600)
        for container in body["spec"]["template"]["spec"]["containers"]:
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            for port in container.get("ports", []):
                port.setdefault("protocol", "TCP")
        want = body["spec"]["replicas"]
        count = want if ready is None else ready
        body["status"] = {
            "observedGeneration": generation,
            "replicas": want,
            "updatedReplicas": want,
            "readyReplicas": count,
            "availableReplicas": count,
        }
        if child["kind"] == "StatefulSet":
            body["status"].update(currentRevision="r1", updateRevision="r1")
    if child["kind"] == "Service":
        body["spec"].setdefault("type", "ClusterIP")
        body["spec"]["clusterIPs"] = ["None"]
    return observe_child(body)
