"""Fixtures for the gateway tests (helpers live in scripted_workers.py)."""

import asyncio

import pytest


@pytest.fixture
def run():
    """Run a coroutine to completion in a fresh event loop (the suite needs no asyncio plugin)."""
    return lambda coro: asyncio.run(asyncio.wait_for(coro, 30))
