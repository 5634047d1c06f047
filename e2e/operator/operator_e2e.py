"""Helpers for the operator's e2e tests: kubectl, polling, and operator processes."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "e2e" / "cluster"
OPERATOR_NAMESPACE = "meridian-system"


class Kube:
    """kubectl against the e2e cluster, as a user would type it."""

    def __init__(self, kubeconfig: str) -> None:
        self.kubeconfig = kubeconfig
        self.binary = cluster_env()["KUBE_BIN"] + "/kubectl"

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> str:
        result = subprocess.run(
            [self.binary, "--kubeconfig", self.kubeconfig, *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, args, result.stdout, result.stderr
            )
        return result.stdout if check else result.stdout + result.stderr

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))

    def apply(
        self, obj: dict[str, Any] | list[dict[str, Any]], namespace: str | None = None
    ) -> str:
        docs = obj if isinstance(obj, list) else [obj]
        ns = ["-n", namespace] if namespace else []
        return self("apply", *ns, "-f", "-", input=yaml.safe_dump_all(docs))

    def items(self, kind: str, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, "-n", namespace] + (["-l", selector] if selector else [])
        return self.json(*args)["items"]


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60, every: float = 0.5) -> Any:
    """Poll check() until it returns something truthy; fail with `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last saw: {last!r}")


class Operator:
    """`meridian operator` processes, logged in as the operator's service account."""

    def __init__(self, kubeconfig: str, log_dir: pathlib.Path) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.logs: dict[subprocess.Popen[bytes], pathlib.Path] = {}
        self.identities: dict[subprocess.Popen[bytes], str] = {}

    def start(self, identity: str | None = None) -> subprocess.Popen[bytes]:
        identity = identity or f"e2e-{len(self.logs)}"
        path = self.log_dir / f"operator-{identity}-{len(self.logs)}.log"
        # The installed entry point, as in the operator's Deployment.
        meridian = str(pathlib.Path(sys.executable).with_name("meridian"))
        command = [
            meridian,
            "--log-level=INFO",
            "operator",
            "--all-namespaces",
            "--identity",
            identity,
        ]
        command += ["--lease-namespace", OPERATOR_NAMESPACE]
        with path.open("wb") as log:
            process = subprocess.Popen(
                command,
                # PYTHONSAFEPATH: the repository's operator/ folder must not shadow the stdlib.
                env={**os.environ, "KUBECONFIG": self.kubeconfig, "PYTHONSAFEPATH": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.logs[process] = path
        self.identities[process] = identity
        return process

    def log(self, process: subprocess.Popen[bytes]) -> str:
        return self.logs[process].read_text(errors="replace")

    def stop(self, process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def stop_all(self) -> None:
        for process in self.logs:
            self.stop(process)


def cluster_env() -> dict[str, str]:
    script = f'source "{CLUSTER}/env.sh"; echo "$KUBE_BIN"; echo "$STATE_DIR"'
    kube_bin, state_dir = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    return {"KUBE_BIN": kube_bin, "STATE_DIR": state_dir}


@contextlib.contextmanager
def cluster_up() -> Iterator[str]:
    """The e2e cluster's admin kubeconfig path. Starts the cluster unless it is up, and stops it
    afterwards unless it was already up or MERIDIAN_KEEP_CLUSTER=1."""
    already_up = pathlib.Path(cluster_env()["STATE_DIR"], "kubeconfig").exists()
    started = subprocess.run([str(CLUSTER / "up")], capture_output=True, text=True, timeout=600)
    if started.returncode != 0:
        pytest.fail(
            "e2e/cluster/up failed (`make test-e2e` builds the cluster first; "
            f"or run e2e/cluster/build):\n{started.stderr[-4000:]}"
        )
    try:
        yield started.stdout.strip().splitlines()[-1].removeprefix("export KUBECONFIG=")
    finally:
        if not already_up and os.environ.get("MERIDIAN_KEEP_CLUSTER") != "1":
            subprocess.run([str(CLUSTER / "down")], timeout=120, check=False)


def read_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "manifests" / "examples" / name).read_text())


def lease_holder(kube: Kube) -> str | None:
    out = kube(
        "get",
        "lease",
        "meridian-operator",
        "-n",
        OPERATOR_NAMESPACE,
        "-o",
        "jsonpath={.spec.holderIdentity}",
        check=False,
    )
    return out.strip() or None


def model_deployment(name: str, regions: dict[str, int], **spec: Any) -> dict[str, Any]:
    """A small ModelDeployment: region name -> replicas, one GPU per worker unless spec says."""
    body: dict[str, Any] = {
        "apiVersion": "serving.meridian.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "smollm2-135m-instruct"},
            "image": "meridian:0.1.0",
            "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
            "regions": [{"name": region, "replicas": n} for region, n in regions.items()],
        },
    }
    body["spec"].update(spec)
    return body


def condition(md: dict[str, Any], kind: str) -> dict[str, Any]:
    for item in md.get("status", {}).get("conditions", []):
        if item["type"] == kind:
            return item
    return {}


def is_ready(md: dict[str, Any]) -> bool:
    status = md.get("status", {})
    return (
        condition(md, "Ready").get("status") == "True"
        and status.get("observedGeneration") == md["metadata"]["generation"]
    )


def operator_requests(audit_log: pathlib.Path) -> list[dict[str, Any]]:
    """Requests the operator's service account made, one entry each, from the API server's audit log."""
    requests = {}
    with audit_log.open() as lines:
        for line in lines:
            event = json.loads(line)
            if event["user"]["username"].endswith(":meridian-operator"):
                requests[event["auditID"]] = event
    return list(requests.values())
