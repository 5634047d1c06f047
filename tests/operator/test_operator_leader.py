"""Leader election against an in-memory Lease that enforces resourceVersion like the API server."""

from __future__ import annotations

import asyncio
import copy

import pytest

from meridian.operator import leader
from meridian.operator.kube import ApiError
from meridian.operator.leader import Lease


class LeaseStore:
    def __init__(self) -> None:
        self.lease: dict | None = None
        self.version = 0
        self.requests: list[str] = []

    async def request(self, method, path, *, body=None, **_):
        await asyncio.sleep(0)  # let concurrent callers interleave, as real requests do
        self.requests.append(method)
        if method == "GET":
            if self.lease is None:
                raise ApiError(404, "not found")
            return copy.deepcopy(self.lease)
        if method == "POST":
            if self.lease is not None:
                raise ApiError(409, "already exists")
        elif body["metadata"].get("resourceVersion") != str(self.version):
            raise ApiError(409, "the object has been modified")
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(leader.time, "monotonic", lambda: now[0])
    return now


def lease(store, identity):
    return Lease(store, "meridian-system", "meridian-operator", identity, seconds=15)


def test_the_first_replica_takes_the_lease_and_keeps_it(clock):
    store = LeaseStore()
    a, b = lease(store, "a"), lease(store, "b")
    assert asyncio.run(a.try_acquire())
    assert not asyncio.run(b.try_acquire())
    assert asyncio.run(a.try_acquire())  # renewing
    assert store.lease["spec"]["holderIdentity"] == "a"


def test_a_standby_takes_over_only_after_the_leader_stops_renewing(clock):
    store = LeaseStore()
    a, b = lease(store, "a"), lease(store, "b")
    asyncio.run(a.try_acquire())
    assert not asyncio.run(b.try_acquire())
    clock[0] += 10
    assert not asyncio.run(b.try_acquire())
    clock[0] += 6  # 16 s without a renewal seen by b
    assert asyncio.run(b.try_acquire())
    assert store.lease["spec"]["holderIdentity"] == "b"
    assert store.lease["spec"]["leaseTransitions"] == 1
    assert not asyncio.run(a.try_acquire())


def test_renewals_keep_a_standby_waiting(clock):
    store = LeaseStore()
    a, b = lease(store, "a"), lease(store, "b")
    for _ in range(5):
        asyncio.run(a.try_acquire())
        assert not asyncio.run(b.try_acquire())
        clock[0] += 5
        store.lease["spec"]["renewTime"] += "x"  # a fresh renewal stamp each round


def test_a_released_lease_is_taken_at_once(clock):
    store = LeaseStore()
    a, b = lease(store, "a"), lease(store, "b")
    asyncio.run(a.try_acquire())
    asyncio.run(a.release())
    assert asyncio.run(b.try_acquire())


def test_two_replicas_racing_for_a_free_lease_get_one_winner(clock):
    store = LeaseStore()
    a, b = lease(store, "a"), lease(store, "b")

    async def race():
        return await asyncio.gather(a.try_acquire(), b.try_acquire())

    assert sorted(asyncio.run(race())) == [False, True]


def test_the_leader_renews_with_one_request(clock):
    store = LeaseStore()
    a = lease(store, "a")
    asyncio.run(a.try_acquire())
    store.requests.clear()
    for _ in range(3):
        assert asyncio.run(a.try_acquire())
    assert store.requests == ["PUT"] * 3


def test_a_leader_whose_lease_was_taken_finds_out_on_renewal(clock):
    store = LeaseStore()
    a, b = lease(store, "a"), lease(store, "b")
    asyncio.run(a.try_acquire())
    assert not asyncio.run(b.try_acquire())
    clock[0] += 20
    assert asyncio.run(b.try_acquire())  # b saw no renewal for 20 s (a was paused)
    assert store.lease["spec"]["holderIdentity"] == "b"
    assert not asyncio.run(a.try_acquire())
