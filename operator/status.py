"""What `kubectl get md` and `status.conditions` say, computed from what the watches last saw.

Each region gets a phase: Pending (no workers yet), Progressing (scaling or rolling out), Waiting (its
rollout waits for an earlier region), Ready, or Degraded (pods that cannot be scheduled or keep
failing). The ModelDeployment's conditions summarise the regions: Ready when every region is,
Progressing while any is moving, Degraded while any is stuck or the spec cannot be served.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from meridian.operator.children import LABEL_GROUP, LABEL_REGION, region_base_name
from meridian.operator.rollout import WORKLOAD_KINDS, rolled_out
from meridian.operator.spec import Fleet, Region

# Container waiting reasons that will not clear up by themselves.
FAILING_REASONS = {
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
}
CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


def observe_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a worker pod: where it is and what stops it from serving."""
    meta = body.get("metadata", {})
    labels = meta.get("labels") or {}
    status = body.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled", {})
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "no node fits"
    failing = None
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FAILING_REASONS:
            failing = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return {
        "name": meta.get("name"),
        "region": labels.get(LABEL_REGION),
        "group": labels.get(LABEL_GROUP),
        "deleting": bool(meta.get("deletionTimestamp")),
        "ready": conditions.get("Ready", {}).get("status") == "True",
        "unschedulable": unschedulable,
        "failing": failing,
    }


def region_status(
    fleet: Fleet,
    region: Region,
    children: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    *,
    changing: bool = False,
    waiting: bool = False,
) -> dict[str, Any]:
    """changing: the operator is applying changes to this region now; waiting: held for a wave."""
    workloads = [c for c in children if c["kind"] in WORKLOAD_KINDS and c["region"] == region.name]
    live = [p for p in pods if p["region"] == region.name and not p["deleting"]]
    ready, updated, settled = _progress(fleet, region, workloads)
    status: dict[str, Any] = {
        "name": region.name,
        "replicas": region.replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
    }
    unschedulable = [p for p in live if p["unschedulable"]]
    failing = [p for p in live if p["failing"]]
    if unschedulable:
        phase = "Degraded"
        message = (
            f"{len(unschedulable)} of {len(live)} worker pods cannot be scheduled: "
            f"{unschedulable[0]['unschedulable']}"
        )
    elif failing:
        phase = "Degraded"
        message = f"{len(failing)} of {len(live)} worker pods are failing: {failing[0]['failing']}"
    elif waiting:
        phase, message = "Waiting", "rollout waits for the regions before this one to be Ready"
    elif region.replicas and not workloads:
        phase, message = "Pending", "creating workers"
    elif changing or not settled or ready < region.replicas:
        phase = "Progressing"
        message = f"{ready}/{region.replicas} replicas ready, {updated} up to date"
    else:
        phase, message = "Ready", f"{ready}/{region.replicas} replicas ready"
    return {**status, "phase": phase, "message": message}


