from __future__ import annotations

import re

from modeldeployments import model_deployment

from meridian.operator.children import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_SPEC_HASH,
    ANNOTATION_TEMPLATE_HASH,
    LABEL_MODEL,
    LABEL_REGION,
    NODE_GPU_PRODUCT_LABEL,
    NODE_REGION_LABEL,
    POD_INDEX_LABEL,
    build_children,
)
from meridian.operator.spec import WORKER_PORT, parse_spec


def children(spec, name="chat"):
    body = model_deployment(spec, name=name)
    return build_children(parse_spec(name, "serving", body["spec"]))


def by_kind(objs, kind):
    return [obj for obj in objs if obj["kind"] == kind]


def test_each_region_gets_config_service_and_workers_named_after_it(spec):
    built = children(spec)
    assert list(built) == ["us-east", "eu-west", "ap-south"]
    names = [(obj["kind"], obj["metadata"]["name"]) for obj in built["eu-west"]]
    assert names == [
        ("ConfigMap", "chat-eu-west-engine"),
        ("Service", "chat-eu-west"),
        ("Deployment", "chat-eu-west"),
    ]
    for obj in built["eu-west"]:
        assert obj["metadata"]["namespace"] == "serving"
        assert obj["metadata"]["labels"][LABEL_REGION] == "eu-west"
        assert obj["metadata"]["labels"][LABEL_MODEL] == "smollm2-135m-instruct"


