"""Every object a ModelDeployment owns, built as a plain manifest from its Fleet.

Per region: a ConfigMap of engine settings, a headless Service listing the region's serving workers
(the gateway resolves it to pick a replica), and the workers themselves: one Deployment when a replica
is one pod, or, with pipeline parallelism, one StatefulSet per replica group whose pods find rank 0
through the group's own headless Service. Nothing here talks to the API server.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from meridian.operator.spec import WORKER_PORT, Fleet, Region, quantity

LABEL_DEPLOYMENT = "serving.meridian.dev/deployment"
LABEL_MODEL = "serving.meridian.dev/model"
LABEL_REGION = "serving.meridian.dev/region"
LABEL_GROUP = "serving.meridian.dev/replica-group"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "meridian-operator"
# What the operator applied, so it can tell its own last write from someone else's edit.
ANNOTATION_SPEC_HASH = "serving.meridian.dev/spec-hash"
# On workloads: the pod template's hash. A change means pods restart, so it is rolled out in waves.
ANNOTATION_TEMPLATE_HASH = "serving.meridian.dev/template-hash"
ANNOTATION_CONFIG_HASH = "serving.meridian.dev/config-hash"

NODE_REGION_LABEL = "topology.kubernetes.io/region"
NODE_GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
MODEL_MOUNT = "/var/lib/meridian/models"
DIST_PORT = 29500  # torch.distributed rendezvous on rank 0 of a pipeline group
METRICS_PORT = 9400  # the worker's Prometheus /metrics


def content_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def region_base_name(fleet: Fleet, region: Region) -> str:
    return f"{fleet.name}-{region.name}"


def selector_labels(fleet: Fleet, region: Region) -> dict[str, str]:
    """Labels that pick a region's worker pods; stable for the life of the region (selectors are immutable)."""
    return {LABEL_DEPLOYMENT: fleet.name, LABEL_REGION: region.name, LABEL_COMPONENT: "worker"}


def region_labels(fleet: Fleet, region: Region) -> dict[str, str]:
    return {
        **selector_labels(fleet, region),
        LABEL_MODEL: fleet.model.name,
        LABEL_MANAGED_BY: MANAGER,
    }


def build_region_children(fleet: Fleet, region: Region) -> list[dict[str, Any]]:
    """A region's children in the order they should be created: config and Services before pods."""
    config = build_engine_configmap(fleet, region)
    children = [config, build_region_service(fleet, region)]
    if fleet.pipeline == 1:
        children.append(build_worker_deployment(fleet, region, config))
    else:
        for group in range(region.replicas):
            children.append(build_rank_service(fleet, region, group))
            children.append(build_worker_statefulset(fleet, region, group, config))
    for child in children:
        child["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = content_hash(child)
    return children


def build_children(fleet: Fleet) -> dict[str, list[dict[str, Any]]]:
    """Region name -> its children, in the order of spec.regions (the rollout order)."""
    return {region.name: build_region_children(fleet, region) for region in fleet.regions}


def build_engine_configmap(fleet: Fleet, region: Region) -> dict[str, Any]:
    """Engine settings as environment variables; the worker's flags refer to them as $(NAME)."""
    engine, model = region.engine, fleet.model
    data = {
        "MERIDIAN_MODEL": model_path(model.name, model.source),
        "MERIDIAN_MODEL_NAME": model.name,
        "MERIDIAN_MODEL_FORMAT": model.format,
        "MERIDIAN_QUANTIZATION": model.quantization,
        "MERIDIAN_REGION": region.name,
        "MERIDIAN_DEVICE": "cuda" if region.resources.gpus else "cpu",
        "MERIDIAN_MAX_NUM_SEQS": str(engine.max_num_seqs),
        "MERIDIAN_PREFIX_CACHING": "true" if engine.prefix_caching else "false",
        "MERIDIAN_PIPELINE_PARALLEL_SIZE": str(fleet.pipeline),
    }
    if model.dtype != "auto":  # auto: the worker's own choice for its device
        data["MERIDIAN_DTYPE"] = model.dtype
    if fleet.tensor > 1:
        data["MERIDIAN_TENSOR_PARALLEL_SIZE"] = str(fleet.tensor)
    if engine.max_model_len is not None:
        data["MERIDIAN_MAX_MODEL_LEN"] = str(engine.max_model_len)
    if engine.kv_cache_memory is not None:
        data["MERIDIAN_KV_CACHE_MEMORY"] = str(int(quantity(engine.kv_cache_memory)))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{region_base_name(fleet, region)}-engine",
            "namespace": fleet.namespace,
            "labels": region_labels(fleet, region),
        },
        "data": data,
    }