def compute_status(
    fleet: Fleet,
    generation: int,
    regions: list[dict[str, Any]],
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    """The whole status subresource from each region's status (region_status)."""
    not_ready = [r for r in regions if r["phase"] != "Ready"]
    moving = [r for r in regions if r["phase"] in ("Pending", "Progressing", "Waiting")]
    degraded = [r for r in regions if r["phase"] == "Degraded"]
    names = ", ".join(r["name"] for r in regions)
    total = sum(r["replicas"] for r in regions)
    ready = sum(min(r["readyReplicas"], r["replicas"]) for r in regions)
    conditions = {
        "Ready": (
            ("True", "AllRegionsReady", f"{ready}/{total} replicas ready in {names}")
            if not not_ready
            else ("False", "RegionsNotReady", _describe(not_ready))
        ),
        "Progressing": (
            ("True", "RollingOut", _describe(moving)) if moving else ("False", "Converged", "")
        ),
        "Degraded": (
            ("True", "RegionsDegraded", _describe(degraded))
            if degraded
            else ("False", "AsExpected", "")
        ),
    }
    return {
        "observedGeneration": generation,
        "regionNames": ",".join(r["name"] for r in regions),
        "replicas": total,
        "readyReplicas": ready,
        "regions": regions,
        "conditions": _conditions(conditions, generation, previous, now),
    }


def invalid_spec_status(
    generation: int, message: str, previous: Mapping[str, Any], now: str
) -> dict[str, Any]:
    """The spec cannot be served: say why; the children keep running as they were."""
    conditions = {
        "Ready": ("False", "InvalidSpec", message),
        "Progressing": ("False", "InvalidSpec", "fix the spec to continue"),
        "Degraded": ("True", "InvalidSpec", message),
    }
    return {
        **{key: value for key, value in previous.items() if key != "conditions"},
        "observedGeneration": generation,
        "conditions": _conditions(conditions, generation, previous, now),
    }


def status_events(
    previous: Mapping[str, Any], current: Mapping[str, Any]
) -> list[tuple[str, str, str]]:
    """(type, reason, message) Events for what changed between two statuses."""
    before = {r["name"]: r.get("phase") for r in previous.get("regions") or []}
    events = []
    for region in current.get("regions") or []:
        phase = region["phase"]
        if before.get(region["name"]) == phase:
            continue
        if phase == "Ready":
            events.append(
                ("Normal", "RegionReady", f"region {region['name']}: {region['message']}")
            )
        elif phase == "Degraded":
            events.append(
                ("Warning", "RegionDegraded", f"region {region['name']}: {region['message']}")
            )
        elif phase == "Waiting":
            events.append(
                ("Normal", "RolloutWaiting", f"region {region['name']}: {region['message']}")
            )
    was = {c["type"]: c for c in previous.get("conditions") or []}
    for condition in current.get("conditions") or []:
        old = was.get(condition["type"], {})
        if (old.get("status"), old.get("reason")) == (condition["status"], condition["reason"]):
            continue
        if condition["type"] == "Ready" and condition["status"] == "True":
            events.append(("Normal", "Ready", condition["message"]))
        elif condition["reason"] == "InvalidSpec" and condition["type"] == "Degraded":
            events.append(("Warning", "InvalidSpec", condition["message"]))
    return events


def _progress(
    fleet: Fleet, region: Region, workloads: list[Mapping[str, Any]]
) -> tuple[int, int, bool]:
    """(ready replicas, up-to-date replicas, every workload settled) for one region."""
    if fleet.pipeline == 1:
        name = region_base_name(fleet, region)
        deployment = next((w for w in workloads if w["name"] == name), None)
        if deployment is None:
            return 0, 0, region.replicas == 0
        status = deployment.get("status") or {}
        ready = min(status.get("readyReplicas", 0), region.replicas)
        return ready, status.get("updatedReplicas", 0), rolled_out(deployment)
    # A pipeline replica is a StatefulSet of `pipeline` pods: it serves only when all are ready.
    groups = [w for w in workloads if w["group"] is not None and int(w["group"]) < region.replicas]
    ready = sum(
        1 for g in groups if (g.get("status") or {}).get("readyReplicas", 0) >= fleet.pipeline
    )
    updated = sum(1 for g in groups if rolled_out(g))
    return ready, updated, len(groups) == region.replicas and updated == len(groups)


def _describe(regions: list[dict[str, Any]]) -> str:
    return "; ".join(f"region {r['name']} {r['phase']}: {r['message']}" for r in regions)


def _conditions(
    wanted: Mapping[str, tuple[str, str, str]],
    generation: int,
    previous: Mapping[str, Any],
    now: str,
) -> list[dict[str, Any]]:
    # lastTransitionTime moves only when the condition's status does.
    before = {c["type"]: c for c in previous.get("conditions") or []}
    conditions = []
    for kind in CONDITION_TYPES:
        status, reason, message = wanted[kind]
        old = before.get(kind, {})
        changed = old.get("status") != status
        conditions.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
            }
        )
    return conditions
