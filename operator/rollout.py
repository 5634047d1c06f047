"""Deciding what to change: the children the spec wants against the children the watches last saw.

A child is applied when it is missing, when the spec changed it, or when someone edited a field the
operator sets (drift). A change to a region's pod template restarts its workers, so with the
Sequential region strategy it waits until every region before it (in spec order) is rolled out and
Ready. Children that no region wants any more are deleted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meridian.operator.children import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_TEMPLATE_HASH,
    LABEL_GROUP,
    LABEL_REGION,
)
from meridian.operator.spec import Fleet, InvalidSpec, quantity

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
ChildKey = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class Plan:
    apply: tuple[dict[str, Any], ...]  # manifests to server-side apply, in order
    delete: tuple[Mapping[str, Any], ...]  # observed children nobody wants any more
    waiting: tuple[str, ...]  # regions whose template change waits for an earlier region


def observe_child(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a child it watches: enough to spot drift and read progress."""
    meta = body.get("metadata", {})
    labels = dict(meta.get("labels") or {})
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "name": meta.get("name"),
        "region": labels.get(LABEL_REGION),
        "group": labels.get(LABEL_GROUP),
        "owners": [ref.get("uid") for ref in meta.get("ownerReferences") or []],
        "deleting": bool(meta.get("deletionTimestamp")),
        "generation": meta.get("generation"),
        "labels": labels,
        "annotations": dict(meta.get("annotations") or {}),
        "spec": _plain(body.get("spec")),
        "data": _plain(body.get("data")),
        "status": _plain(body.get("status")),
    }


def plan_changes(
    fleet: Fleet,
    owner_uid: str,
    desired: Mapping[str, list[dict[str, Any]]],
    observed: Iterable[Mapping[str, Any]],
) -> Plan:
    """desired: region -> children (build_children); observed: observe_child() of each child seen."""
    seen = {(child["kind"], child["name"]): child for child in observed}
    wanted: set[ChildKey] = set()
    apply: list[dict[str, Any]] = []
    waiting: list[str] = []
    earlier_regions_settled = True
    for region, children in desired.items():
        keys = [(child["kind"], child["metadata"]["name"]) for child in children]
        wanted.update(keys)
        workloads = [seen[key] for key in keys if key[0] in WORKLOAD_KINDS and key in seen]
        restarts = template_changes(children, seen)
        hold = fleet.rollout.sequential and restarts and not earlier_regions_settled
        for key, child in zip(keys, children, strict=True):
            # A held region keeps its current config and pods; new objects are still created.
            if hold and key in seen and key[0] in (*WORKLOAD_KINDS, "ConfigMap"):
                continue
            if needs_apply(child, seen.get(key)):
                apply.append(child)
        if hold:
            waiting.append(region)
        if restarts or not all(rolled_out(workload) for workload in workloads):
            earlier_regions_settled = False
    delete = tuple(
        child
        for key, child in seen.items()
        if key not in wanted and owner_uid in child["owners"] and not child["deleting"]
    )
    return Plan(apply=tuple(apply), delete=delete, waiting=tuple(waiting))


def template_changes(children: list[dict[str, Any]], seen: Mapping[ChildKey, Any]) -> bool:
    """Would applying these children restart pods that are running now?"""
    for child in children:
        current = seen.get((child["kind"], child["metadata"]["name"]))
        if child["kind"] not in WORKLOAD_KINDS or current is None:
            continue
        want = child["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH]
        if current["annotations"].get(ANNOTATION_TEMPLATE_HASH) != want:
            return True
    return False


def needs_apply(desired: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    if current is None:
        return True
    if current["deleting"]:
        return False  # applying would resurrect nothing; its DELETED event brings it back
    meta = desired["metadata"]
    if (
        current["annotations"].get(ANNOTATION_SPEC_HASH)
        != meta["annotations"][ANNOTATION_SPEC_HASH]
    ):
        return True
    return not (
        contains(current["labels"], meta.get("labels", {}))
        and contains(current["annotations"], meta.get("annotations", {}))
        and contains(current["spec"], desired.get("spec"))
        and contains(current["data"], desired.get("data"))
    )


def contains(actual: Any, wanted: Any) -> bool:
    """Does `actual` (as the API server returns it, with defaults filled in) hold all of `wanted`?"""
    if isinstance(wanted, Mapping):
        if not wanted:
            return True  # the server drops empty objects
        if not isinstance(actual, Mapping):
            return False
        return all(contains(actual.get(key), value) for key, value in wanted.items())
    if isinstance(wanted, list):
        if not wanted:
            return not actual
        if not isinstance(actual, list) or len(actual) != len(wanted):
            return False
        return all(contains(a, w) for a, w in zip(actual, wanted, strict=True))
    return actual == wanted or _same_quantity(actual, wanted)


def rolled_out(workload: Mapping[str, Any]) -> bool:
    """Has the workload's controller finished moving every pod to the current template, all ready?"""
    status = workload.get("status") or {}
    spec = workload.get("spec") or {}
    want = spec.get("replicas", 1)
    if status.get("observedGeneration") != workload.get("generation"):
        return False
    if workload["kind"] == "StatefulSet" and status.get("currentRevision") != status.get(
        "updateRevision"
    ):
        return False
    return (
        status.get("updatedReplicas", 0) == want
        and status.get("readyReplicas", 0) == want
        and status.get("replicas", 0) == want
    )


def _same_quantity(actual: Any, wanted: Any) -> bool:
    # "0.5" is stored as "500m", "2048Mi" as "2Gi": equal values are not drift.
    if not (isinstance(actual, str) and isinstance(wanted, str)):
        return False
    try:
        return quantity(actual) == quantity(wanted)
    except InvalidSpec:
        return False


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value
