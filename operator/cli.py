"""`meridian operator`: reconcile ModelDeployments into per-region worker fleets."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import kopf
from aiohttp import web

from meridian.errors import UserError
from meridian.operator import handlers
from meridian.operator.kube import KubeClient
from meridian.operator.leader import Lease
from meridian.operator.reconcile import Reconciler
from meridian.operator.settings import Settings

logger = logging.getLogger("meridian.operator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace", "-n", action="append", metavar="NS", help="watch this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--liveness", metavar="URL", help="serve a health check, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=300.0,
        help="compare every ModelDeployment with its children this often (in memory; default 300)",
    )
    parser.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hold a Lease so that only one replica acts (default on)",
    )
    parser.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="namespace of the leader Lease (default: $POD_NAMESPACE, else default)",
    )
    parser.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        help="this replica's name in the Lease (default: $POD_NAME, else host-pid)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="log at debug level")


def settings_from(args: argparse.Namespace) -> Settings:
    try:
        return Settings(
            namespaces=tuple(args.namespace or ()),
            all_namespaces=args.all_namespaces,
            liveness=args.liveness,
            resync_seconds=args.resync_seconds,
            leader_election=args.leader_election,
            lease_namespace=args.lease_namespace,
            identity=args.identity,
            verbose=args.verbose,
        )
    except ValueError as error:
        raise UserError(str(error)) from error


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    # `meridian --log-level` configures logging; --verbose adds kopf's and aiohttp's chatter.
    if settings.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    else:
        # kopf logs every handler call at INFO: one line per pod event in a busy fleet.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # every liveness probe
    return asyncio.run(serve(settings))


async def serve(settings: Settings) -> int:
    """Run until stopped (0) or until leadership is lost (1: the pod restarts as a standby)."""
    api = KubeClient()
    lease = None
    if settings.leader_election:
        lease = Lease(
            api,
            settings.lease_namespace,
            settings.lease_name,
            settings.identity,
            settings.lease_seconds,
        )
    try:
        if lease is not None:
            async with _standby_liveness(settings.liveness):
                await lease.acquire()
        operator = asyncio.create_task(
            kopf.operator(
                settings=handlers.kopf_settings(settings),
                standalone=True,
                clusterwide=settings.all_namespaces,
                namespaces=settings.namespaces,
                liveness_endpoint=settings.liveness,
                memo=kopf.Memo(settings=settings, reconciler=Reconciler(settings, api)),
            ),
            name="kopf",
        )
        if lease is None:
            await operator
            return 0
        holding = asyncio.create_task(lease.hold(), name="lease")
        await asyncio.wait({operator, holding}, return_when=asyncio.FIRST_COMPLETED)
        if operator.done():
            holding.cancel()
            return 0
        operator.cancel()  # leadership lost: stop acting at once
        with contextlib.suppress(asyncio.CancelledError):
            await operator
        return 1
    finally:
        if lease is not None:
            await lease.release()
        await api.close()


@contextlib.asynccontextmanager
async def _standby_liveness(url: str | None) -> AsyncIterator[None]:
    """A standby waiting for the Lease is alive too; kopf serves the endpoint once it leads."""
    if url is None:
        yield
        return
    parts = urlsplit(url)
    app = web.Application()
    app.router.add_get(parts.path or "/", lambda _: web.json_response({"standby": True}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname, parts.port or 80).start()
    try:
        yield
    finally:
        await runner.cleanup()