def build_region_service(fleet: Fleet, region: Region) -> dict[str, Any]:
    """Headless: DNS answers with every ready worker, so the gateway balances by load, not by kube-proxy."""
    selector = selector_labels(fleet, region)
    if fleet.pipeline > 1:
        selector[POD_INDEX_LABEL] = "0"  # requests enter a pipeline at its first stage
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": region_base_name(fleet, region),
            "namespace": fleet.namespace,
            "labels": region_labels(fleet, region),
        },
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [{"name": "grpc", "port": WORKER_PORT, "targetPort": "grpc"}],
        },
    }


def build_rank_service(fleet: Fleet, region: Region, group: int) -> dict[str, Any]:
    """Governs one pipeline group's StatefulSet: gives rank 0 a stable name before anyone is ready."""
    name = f"{region_base_name(fleet, region)}-g{group}"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": fleet.namespace,
            "labels": {**region_labels(fleet, region), LABEL_GROUP: str(group)},
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {**selector_labels(fleet, region), LABEL_GROUP: str(group)},
            "ports": [{"name": "dist", "port": DIST_PORT, "targetPort": "dist"}],
        },
    }


def build_worker_deployment(fleet: Fleet, region: Region, config: dict[str, Any]) -> dict[str, Any]:
    template = build_worker_pod_template(fleet, region, config)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": region_base_name(fleet, region),
            "namespace": fleet.namespace,
            "labels": region_labels(fleet, region),
            "annotations": {ANNOTATION_TEMPLATE_HASH: content_hash(template)},
        },
        "spec": {
            "replicas": region.replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(fleet, region)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": fleet.rollout.max_surge,
                    "maxUnavailable": fleet.rollout.max_unavailable,
                },
            },
            "template": template,
        },
    }


def build_worker_statefulset(
    fleet: Fleet, region: Region, group: int, config: dict[str, Any]
) -> dict[str, Any]:
    """One replica of `pipeline` pods; pod i holds the i-th slice of the layers (torch.distributed rank i)."""
    name = f"{region_base_name(fleet, region)}-g{group}"
    template = build_worker_pod_template(fleet, region, config, group=group)
    selector = {**selector_labels(fleet, region), LABEL_GROUP: str(group)}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": name,
            "namespace": fleet.namespace,
            "labels": {**region_labels(fleet, region), LABEL_GROUP: str(group)},
            "annotations": {ANNOTATION_TEMPLATE_HASH: content_hash(template)},
        },
        "spec": {
            "replicas": fleet.pipeline,
            "serviceName": name,
            # All ranks must be up before any can serve, so start them together.
            "podManagementPolicy": "Parallel",
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": template,
        },
    }


def build_worker_pod_template(
    fleet: Fleet, region: Region, config: dict[str, Any], group: int | None = None
) -> dict[str, Any]:
    labels = {**region_labels(fleet, region)}
    if group is not None:
        labels[LABEL_GROUP] = str(group)
    node_selector = {NODE_REGION_LABEL: region.name}
    if region.resources.gpu_type:
        node_selector[NODE_GPU_PRODUCT_LABEL] = region.resources.gpu_type
    spec: dict[str, Any] = {
        "nodeSelector": node_selector,
        "enableServiceLinks": False,
        # Long enough for in-flight streams to finish after the gateway stops sending new ones.
        "terminationGracePeriodSeconds": 60,
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(fleet, region)},
            }
        ],
        "containers": [build_worker_container(fleet, region, config, group)],
        "volumes": _volumes(fleet.model.source),
    }
    if region.resources.gpus:
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "metadata": {
            "labels": labels,
            # A changed ConfigMap changes the template, so the pods restart and read it.
            "annotations": {ANNOTATION_CONFIG_HASH: content_hash(config["data"])},
        },
        "spec": spec,
    }


