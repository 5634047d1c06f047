"""The operator against a real control plane: e2e/cluster/up, the manifests, and `meridian operator`.

The cluster is built by `make test-e2e` before pytest runs (building takes far longer than a test's
timeout); here it is only started. MERIDIAN_SKIP_CLUSTER=1 skips these tests, loudly.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import uuid
import warnings
from collections.abc import Iterator

import pytest
import yaml
from operator_e2e import (
    OPERATOR_NAMESPACE,
    ROOT,
    Kube,
    Operator,
    cluster_up,
    lease_holder,
    wait_until,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "all_gpus: needs every GPU of the e2e cluster free")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The scale test leaves the most to clean up; nothing after it has to wait for that.
    items.sort(key=lambda item: pathlib.Path(str(item.fspath)).name == "test_operator_scale.py")
    if os.environ.get("MERIDIAN_SKIP_CLUSTER") != "1":
        return
    reason = (
        "MERIDIAN_SKIP_CLUSTER=1: the operator's e2e tests against a real control plane did NOT run"
    )
    warnings.warn(reason, stacklevel=1)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"WARNING: {reason}", yellow=True, bold=True)
    for item in items:
        if pathlib.Path(str(item.fspath)).is_relative_to(pathlib.Path(__file__).parent):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    """The e2e cluster, started for this session (and stopped after, unless it was already up)."""
    with cluster_up() as kubeconfig:
        yield Kube(kubeconfig)


@pytest.fixture(scope="session")
def installed(kube: Kube) -> Kube:
    """`kubectl apply -k manifests/`: the CRD, namespace, RBAC and the operator's Deployment."""
    kube("apply", "-k", str(ROOT / "manifests"))
    kube(
        "wait",
        "--for=condition=Established",
        "crd/modeldeployments.serving.meridian.dev",
        "--timeout=30s",
    )
    return kube


@pytest.fixture(scope="session")
def operator_kubeconfig(installed: Kube, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A kubeconfig holding a token of the meridian-operator service account: the manifests' RBAC applies."""
    token = installed(
        "create", "token", "meridian-operator", "-n", OPERATOR_NAMESPACE, "--duration=2h"
    ).strip()
    admin = yaml.safe_load(pathlib.Path(installed.kubeconfig).read_text())
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": "meridian-operator", "user": {"token": token}}],
        "contexts": [
            {
                "name": "operator",
                "context": {"cluster": admin["clusters"][0]["name"], "user": "meridian-operator"},
            }
        ],
        "current-context": "operator",
    }
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="session")
def operators(
    operator_kubeconfig: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """Operator processes; tests start and stop them. All are stopped at the end of the session."""
    runner = Operator(operator_kubeconfig, tmp_path_factory.mktemp("operator-logs"))
    try:
        yield runner
    finally:
        runner.stop_all()


@pytest.fixture
def operator(operators: Operator, installed: Kube) -> subprocess.Popen[bytes]:
    """A running operator holding the Lease (the one from an earlier test, or a new one)."""
    running = [p for p in operators.logs if p.poll() is None]
    process = running[-1] if running else operators.start()
    identity = operators.identities[process]
    wait_until("the operator to lead", lambda: lease_holder(installed) == identity, timeout=60)
    return process


@pytest.fixture
def namespace(installed: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own, deleted afterwards without waiting.

    Tests marked all_gpus count on the whole cluster's GPUs: earlier tests' pods are gone first.
    """
    if request.node.get_closest_marker("all_gpus"):

        def no_test_namespaces() -> bool:
            names = [ns["metadata"]["name"] for ns in installed.json("get", "namespaces")["items"]]
            return not [name for name in names if name.startswith("e2e-")]

        wait_until("earlier test namespaces to finish terminating", no_test_namespaces, 120, 1.0)
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    installed("create", "namespace", name)
    yield name
    installed("delete", "namespace", name, "--wait=false")
