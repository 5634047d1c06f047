"""A reconcile pass end to end against an API that records calls, and caches the test fills in."""

from __future__ import annotations

import asyncio

import pytest
from modeldeployments import model_deployment, served

from meridian.operator.kube import ApiError
from meridian.operator.reconcile import Caches, Reconciler
from meridian.operator.settings import Settings
from meridian.operator.spec import InvalidSpec

KEY = ("serving", "chat")


class RecordingApi:
    def __init__(self, fail_with: ApiError | None = None) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.applied: list[dict] = []
        self.statuses: list[dict] = []
        self.fail_with = fail_with

    async def apply(self, obj, field_manager):
        if self.fail_with:
            raise self.fail_with
        assert field_manager == "meridian-operator"
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        self.applied.append(obj)
        return obj

    async def delete(self, api_version, kind, namespace, name):
        self.calls.append(("delete", kind, name))

    async def patch_status(self, api_version, kind, namespace, name, status):
        self.calls.append(("status", kind, name))
        self.statuses.append(status)


class World:
    """The kopf indexes, as plain dicts of lists."""

    def __init__(self, body):
        self.fleets = {KEY: [body]}
        self.owned: dict = {KEY: []}
        self.pods: dict = {KEY: []}
        self.events: list[tuple[str, str, str]] = []
        self.api = RecordingApi()
        settings = Settings(all_namespaces=True, settle_seconds=0)
        self.reconciler = Reconciler(settings, self.api, self.post_event)

    def post_event(self, body, *, type, reason, message):
        self.events.append((type, reason, message))

    @property
    def caches(self):
        return Caches(self.fleets, self.owned, self.pods)

    def reconcile(self):
        self.api.calls.clear()
        asyncio.run(self.reconciler.reconcile(KEY, self.caches))
        return list(self.api.calls)

    def settle(self):
        """The API server stored what was applied; the watches report it back."""
        by_name = {(c["kind"], c["name"]): c for c in self.owned[KEY]}
        for child in self.api.applied:
            by_name[(child["kind"], child["metadata"]["name"])] = served(child)
        self.owned[KEY] = list(by_name.values())
        self.fleets[KEY][0]["status"] = self.api.statuses[-1]


@pytest.fixture
def world(spec):
    return World(model_deployment(spec))


def test_first_pass_creates_children_owned_by_the_deployment_and_reports_progress(world):
    calls = world.reconcile()
    assert [c for c in calls if c[0] == "apply"][:3] == [
        ("apply", "ConfigMap", "chat-us-east-engine"),
        ("apply", "Service", "chat-us-east"),
        ("apply", "Deployment", "chat-us-east"),
    ]
    assert calls[-1] == ("status", "ModelDeployment", "chat")
    for child in world.api.applied:
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "ModelDeployment",
            "chat",
            "uid-1",
            True,
        )
    ready = next(c for c in world.api.statuses[-1]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    created = "region eu-west: created ConfigMap chat-eu-west-engine, Service chat-eu-west, Deployment chat-eu-west"
    assert ("Normal", "Created", created) in world.events


def test_once_settled_a_pass_makes_no_api_request(world):
    world.reconcile()
    world.settle()
    assert world.reconcile() == [("status", "ModelDeployment", "chat")]  # now Ready
    world.fleets[KEY][0]["status"] = world.api.statuses[-1]
    assert world.reconcile() == []
    assert ("Normal", "Ready", "5/5 replicas ready in us-east, eu-west, ap-south") in world.events


def test_a_deleted_child_is_restored_on_the_next_pass(world):
    world.reconcile()
    world.settle()
    world.reconcile()
    world.owned[KEY] = [c for c in world.owned[KEY] if c["name"] != "chat-ap-south"]
    calls = world.reconcile()
    assert ("apply", "Deployment", "chat-ap-south") in calls
    assert ("apply", "Service", "chat-ap-south") in calls


def test_an_invalid_spec_reports_degraded_and_touches_no_child(world):
    world.fleets[KEY][0]["spec"]["engine"]["extraArgs"] = ["--port", "1"]
    with pytest.raises(InvalidSpec, match="must not contain --port"):
        world.reconcile()
    assert [c[0] for c in world.api.calls] == ["status"]
    degraded = next(c for c in world.api.statuses[-1]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert world.events[-1][:2] == ("Warning", "InvalidSpec")


def test_a_poke_that_hits_a_transient_error_is_retried_later(world):
    world.api.fail_with = ApiError(503, "etcd leader changed")
    asyncio.run(world.reconciler.poke(KEY, world.caches))
    assert KEY in world.reconciler._retry_at


def test_a_deleted_deployment_is_forgotten(world):
    world.fleets[KEY] = []
    assert world.reconcile() == []
    assert KEY not in world.reconciler._passes


def test_an_edited_child_is_restored_and_the_event_says_so(world):
    world.reconcile()
    world.settle()
    world.reconcile()
    deployment = next(
        c for c in world.owned[KEY] if c["name"] == "chat-us-east" and c["kind"] == "Deployment"
    )
    deployment["spec"]["replicas"] = 9
    assert [c for c in world.reconcile() if c[0] == "apply"] == [
        ("apply", "Deployment", "chat-us-east")
    ]
    restored = "region us-east: put back the operator's settings of Deployment chat-us-east"
    assert ("Normal", "Restored", restored) in world.events


def test_removing_a_region_deletes_its_children_and_says_so(world):
    world.reconcile()
    world.settle()
    world.reconcile()
    world.fleets[KEY][0]["spec"]["regions"].pop(1)
    calls = world.reconcile()
    assert sorted(c for c in calls if c[0] == "delete") == [
        ("delete", "ConfigMap", "chat-eu-west-engine"),
        ("delete", "Deployment", "chat-eu-west"),
        ("delete", "Service", "chat-eu-west"),
    ]
    assert any(
        e[1] == "Deleted" and e[2].startswith("region eu-west removed: deleted")
        for e in world.events
    )


def test_a_namespace_being_deleted_is_left_alone(world):
    terminating = ApiError(403, "namespace serving is being terminated", ("NamespaceTerminating",))
    world.api.fail_with = terminating
    asyncio.run(world.reconciler.poke(KEY, world.caches))
    assert KEY not in world.reconciler._retry_at
    world.api.fail_with = None
    asyncio.run(world.reconciler.poke(KEY, world.caches))
    assert world.api.calls == []