def build_worker_container(
    fleet: Fleet, region: Region, config: dict[str, Any], group: int | None = None
) -> dict[str, Any]:
    probe = {"grpc": {"port": WORKER_PORT}}
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    ports = [
        {"name": "grpc", "containerPort": WORKER_PORT},
        {"name": "metrics", "containerPort": METRICS_PORT},
    ]
    if group is not None:
        env.extend(_distributed_env(fleet, region, group))
        ports.append({"name": "dist", "containerPort": DIST_PORT})
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if (fleet.model.source or "").startswith("pvc://"):
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    return {
        "name": "worker",
        "image": region.image,
        "command": ["meridian", "worker"],
        "args": worker_args(config["data"], region),
        "envFrom": [{"configMapRef": {"name": config["metadata"]["name"]}}],
        "env": env,
        "ports": ports,
        # Loading weights can take many minutes; liveness starts counting only after startup passes.
        # Health is NOT_SERVING while an engine step overruns --step-timeout: a minute of that more
        # and the kubelet restarts the worker.
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 360},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "resources": _resources(region),
        "volumeMounts": mounts,
    }


def worker_args(config_data: dict[str, str], region: Region) -> list[str]:
    """`meridian worker` flags; values come from the engine ConfigMap through $(VAR) expansion."""
    args = ["--model", "$(MERIDIAN_MODEL)", "--served-model-name", "$(MERIDIAN_MODEL_NAME)"]
    args += ["--host", "0.0.0.0", "--port", str(WORKER_PORT), "--metrics-port", str(METRICS_PORT)]
    for flag, var in (
        ("--device", "MERIDIAN_DEVICE"),
        ("--dtype", "MERIDIAN_DTYPE"),
        ("--max-num-seqs", "MERIDIAN_MAX_NUM_SEQS"),
        ("--max-model-len", "MERIDIAN_MAX_MODEL_LEN"),
        ("--kv-cache-memory", "MERIDIAN_KV_CACHE_MEMORY"),
        ("--tensor-parallel-size", "MERIDIAN_TENSOR_PARALLEL_SIZE"),
    ):
        if var in config_data:
            args += [flag, f"$({var})"]
    if not region.engine.prefix_caching:
        args.append("--no-prefix-caching")
    return args + list(region.engine.extra_args)


def model_path(name: str, source: str | None) -> str:
    """What `--model` says: a bundled model's name, a path in the pod, or the hf:// URI to fetch."""
    if source is None:
        return name
    if source.startswith("file://"):
        return source.removeprefix("file://")
    if source.startswith("pvc://"):
        _claim, _, path = source.removeprefix("pvc://").partition("/")
        return f"{MODEL_MOUNT}/{path}"
    return source


def _distributed_env(fleet: Fleet, region: Region, group: int) -> list[dict[str, Any]]:
    # torch.distributed's env:// rendezvous: rank 0 is pod "<group>-0" behind the group's Service.
    name = f"{region_base_name(fleet, region)}-g{group}"
    pod_index = f"metadata.labels['{POD_INDEX_LABEL}']"
    return [
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(DIST_PORT)},
        {"name": "WORLD_SIZE", "value": str(fleet.pipeline)},
        {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": pod_index}}},
    ]


def _resources(region: Region) -> dict[str, dict[str, str]]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if region.resources.cpu is not None:
        requests["cpu"] = region.resources.cpu
    if region.resources.memory is not None:
        requests["memory"] = limits["memory"] = region.resources.memory
    if region.resources.gpus:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(region.resources.gpus)
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _volumes(source: str | None) -> list[dict[str, Any]]:
    # torch and NCCL share tensors between processes through /dev/shm; the default 64Mi is too small.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if source and source.startswith("pvc://"):
        claim = source.removeprefix("pvc://").partition("/")[0]
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
    return volumes
