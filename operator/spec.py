"""A ModelDeployment's spec as typed values, with each region's overrides already applied.

The API server has checked the schema (crds/modeldeployment.yaml) before the operator sees a spec.
`parse_spec` adds the checks that need the operator's own knowledge (the flags it sets, the names it
derives) and raises `InvalidSpec` with every problem found, worded for the person who wrote the spec.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

GROUP = "serving.meridian.dev"
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
KIND = "ModelDeployment"

WORKER_PORT = 50051
# Kubernetes object names that are also DNS labels (Services, Deployments' pods' hostnames).
MAX_NAME = 63
# A StatefulSet's name plus "-" and a 10-character revision hash must fit a 63-character label value.
MAX_STATEFULSET_NAME = 52

# Flags the operator derives from spec fields; extraArgs must not repeat them. Value: the field.
OWNED_FLAGS = {
    "--model": "model.source",
    "--served-model-name": "model.name",
    "--dtype": "model.dtype",
    "--device": "resources.gpus",
    "--host": None,
    "--port": None,
    "--metrics-port": None,
    "--max-num-seqs": "engine.maxNumSeqs",
    "--max-model-len": "engine.maxModelLen",
    "--kv-cache-memory": "engine.kvCacheMemory",
    "--no-prefix-caching": "engine.prefixCaching",
    "--tensor-parallel-size": "parallelism.tensor",
}

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_SUFFIX = {
    None: 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


class InvalidSpec(ValueError):
    """The spec passed the schema but cannot be served as written."""


@dataclass(frozen=True)
class Model:
    name: str
    source: str | None = None  # None: the worker resolves `name` itself (a bundled model)
    format: str = "gguf"
    quantization: str = "none"
    dtype: str = "auto"


@dataclass(frozen=True)
class Engine:
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_cache_memory: str | None = None  # a quantity, e.g. "4Gi"
    prefix_caching: bool = True
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resources:
    gpus: int = 1  # nvidia.com/gpu per pod
    gpu_type: str | None = None
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class Rollout:
    max_surge: int | str = 1
    max_unavailable: int | str = 0
    sequential: bool = True  # regionStrategy: Sequential


@dataclass(frozen=True)
class Region:
    """Everything one region's children are built from: spec-wide values with overrides applied."""

    name: str
    replicas: int
    image: str
    engine: Engine
    resources: Resources


@dataclass(frozen=True)
class Fleet:
    """One ModelDeployment: the model, how each replica is split, and the regions it runs in."""

    name: str
    namespace: str
    model: Model
    tensor: int
    pipeline: int
    regions: tuple[Region, ...]
    rollout: Rollout


def quantity(value: int | str) -> Decimal:
    """'4Gi' -> 4294967296, '500m' -> 0.5 (Kubernetes quantity suffixes)."""
    match = _QUANTITY.match(str(value))
    if match is None:
        raise InvalidSpec(f"{value!r} is not a quantity such as 4Gi, 512Mi or 500m")
    return Decimal(match.group(1)) * _SUFFIX[match.group(2)]


def parse_spec(name: str, namespace: str, spec: Mapping[str, Any]) -> Fleet:
    """Turn a ModelDeployment's (schema-valid, defaulted) spec into a Fleet, or raise InvalidSpec."""
    model = spec["model"]
    parallelism = spec.get("parallelism") or {}
    rollout = spec.get("rollout") or {}
    engine = _engine(spec.get("engine") or {}, Engine())
    resources = _resources(spec.get("resources") or {}, Resources())
    fleet = Fleet(
        name=name,
        namespace=namespace,
        model=Model(
            name=model["name"],
            source=model.get("source"),
            format=model.get("format", "gguf"),
            quantization=model.get("quantization", "none"),
            dtype=model.get("dtype", "auto"),
        ),
        tensor=int(parallelism.get("tensor", 1)),
        pipeline=int(parallelism.get("pipeline", 1)),
        regions=tuple(_region(r, spec["image"], engine, resources) for r in spec["regions"]),
        rollout=Rollout(
            max_surge=rollout.get("maxSurge", 1),
            max_unavailable=rollout.get("maxUnavailable", 0),
            sequential=rollout.get("regionStrategy", "Sequential") == "Sequential",
        ),
    )
    problems = spec_problems(fleet)
    if problems:
        raise InvalidSpec("; ".join(problems))
    return fleet


def spec_problems(fleet: Fleet) -> list[str]:
    """What the schema cannot see: flags the operator owns, derived names, per-region GPU counts."""
    problems = []
    for region in fleet.regions:
        where = f"region {region.name}"
        for arg in region.engine.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in OWNED_FLAGS:
                field = OWNED_FLAGS[flag]
                fix = f"set {field} instead" if field else "the operator sets it"
                problems.append(f"{where}: engine.extraArgs must not contain {flag} ({fix})")
        gpus = region.resources.gpus
        if gpus and gpus < fleet.tensor:
            problems.append(
                f"{where}: resources.gpus is {gpus} but parallelism.tensor is {fleet.tensor}; "
                "each tensor-parallel rank needs its own GPU"
            )
        if region.resources.gpu_type and not gpus:
            problems.append(f"{where}: resources.gpuType is set but resources.gpus is 0")
        for value in (region.engine.kv_cache_memory, region.resources.cpu, region.resources.memory):
            if value is not None:
                try:
                    quantity(value)
                except InvalidSpec as error:
                    problems.append(f"{where}: {error}")
        problems.extend(_name_problems(fleet, region))
    return problems


def _name_problems(fleet: Fleet, region: Region) -> list[str]:
    base = f"{fleet.name}-{region.name}"
    if fleet.pipeline > 1:
        longest = f"{base}-g{max(region.replicas - 1, 0)}"
        limit, kind = MAX_STATEFULSET_NAME, "StatefulSet"
    else:
        longest, limit, kind = f"{base}-engine", MAX_NAME, "object"
    if len(longest) <= limit:
        return []
    return [
        f"region {region.name}: the {kind} name {longest!r} would be {len(longest)} characters "
        f"(Kubernetes allows {limit}); shorten the ModelDeployment's name or the region's"
    ]


def _region(raw: Mapping[str, Any], image: str, engine: Engine, resources: Resources) -> Region:
    overrides = raw.get("overrides") or {}
    # Until the autoscaler moves it, a min/max region runs at its minimum.
    replicas = raw["replicas"] if "replicas" in raw else raw["minReplicas"]
    return Region(
        name=raw["name"],
        replicas=int(replicas),
        image=overrides.get("image", image),
        engine=_engine(overrides.get("engine") or {}, engine),
        resources=_resources(overrides.get("resources") or {}, resources),
    )


def _engine(raw: Mapping[str, Any], base: Engine) -> Engine:
    fields = {
        "maxNumSeqs": "max_num_seqs",
        "maxModelLen": "max_model_len",
        "kvCacheMemory": "kv_cache_memory",
        "prefixCaching": "prefix_caching",
    }
    changes: dict[str, Any] = {field: raw[key] for key, field in fields.items() if key in raw}
    if "extraArgs" in raw:
        changes["extra_args"] = tuple(raw["extraArgs"])
    return replace(base, **changes)


def _resources(raw: Mapping[str, Any], base: Resources) -> Resources:
    changes: dict[str, Any] = {}
    if "gpus" in raw:
        changes["gpus"] = int(raw["gpus"])
    if "gpuType" in raw:
        changes["gpu_type"] = raw["gpuType"]
    for key in ("cpu", "memory"):
        if key in raw:
            changes[key] = str(raw[key])
    return replace(base, **changes)
