"""A thin async client for the few Kubernetes API calls the operator makes itself.

kopf watches and keeps the indexes; this client writes: server-side apply of children, deletes,
status patches and the leader Lease. It logs in the way kopf does (in-cluster service account, else
kubeconfig) and logs in again once when the API server says the token has expired.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

from meridian import __version__ as MERIDIAN_VERSION

logger = logging.getLogger(__name__)

PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Deployment": "deployments",
    "StatefulSet": "statefulsets",
    "Lease": "leases",
    "ModelDeployment": "modeldeployments",
}
USER_AGENT = f"meridian-operator/{MERIDIAN_VERSION}"
# Status codes worth retrying: conflicts, throttling, and the server's own trouble.
TRANSIENT = {409, 429, 500, 502, 503, 504}


class ApiError(Exception):
    def __init__(self, status: int, message: str, causes: tuple[str, ...] = ()) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.causes = (
            causes  # details.causes[].reason of the API's Status, e.g. NamespaceTerminating
        )

    @property
    def namespace_terminating(self) -> bool:
        """Nothing new can be made in a namespace being deleted; its objects are going anyway."""
        return self.status == 403 and "NamespaceTerminating" in self.causes

    @property
    def transient(self) -> bool:
        return self.status in TRANSIENT or self.status == 0


def connection_info() -> kopf.ConnectionInfo:
    """The operator's credentials: the pod's service account, else the kubeconfig."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig (set KUBECONFIG)")
    return info


def resource_path(
    api_version: str, kind: str, namespace: str | None, name: str | None = None
) -> str:
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = root + (f"/namespaces/{namespace}" if namespace else "") + f"/{PLURALS[kind]}"
    return path + (f"/{name}" if name else "")


class KubeClient:
    def __init__(self, login: Callable[[], kopf.ConnectionInfo] = connection_info) -> None:
        self._login = login
        self._session: aiohttp.ClientSession | None = None
        self._server = ""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        for attempt in (1, 2):
            session = self._connect()
            try:
                async with session.request(
                    method,
                    self._server + path,
                    params=params,
                    data=None if body is None else json.dumps(body),
                    headers={"Content-Type": content_type},
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as response:
                    text = await response.text()
                    if response.status == 401 and attempt == 1:
                        await self.close()  # the token may have been rotated: log in again
                        continue
                    if response.status >= 400:
                        raise ApiError(response.status, *_message(text))
                    return json.loads(text) if text else {}
            except (aiohttp.ClientError, TimeoutError) as error:
                raise ApiError(0, f"{type(error).__name__}: {error}") from error
        raise AssertionError("unreachable")

    async def apply(self, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply: the operator owns the fields it sets, and takes them back if edited."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        params = {"fieldManager": field_manager, "force": "true"}
        return await self.request(
            "PATCH", path, params=params, body=obj, content_type="application/apply-patch+yaml"
        )

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self.request(
                "DELETE", resource_path(api_version, kind, namespace, name), body=body
            )
        except ApiError as error:
            if error.status != 404:
                raise

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        path = resource_path(api_version, kind, namespace, name) + "/status"
        await self.request(
            "PATCH", path, body={"status": status}, content_type="application/merge-patch+json"
        )

    def _connect(self) -> aiohttp.ClientSession:
        if self._session is None:
            info = self._login()
            self._server = info.server.rstrip("/")
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                headers={**info.as_http_headers(), "User-Agent": USER_AGENT},
            )
        return self._session


def _message(text: str) -> tuple[str, tuple[str, ...]]:
    """The message and cause reasons of a Kubernetes Status body (or the raw text)."""
    try:
        status = json.loads(text)
        causes = (status.get("details") or {}).get("causes") or []
        return status.get("message", text), tuple(c.get("reason", "") for c in causes)
    except (ValueError, AttributeError):
        return text, ()
