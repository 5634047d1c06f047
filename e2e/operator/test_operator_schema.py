"""The API server itself refuses specs the CRD's schema describes as wrong, at `kubectl apply`."""

from __future__ import annotations

import copy
import subprocess

import pytest
from operator_e2e import Kube, model_deployment


def rejected(kube: Kube, namespace: str, body: dict) -> str:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        kube.apply(body, namespace)
    return refused.value.stderr


def valid() -> dict:
    return model_deployment("chat", {"us-east": 1, "eu-west": 1})


def without_model() -> dict:
    body = valid()
    del body["spec"]["model"]
    return body


def negative_replicas() -> dict:
    body = valid()
    body["spec"]["regions"][0]["replicas"] = -1
    return body


def min_above_max() -> dict:
    body = valid()
    body["spec"]["regions"][1] = {"name": "eu-west", "minReplicas": 4, "maxReplicas": 2}
    return body


def unknown_quantization() -> dict:
    body = valid()
    body["spec"]["model"]["quantization"] = "int3"
    return body


def duplicate_regions() -> dict:
    body = valid()
    body["spec"]["regions"][1] = copy.deepcopy(body["spec"]["regions"][0])
    return body


def replicas_and_bounds() -> dict:
    body = valid()
    body["spec"]["regions"][0].update(minReplicas=1, maxReplicas=3)
    return body


def unknown_source_scheme() -> dict:
    body = valid()
    body["spec"]["model"]["source"] = "s3://bucket/model.gguf"
    return body


def fewer_gpus_than_tensor_ranks() -> dict:
    body = valid()
    body["spec"]["parallelism"] = {"tensor": 4}
    body["spec"]["resources"]["gpus"] = 2
    return body


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (without_model, "spec.model: Required value"),
        (negative_replicas, "spec.regions[0].replicas: Invalid value: -1"),
        (min_above_max, "minReplicas must not be greater than maxReplicas"),
        (unknown_quantization, 'spec.model.quantization: Unsupported value: "int3"'),
        (duplicate_regions, "spec.regions[1]: Duplicate value"),
        (replicas_and_bounds, "set either replicas, or both minReplicas and maxReplicas"),
        (unknown_source_scheme, "spec.model.source: Invalid value"),
        (fewer_gpus_than_tensor_ranks, "resources.gpus must be at least parallelism.tensor"),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_invalid_specs_are_refused_with_the_schemas_message(installed, namespace, make, message):
    stderr = rejected(installed, namespace, make())
    assert message in stderr, stderr
    assert installed.items("modeldeployments", namespace) == []


def test_a_valid_spec_is_stored_with_the_schemas_defaults(installed, namespace):
    installed.apply(valid(), namespace)
    stored = installed.json("get", "md", "chat", "-n", namespace)["spec"]
    assert stored["engine"] == {"maxNumSeqs": 256, "prefixCaching": True}
    assert stored["parallelism"] == {"tensor": 1, "pipeline": 1}
    assert stored["rollout"] == {"maxSurge": 1, "maxUnavailable": 0, "regionStrategy": "Sequential"}
    assert stored["model"]["format"] == "gguf"


def test_the_manifests_install_with_kustomize(installed):
    rules = installed.json("get", "clusterrole", "meridian-operator")["rules"]
    assert all("*" not in rule["verbs"] and "*" not in rule["resources"] for rule in rules)
    deployment = installed.json("get", "deployment", "meridian-operator", "-n", "meridian-system")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["meridian", "--log-level=INFO", "operator", "--all-namespaces"]
