"""Leader election on a coordination.k8s.io Lease, so that two operator replicas never both act.

The holder renews the Lease every third of its duration. A standby takes it over once it has watched
the same renewal stay unchanged for a whole duration, measured on its own clock (as client-go does),
so clock skew between hosts does not matter. A leader that cannot renew in time stops acting.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from meridian.operator.kube import ApiError, KubeClient, resource_path

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    api: KubeClient
    namespace: str
    name: str
    identity: str
    seconds: float
    # The last record seen from another holder, and when (monotonic) this process first saw it.
    _seen: tuple[Any, ...] = field(default=(), repr=False)
    _seen_at: float = field(default=0.0, repr=False)
    _held: dict[str, Any] | None = field(default=None, repr=False)  # our last write, while leading

    @property
    def path(self) -> str:
        return resource_path("coordination.k8s.io/v1", "Lease", self.namespace, self.name)

    async def acquire(self) -> None:
        """Wait until this process holds the Lease."""
        waiting_logged = False
        while True:
            try:
                if await self.try_acquire():
                    break
            except ApiError as error:
                logger.warning(
                    "could not read the Lease %s/%s: %s", self.namespace, self.name, error
                )
            if not waiting_logged:
                logger.info("waiting to lead: Lease %s/%s is held", self.namespace, self.name)
                waiting_logged = True
            await asyncio.sleep(self.seconds / 3)
        logger.info("leading as %s (Lease %s/%s)", self.identity, self.namespace, self.name)

    async def hold(self) -> None:
        """Renew until renewal fails for longer than the Lease lasts; then return (leadership lost)."""
        deadline = time.monotonic() + self.seconds
        while True:
            await asyncio.sleep(self.seconds / 3)
            try:
                if await self.try_acquire():
                    deadline = time.monotonic() + self.seconds
                    continue
                logger.error("lost the Lease %s/%s to another operator", self.namespace, self.name)
                return
            except ApiError as error:
                logger.warning("could not renew the Lease: %s", error)
            if time.monotonic() > deadline:
                logger.error("could not renew the Lease for %.0f s; stepping down", self.seconds)
                return

    async def release(self) -> None:
        """Hand over at once on a clean shutdown instead of making standbys wait out the Lease."""
        self._held = None
        try:
            lease = await self.api.request("GET", self.path)
            if lease.get("spec", {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = None
                await self.api.request("PUT", self.path, body=lease)
        except ApiError as error:
            logger.warning("could not release the Lease: %s", error)

    async def try_acquire(self) -> bool:
        now = _micro_time()
        if self._held is not None and await self._renew(self._held, now):
            return True
        try:
            lease = await self.api.request("GET", self.path)
        except ApiError as error:
            if error.status != 404:
                raise
            return await self._create(now)
        spec = lease.setdefault("spec", {})
        holder = spec.get("holderIdentity")
        if holder and holder != self.identity and not self._expired(spec):
            return False
        if holder != self.identity:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = spec.get("leaseTransitions", 0) + 1
        spec.update(holderIdentity=self.identity, leaseDurationSeconds=int(self.seconds))
        spec["renewTime"] = now
        return await self._write("PUT", self.path, lease)

    async def _renew(self, lease: dict[str, Any], now: str) -> bool:
        """One PUT on top of this holder's own last write; a conflict means look again (GET)."""
        self._held = None
        lease["spec"]["renewTime"] = now
        return await self._write("PUT", self.path, lease)

    async def _write(self, method: str, path: str, lease: dict[str, Any]) -> bool:
        """Write the Lease and keep what the API returned as ours. False if someone else wrote
        first: the resourceVersion (or, creating, the name) makes the slower writer get a 409."""
        try:
            self._held = await self.api.request(method, path, body=lease)
        except ApiError as error:
            if error.status == 409:
                return False
            raise
        return True

    def _expired(self, spec: dict[str, Any]) -> bool:
        record = (spec.get("holderIdentity"), spec.get("renewTime"))
        if record != self._seen:
            self._seen, self._seen_at = record, time.monotonic()
        lasts = spec.get("leaseDurationSeconds") or self.seconds
        return time.monotonic() - self._seen_at > lasts

    async def _create(self, now: str) -> bool:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.seconds),
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            },
        }
        return await self._write("POST", self.path.rsplit("/", 1)[0], body)


def _micro_time() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
