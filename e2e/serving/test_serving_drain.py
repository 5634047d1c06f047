"""SIGTERM on a worker with requests in flight: they complete, new requests go to the other
worker, and the worker exits 0."""

import asyncio
import json
import signal
import time

import httpx
import pytest
from serving_processes import MODEL, Gateway, Worker, value

pytestmark = pytest.mark.timeout(420)

STREAMS, TOKENS, AFTER = 8, 24, 4


@pytest.fixture(scope="module")
def draining_worker(log_dir):
    w = Worker("worker-drained", log_dir, ["--drain-timeout", "120"])
    try:
        w.wait_until(w.serving, "serving")
        yield w
    finally:
        w.stop()


def in_flight(worker) -> float:
    return value(worker.metrics(), "meridian_requests_in_flight")


def test_sigterm_finishes_in_flight_requests_and_sends_new_ones_elsewhere(
    draining_worker, workers, log_dir
):
    other = workers[0]
    gateway = Gateway("gateway-drain", log_dir, [draining_worker.address, other.address])
    try:
        gateway.wait_until(lambda: gateway.serving(2), "routing to both workers", timeout=60)
        body = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True}

        async def stream(client) -> list[dict]:
            chunks = []
            request = {
                **body,
                "max_tokens": TOKENS,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", f"{gateway.url}/v1/completions", json=request) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line.removeprefix("data: ")))
            return chunks

        async def main():
            async with httpx.AsyncClient(timeout=300) as client:
                streams = [asyncio.create_task(stream(client)) for _ in range(STREAMS)]
                deadline = time.monotonic() + 60
                while in_flight(draining_worker) + in_flight(other) < STREAMS:
                    assert time.monotonic() < deadline, "the streams never all started"
                    await asyncio.sleep(0.05)
                on_drained = in_flight(draining_worker)
                assert on_drained >= 1, "no stream landed on the worker to be drained"
                other_before = value(other.metrics(), "meridian_requests_total", status="ok")
                draining_worker.popen.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                late = await asyncio.gather(
                    *(
                        client.post(f"{gateway.url}/v1/completions", json={**body, "max_tokens": 2})
                        for _ in range(AFTER)
                    )
                )
                return on_drained, other_before, await asyncio.gather(*streams), late

        on_drained, other_before, streams, late = asyncio.run(main())
        for chunks in streams:  # every in-flight stream ran to its end, none cut short
            assert not any("error" in c for c in chunks)
            # Count tokens from usage, not chunks: a sampled token with no text of its own (an
            # ignored EOS, half of a multi-byte character) adds no chunk.
            assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert [r.status_code for r in late] == [200] * AFTER
        assert draining_worker.popen.wait(120) == 0
        assert "draining" in draining_worker.log()
        # The other worker served its own share of the streams plus every late request.
        served = value(other.metrics(), "meridian_requests_total", status="ok") - other_before
        assert served == STREAMS - on_drained + AFTER
    finally:
        gateway.stop()
