"""EndpointSlice discovery against the e2e control plane: slices written by hand (as the EndpointSlice
controller would for a Service's pods), each change followed within seconds.

About 10 s once the cluster is up (starting it takes about a minute when it is not).
"""

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator

import kubernetes
import pytest
from kubernetes.client import (
    CoreV1Api,
    DiscoveryV1Api,
    DiscoveryV1EndpointPort,
    V1Endpoint,
    V1EndpointConditions,
    V1EndpointSlice,
    V1Namespace,
    V1ObjectMeta,
    V1Service,
    V1ServicePort,
    V1ServiceSpec,
)

from meridian.gateway.discovery import parse_endpointslices, watch

pytestmark = pytest.mark.timeout(300)  # includes starting the cluster


@pytest.fixture
def api_client(kubeconfig: str) -> Iterator[kubernetes.client.ApiClient]:
    client = kubernetes.config.new_client_from_config(config_file=kubeconfig, persist_config=False)
    with client:
        yield client


@pytest.fixture
def namespace(api_client: kubernetes.client.ApiClient) -> Iterator[str]:
    """A namespace of the test's own with a headless Service `workers`; deleted without waiting.
    (Not named e2e-*: the operator suite waits for those to be gone.)"""
    name = f"discovery-{uuid.uuid4().hex[:8]}"
    core = CoreV1Api(api_client)
    core.create_namespace(V1Namespace(metadata=V1ObjectMeta(name=name)))
    service = V1Service(
        metadata=V1ObjectMeta(name="workers"),
        spec=V1ServiceSpec(cluster_ip="None", ports=[V1ServicePort(name="grpc", port=50051)]),
    )
    core.create_namespaced_service(name, service)
    yield name
    core.delete_namespace(name)


def endpoint_slice(name: str, service: str, endpoints: dict[str, bool]) -> V1EndpointSlice:
    """A slice as the EndpointSlice controller writes it: address -> ready, two named ports."""
    return V1EndpointSlice(
        api_version="discovery.k8s.io/v1",
        kind="EndpointSlice",
        metadata=V1ObjectMeta(
            name=name,
            labels={
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "e2e.meridian.dev",
            },
        ),
        address_type="IPv4",
        endpoints=[
            V1Endpoint(addresses=[ip], conditions=V1EndpointConditions(ready=ready))
            for ip, ready in endpoints.items()
        ],
        ports=[
            DiscoveryV1EndpointPort(name="metrics", port=9090, protocol="TCP"),
            DiscoveryV1EndpointPort(name="grpc", port=50051, protocol="TCP"),
        ],
    )


def test_slices_are_followed_as_they_change(api_client, namespace: str, follow):
    slices = DiscoveryV1Api(api_client)
    a = endpoint_slice("workers-a", "workers", {"10.1.0.1": True, "10.1.0.2": True})
    slices.create_namespaced_endpoint_slice(namespace, a)
    other = endpoint_slice("other-a", "other", {"10.1.0.99": True})  # another Service's
    slices.create_namespaced_endpoint_slice(namespace, other)

    def write(new: V1EndpointSlice) -> None:
        slices.replace_namespaced_endpoint_slice(new.metadata.name, namespace, new)

    async def main():
        source = parse_endpointslices(f"{namespace}/workers")
        changes = follow(watch(source, api_client=api_client))
        assert await changes.next(10) == {"10.1.0.1:50051", "10.1.0.2:50051"}

        write(endpoint_slice("workers-a", "workers", {f"10.1.0.{i}": True for i in (1, 2, 3)}))
        await changes.until({"10.1.0.1:50051", "10.1.0.2:50051", "10.1.0.3:50051"}, timeout=5)

        write(
            endpoint_slice(
                "workers-a", "workers", {"10.1.0.1": False, "10.1.0.2": True, "10.1.0.3": True}
            )
        )
        await changes.until({"10.1.0.2:50051", "10.1.0.3:50051"}, timeout=5)

        b = endpoint_slice("workers-b", "workers", {"10.1.1.1": True})
        slices.create_namespaced_endpoint_slice(namespace, b)
        await changes.until({"10.1.0.2:50051", "10.1.0.3:50051", "10.1.1.1:50051"}, timeout=5)

        slices.delete_namespaced_endpoint_slice("workers-a", namespace)
        await changes.until({"10.1.1.1:50051"}, timeout=5)

        # Quiet for longer than one watch lasts: resuming the watch neither loses nor repeats.
        await asyncio.sleep(7)
        slices.delete_namespaced_endpoint_slice("workers-b", namespace)
        await changes.until(set(), timeout=5)
        await changes.close()

    asyncio.run(main())
    # Closing the stream shuts the watch's socket: its thread ends now, not when the watch would.
    deadline = time.monotonic() + 1
    while any(t.name.startswith("discovery endpointslices") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the EndpointSlice thread outlived its watch by 1 s"
        time.sleep(0.01)
