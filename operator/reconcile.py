"""One reconcile pass for one ModelDeployment, and the bookkeeping that keeps passes few.

A pass reads only the watch caches (kopf indexes), so it costs no API request unless something must
change: children applied or deleted, or a status that differs from the one last written. Passes for
one ModelDeployment never overlap; a burst of events while one runs collapses into one more pass.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from meridian.operator.children import ANNOTATION_SPEC_HASH, LABEL_REGION, build_children
from meridian.operator.kube import ApiError, KubeClient
from meridian.operator.rollout import Plan, plan_changes
from meridian.operator.settings import Settings
from meridian.operator.spec import InvalidSpec, parse_spec
from meridian.operator.status import (
    compute_status,
    invalid_spec_status,
    region_status,
    status_events,
)

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, ModelDeployment name)


@dataclass(frozen=True)
class Caches:
    """The kopf indexes a pass reads: ModelDeployments, their children, their worker pods."""

    fleets: Mapping[Key, Any]
    owned: Mapping[Key, Any]
    worker_pods: Mapping[Key, Any]


@dataclass
class _Pass:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    again: bool = False  # something changed while a pass was running
    written: dict[str, Any] | None = None  # the status this process last wrote


class Reconciler:
    def __init__(
        self,
        settings: Settings,
        api: KubeClient,
        post_event: Callable[..., None] = kopf.event,
    ) -> None:
        self.settings = settings
        self.api = api
        self.post_event = post_event  # called as kopf.event(body, type=, reason=, message=)
        self._passes: dict[Key, _Pass] = {}
        self._retry_at: dict[Key, float] = {}
        self._terminating: set[str] = set()  # namespaces being deleted
        self._next_resync = time.monotonic() + settings.resync_seconds

    async def reconcile(self, key: Key, caches: Caches) -> None:
        """Run a pass now and let its errors out (for kopf's spec handlers to classify)."""
        state = self._passes.setdefault(key, _Pass())
        async with state.lock:
            state.again = True
            await self._drain(key, state, caches)

    async def poke(self, key: Key, caches: Caches) -> None:
        """Something about this ModelDeployment changed: run a pass unless one is running."""
        state = self._passes.setdefault(key, _Pass())
        state.again = True
        if state.lock.locked():
            return  # the running pass goes round once more
        async with state.lock:
            # Events come in bursts (a rollout moves many pods); let one pass answer the burst.
            await asyncio.sleep(self.settings.settle_seconds)
            try:
                await self._drain(key, state, caches)
            except InvalidSpec:
                pass  # reported in status; the next spec change tries again
            except ApiError as error:
                if error.namespace_terminating:
                    self._terminating.add(key[0])
                    return
                logger.warning("reconciling %s/%s failed, retrying: %s", *key, error)
                self._retry_at[key] = time.monotonic() + self.settings.retry_seconds

    async def resync_forever(self, caches: Caches) -> None:
        """Retry failed passes, and compare every ModelDeployment with its children periodically."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            due = {key for key, at in self._retry_at.items() if at <= now}
            if now >= self._next_resync:
                due.update(caches.fleets.keys())
                self._next_resync = now + self.settings.resync_seconds
            for key in due:
                self._retry_at.pop(key, None)
                await self.poke(key, caches)

    async def _drain(self, key: Key, state: _Pass, caches: Caches) -> None:
        while state.again:
            state.again = False
            body = next(iter(caches.fleets.get(key, ())), None)
            if body is None:  # deleted: its children go with it (owner references)
                self._passes.pop(key, None)
                if not any(ns == key[0] for ns, _ in caches.fleets):
                    self._terminating.discard(key[0])
                return
            if key[0] in self._terminating:
                return  # the namespace is being deleted, and everything in it
            await self._pass(body, state, caches)

    async def _pass(self, body: dict[str, Any], state: _Pass, caches: Caches) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        previous = state.written or body.get("status") or {}
        try:
            fleet = parse_spec(meta["name"], meta["namespace"], body["spec"])
        except InvalidSpec as error:
            status = invalid_spec_status(meta["generation"], str(error), previous, _now())
            await self._write_status(body, state, previous, status)
            raise
        desired = build_children(fleet)
        kopf.adopt([child for children in desired.values() for child in children], owner=body)
        observed = list(caches.owned.get(key, ()))
        plan = plan_changes(fleet, meta["uid"], desired, observed)
        await self._execute(body, plan, {(c["kind"], c["name"]): c for c in observed})
        changing = {child["metadata"]["labels"].get(LABEL_REGION) for child in plan.apply}
        pods = list(caches.worker_pods.get(key, ()))
        regions = [
            region_status(
                fleet,
                region,
                observed,
                pods,
                changing=region.name in changing,
                waiting=region.name in plan.waiting,
            )
            for region in fleet.regions
        ]
        status = compute_status(fleet, meta["generation"], regions, previous, _now())
        await self._write_status(body, state, previous, status)

    async def _execute(self, body: dict[str, Any], plan: Plan, seen: dict[Any, Any]) -> None:
        """Apply region by region, all regions at once; one Event per region and kind of change."""
        by_region: dict[str, list[dict[str, Any]]] = {}
        for child in plan.apply:
            by_region.setdefault(child["metadata"]["labels"].get(LABEL_REGION), []).append(child)
        results = await asyncio.gather(
            *(
                self._apply_region(body, region, children, seen)
                for region, children in by_region.items()
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        meta = body["metadata"]
        gone: dict[str, list[str]] = {}
        for child in plan.delete:
            await self.api.delete(
                child["apiVersion"], child["kind"], meta["namespace"], child["name"]
            )
            gone.setdefault(child["region"], []).append(f"{child['kind']} {child['name']}")
        for region, names in gone.items():
            message = f"region {region} removed: deleted {', '.join(names)}"
            self.post_event(body, type="Normal", reason="Deleted", message=message)

    async def _apply_region(
        self,
        body: dict[str, Any],
        region: str,
        children: list[dict[str, Any]],
        seen: dict[Any, Any],
    ) -> None:
        done: dict[str, list[str]] = {}
        for child in children:  # in build order: config and Services before workers
            await self.api.apply(child, self.settings.field_manager)
            reason = _change(child, seen.get((child["kind"], child["metadata"]["name"])))
            done.setdefault(reason, []).append(f"{child['kind']} {child['metadata']['name']}")
        for reason, names in done.items():
            message = f"region {region}: {CHANGE_VERBS[reason]} {', '.join(names)}"
            self.post_event(body, type="Normal", reason=reason, message=message)

    async def _write_status(
        self,
        body: dict[str, Any],
        state: _Pass,
        previous: Mapping[str, Any],
        status: dict[str, Any],
    ) -> None:
        if status == previous:
            return
        meta = body["metadata"]
        await self.api.patch_status(
            body["apiVersion"], body["kind"], meta["namespace"], meta["name"], status
        )
        state.written = status
        for type_, reason, message in status_events(previous, status):
            self.post_event(body, type=type_, reason=reason, message=message)


CHANGE_VERBS = {
    "Created": "created",
    "Updated": "updated",
    "Restored": "put back the operator's settings of",
}


def _change(child: Mapping[str, Any], current: Mapping[str, Any] | None) -> str:
    """Created, Updated (the spec changed it) or Restored (someone else had changed it)."""
    if current is None:
        return "Created"
    ours = child["metadata"]["annotations"].get(ANNOTATION_SPEC_HASH)
    return "Restored" if current["annotations"].get(ANNOTATION_SPEC_HASH) == ours else "Updated"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
