"""kopf handlers. Each is a few lines: the watches fill indexes, and changes poke the Reconciler.

Spec changes go through kopf's change handlers, so a spec the operator cannot serve is a
PermanentError and a transient API failure is a TemporaryError (retried by kopf). Changes to
children and worker pods are plain events: they poke a pass that repairs drift and refreshes status.
No timer or daemon is registered on ModelDeployments, so kopf adds no finalizer to them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from meridian.operator.children import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGER
from meridian.operator.kube import ApiError, connection_info
from meridian.operator.reconcile import Caches
from meridian.operator.rollout import observe_child
from meridian.operator.settings import Settings
from meridian.operator.spec import GROUP, PLURAL, VERSION, InvalidSpec
from meridian.operator.status import observe_pod

OWNED = {LABEL_MANAGED_BY: MANAGER}
CHILD_RESOURCES = (
    ("v1", "configmaps"),
    ("v1", "services"),
    ("apps/v1", "deployments"),
    ("apps/v1", "statefulsets"),
)


def kopf_settings(settings: Settings) -> kopf.OperatorSettings:
    kopf_settings = kopf.OperatorSettings()
    kopf_settings.peering.standalone = True  # a Lease elects the leader (meridian.operator.leader)
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-spec"
    )
    kopf_settings.posting.level = logging.INFO
    # An idle watch (no StatefulSets, say) may see no bookmark for over a minute; kopf's default of
    # 70 s would then reconnect it every 70 s, which is polling by another name.
    kopf_settings.watching.inactivity_timeout = 300
    # The API server filters children and pods, so the operator never sees unrelated objects.
    selector = f"{LABEL_MANAGED_BY}={MANAGER}"
    for api_version, plural in (*CHILD_RESOURCES, ("v1", "pods")):
        kopf_settings.watching.label_selectors[(api_version, plural)] = selector
    return kopf_settings


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return connection_info()


@kopf.on.startup()
async def start_resync(
    memo: kopf.Memo,
    fleets: kopf.Index,
    owned: kopf.Index,
    worker_pods: kopf.Index,
    **_: Any,
) -> None:
    caches = Caches(fleets, owned, worker_pods)
    memo.resync = asyncio.create_task(memo.reconciler.resync_forever(caches), name="resync")


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    memo.resync.cancel()


@kopf.index(GROUP, VERSION, PLURAL)
def fleets(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    meta = body.metadata
    plain = observe_child(body)
    fleet = {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": meta.uid,
            "generation": meta.get("generation", 0),
            "labels": dict(meta.labels),
        },
        "spec": plain["spec"],
        "status": plain["status"] or {},
    }
    return {(namespace, name): fleet}


def _index_children(fn: Any) -> Any:
    for api_version, plural in CHILD_RESOURCES:
        fn = kopf.index(api_version, plural, labels=OWNED, id="owned")(fn)
    return fn


@_index_children
def owned(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels.get(LABEL_DEPLOYMENT)): observe_child(body)}


@kopf.index("v1", "pods", labels=OWNED)
def worker_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels.get(LABEL_DEPLOYMENT)): observe_pod(body)}


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def spec_changed(
    namespace: str,
    name: str,
    memo: kopf.Memo,
    fleets: kopf.Index,
    owned: kopf.Index,
    worker_pods: kopf.Index,
    **_: Any,
) -> None:
    try:
        await memo.reconciler.reconcile((namespace, name), Caches(fleets, owned, worker_pods))
    except InvalidSpec as error:
        raise kopf.PermanentError(f"the spec cannot be served: {error}") from error
    except ApiError as error:
        if error.namespace_terminating:
            return  # the ModelDeployment is about to go with its namespace
        if error.transient:
            raise kopf.TemporaryError(str(error), delay=memo.settings.retry_seconds) from error
        raise kopf.PermanentError(str(error)) from error


def _watch_children(fn: Any) -> Any:
    for api_version, plural in (*CHILD_RESOURCES, ("v1", "pods")):
        fn = kopf.on.event(api_version, plural, labels=OWNED, id="child_changed")(fn)
    return fn


@_watch_children
async def child_changed(
    namespace: str,
    labels: kopf.Labels,
    memo: kopf.Memo,
    fleets: kopf.Index,
    owned: kopf.Index,
    worker_pods: kopf.Index,
    **_: Any,
) -> None:
    owner = (namespace, labels.get(LABEL_DEPLOYMENT, ""))
    await memo.reconciler.poke(owner, Caches(fleets, owned, worker_pods))