def test_workers_are_pinned_to_their_region_and_request_gpus(spec):
    spec["resources"]["gpuType"] = "NVIDIA-H100-80GB-HBM3"
    (deployment,) = by_kind(children(spec)["ap-south"], "Deployment")
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {
        NODE_REGION_LABEL: "ap-south",
        NODE_GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3",
    }
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["resources"]["requests"] == {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


def test_cpu_workers_neither_request_nor_tolerate_gpus(spec):
    spec["resources"] = {"gpus": 0}
    (deployment,) = by_kind(children(spec)["us-east"], "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert "tolerations" not in pod
    assert pod["containers"][0]["resources"] == {}


def test_workers_run_the_image_with_grpc_health_probes_on_the_worker_port(spec):
    (deployment,) = by_kind(children(spec)["us-east"], "Deployment")
    (worker,) = deployment["spec"]["template"]["spec"]["containers"]
    assert worker["image"] == "meridian:0.1.0"
    assert worker["command"] == ["meridian", "worker"]
    assert worker["args"][worker["args"].index("--port") + 1] == str(WORKER_PORT)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"] == {"port": WORKER_PORT}


def test_every_flag_value_refers_to_a_key_of_the_engine_configmap(spec):
    spec["engine"] = {"maxModelLen": 4096, "kvCacheMemory": "1Gi", "prefixCaching": False}
    config, _, deployment = children(spec)["us-east"]
    worker = deployment["spec"]["template"]["spec"]["containers"][0]
    referenced = set(re.findall(r"\$\((\w+)\)", " ".join(worker["args"])))
    assert referenced <= set(config["data"])
    assert {"MERIDIAN_MAX_MODEL_LEN", "MERIDIAN_KV_CACHE_MEMORY"} <= referenced
    assert config["data"]["MERIDIAN_KV_CACHE_MEMORY"] == str(2**30)
    assert "--no-prefix-caching" in worker["args"]
    assert worker["envFrom"] == [{"configMapRef": {"name": "chat-us-east-engine"}}]


def test_flags_follow_the_device_the_pod_gets(spec):
    (deployment,) = by_kind(children(spec)["us-east"], "Deployment")
    config = children(spec)["us-east"][0]["data"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--device") + 1] == "$(MERIDIAN_DEVICE)"
    assert config["MERIDIAN_DEVICE"] == "cuda"
    assert "--dtype" not in args and "--tensor-parallel-size" not in args  # auto, and 1
    assert "--no-prefix-caching" not in args
    spec["resources"] = {"gpus": 0}
    spec["model"]["dtype"] = "bfloat16"
    assert children(spec)["us-east"][0]["data"]["MERIDIAN_DEVICE"] == "cpu"
    assert children(spec)["us-east"][0]["data"]["MERIDIAN_DTYPE"] == "bfloat16"


def test_extra_args_come_after_the_operators_flags(spec):
    spec["engine"] = {"extraArgs": ["--seed", "7"]}
    (deployment,) = by_kind(children(spec)["us-east"], "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--seed", "7"]


def test_model_sources_become_paths_in_the_pod(spec):
    spec["model"]["source"] = "pvc://weights/smollm2/model.gguf"
    config, _, deployment = children(spec)["us-east"]
    pod = deployment["spec"]["template"]["spec"]
    assert config["data"]["MERIDIAN_MODEL"] == "/var/lib/meridian/models/smollm2/model.gguf"
    claim = {"claimName": "weights", "readOnly": True}
    assert {"name": "model", "persistentVolumeClaim": claim} in pod["volumes"]
    spec["model"]["source"] = "file:///opt/models/x.gguf"
    assert children(spec)["us-east"][0]["data"]["MERIDIAN_MODEL"] == "/opt/models/x.gguf"
    spec["model"]["source"] = "hf://org/repo@main"
    assert children(spec)["us-east"][0]["data"]["MERIDIAN_MODEL"] == "hf://org/repo@main"


def test_the_region_service_is_headless_and_selects_only_that_regions_workers(spec):
    built = children(spec)
    (service,) = by_kind(built["eu-west"], "Service")
    (deployment,) = by_kind(built["eu-west"], "Deployment")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= template_labels.items()
    (us_service,) = by_kind(built["us-east"], "Service")
    assert service["spec"]["selector"] != us_service["spec"]["selector"]


def test_pipeline_replicas_are_statefulsets_that_find_rank_zero(spec):
    spec["parallelism"] = {"pipeline": 3, "tensor": 2}
    spec["resources"]["gpus"] = 2
    region = children(spec)["us-east"]
    statefulsets = by_kind(region, "StatefulSet")
    assert [s["metadata"]["name"] for s in statefulsets] == ["chat-us-east-g0", "chat-us-east-g1"]
    assert not by_kind(region, "Deployment")
    services = {s["metadata"]["name"]: s for s in by_kind(region, "Service")}
    for statefulset in statefulsets:
        name = statefulset["metadata"]["name"]
        assert statefulset["spec"]["replicas"] == 3
        assert statefulset["spec"]["serviceName"] == name
        assert services[name]["spec"]["clusterIP"] == "None"
        assert services[name]["spec"]["publishNotReadyAddresses"] is True
        env = {
            e["name"]: e for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["MASTER_ADDR"]["value"] == f"{name}-0.{name}"
        assert env["WORLD_SIZE"]["value"] == "3"
        assert POD_INDEX_LABEL in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert services["chat-us-east"]["spec"]["selector"][POD_INDEX_LABEL] == "0"


def test_engine_changes_change_the_pod_template_but_scaling_does_not(spec):
    before = by_kind(children(spec)["us-east"], "Deployment")[0]["metadata"]["annotations"]
    spec["regions"][0]["replicas"] = 5
    scaled = by_kind(children(spec)["us-east"], "Deployment")[0]["metadata"]["annotations"]
    assert scaled[ANNOTATION_TEMPLATE_HASH] == before[ANNOTATION_TEMPLATE_HASH]
    assert scaled[ANNOTATION_SPEC_HASH] != before[ANNOTATION_SPEC_HASH]
    spec["engine"] = {"maxNumSeqs": 8}
    tuned = by_kind(children(spec)["us-east"], "Deployment")[0]
    assert (
        tuned["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH]
        != (before[ANNOTATION_TEMPLATE_HASH])
    )
    config_hash = tuned["spec"]["template"]["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    assert config_hash


def test_building_twice_gives_the_same_manifests(spec):
    assert children(spec) == children(spec)
