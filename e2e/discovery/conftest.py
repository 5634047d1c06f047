"""Discovery against real servers: dnsmasq for DNS, the e2e control plane for EndpointSlices.

The cluster is started as the operator suite starts it (and stopped after, unless it was already up
or MERIDIAN_KEEP_CLUSTER=1); MERIDIAN_SKIP_CLUSTER=1 skips the EndpointSlice tests, loudly.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest

E2E = pathlib.Path(__file__).resolve().parents[1]
# dns_server.py lives in e2e/; the cluster's helpers in e2e/operator/operator_e2e.py.
for folder in (E2E, E2E / "operator"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from dns_server import Dnsmasq, dnsmasq_binary  # noqa: E402
from operator_e2e import cluster_up  # noqa: E402


@pytest.fixture(scope="module")
def dnsmasq() -> Iterator[Dnsmasq]:
    """One dnsmasq for the module, serving no records until a test sets some."""
    if dnsmasq_binary() is None:
        installed = subprocess.run(
            [str(E2E / "tools")], capture_output=True, text=True, timeout=300
        )
        if dnsmasq_binary() is None:
            pytest.skip(
                "dnsmasq is not installed and e2e/tools could not install it "
                f"(exit {installed.returncode}): {installed.stderr[-1000:]}"
            )
    server = Dnsmasq()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def kubeconfig() -> Iterator[str]:
    """The e2e cluster's admin kubeconfig; the cluster is started for this session if need be."""
    if os.environ.get("MERIDIAN_SKIP_CLUSTER") == "1":
        pytest.skip(
            "MERIDIAN_SKIP_CLUSTER=1: EndpointSlice discovery against a real API server NOT run"
        )
    with cluster_up() as kubeconfig:
        yield kubeconfig


class Changes:
    """What a watch() stream yields, read by a task of its own: waiting here with a timeout does
    not cancel the stream (cancelling anext() would end the generator)."""

    def __init__(self, stream: AsyncIterator[frozenset[str]]) -> None:
        self.stream = stream
        self.sets: asyncio.Queue[frozenset[str]] = asyncio.Queue()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for addresses in self.stream:
            self.sets.put_nowait(addresses)

    async def next(self, timeout: float) -> frozenset[str]:
        getting = asyncio.ensure_future(self.sets.get())
        done, _ = await asyncio.wait(
            [getting, self.task], timeout=timeout, return_when="FIRST_COMPLETED"
        )
        if getting in done:
            return getting.result()
        getting.cancel()
        if self.task in done:
            self.task.result()  # raises what ended the stream
            raise AssertionError("the stream ended")
        raise AssertionError(f"nothing came within {timeout} s")

    async def until(self, expected: set[str], timeout: float) -> float:
        """Read until `expected` comes; return how many seconds that took."""
        start = time.monotonic()
        seen = []
        while True:
            remaining = start + timeout - time.monotonic()
            try:
                got = await self.next(max(remaining, 0))
            except AssertionError as e:
                raise AssertionError(f"{sorted(expected)} did not come ({e}); saw {seen}") from None
            if got == expected:
                return time.monotonic() - start
            seen.append(sorted(got))

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.stream.aclose()


@pytest.fixture
def follow() -> type[Changes]:
    """follow(watch(...)) -> Changes; call it inside the test's event loop."""
    return Changes
