"""100 clients that hang up at random points (queued, before the first token, mid-stream, while
a whole answer is computed): within 2 s of the last one, nothing is in flight anywhere and every
KV block is free; no worker died and the server answers the next request."""

import asyncio
import random
import time

import httpx
import pytest
from chaos_client import ROOM, client, request_body, send
from chaos_serve import MODEL

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

REQUESTS = 100
LATEST_HANGUP = 3.0  # seconds after sending; a 51-token answer takes longer under this load
SETTLE = 2.0  # seconds the gauges get to return to 0


def test_100_clients_that_hang_up_leave_nothing_behind(serve, capsys):
    before = serve.wait_healthy()
    answers = asyncio.run(_storm(serve.url, random.Random()))
    hung_up = time.monotonic()
    gauges = serve.wait_quiet(SETTLE)
    settled = time.monotonic() - hung_up
    ended = [a for a in answers if a.failure is None]
    with capsys.disabled():
        streams = sum(a.stream for a in answers)
        started = sum(a.headers_at is not None for a in answers)
        print(
            f"\nabort storm: {REQUESTS} requests ({streams} streaming), {started} had a first "
            f"token, {len(ended)} ended before their client hung up; gauges 0 after "
            f"{settled:.1f} s: {gauges}"
        )
    assert all(a.status in (0, 200) for a in answers), [a.describe() for a in answers]
    assert serve.workers() == before, "a worker died (or was restarted) in the storm"
    body = request_body(chat=False, stream=False, max_tokens=4)
    r = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


async def _storm(url: str, rng: random.Random):
    async with client(url, connections=REQUESTS) as http:

        async def one():
            chat = rng.random() < 0.5
            body = request_body(chat, rng.random() < 0.5, ROOM[chat], logprobs=rng.random() < 0.2)
            return await send(http, body, rng.uniform(0, LATEST_HANGUP))

        return await asyncio.gather(*(one() for _ in range(REQUESTS)))
