"""Many concurrent streams through the gateway, and what a client that leaves mid-stream frees."""

import asyncio
import time

import httpx
import pytest
from serving_processes import MODEL, value

pytestmark = pytest.mark.timeout(420)

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CONCURRENCY = 64


def served(worker) -> float:
    return value(worker.metrics(), "meridian_requests_total", status="ok")


def test_64_concurrent_streaming_chats_all_complete(async_client, workers, capsys):
    before = [served(w) for w in workers]

    async def one() -> tuple[str, str | None]:
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=FRANCE, max_tokens=16, temperature=0, stream=True
        )
        text, reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def main():
        try:
            return await asyncio.gather(*(one() for _ in range(CONCURRENCY)))
        finally:
            await async_client.close()

    start = time.monotonic()
    results = asyncio.run(main())
    wall = time.monotonic() - start
    assert len(results) == CONCURRENCY
    for text, reason in results:
        assert "Paris" in text and reason == "stop", (text, reason)
    # Power of two choices over two workers keeps them level: neither gets most of the work.
    shares = [served(w) - b for w, b in zip(workers, before, strict=True)]
    assert sum(shares) == CONCURRENCY and min(shares) >= CONCURRENCY // 4, shares
    with capsys.disabled():
        print(f"\n{CONCURRENCY} concurrent streaming chats: {wall:.1f} s wall, per worker {shares}")


def test_client_disconnect_frees_kv_blocks_within_a_second(gateway, workers):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                # Still reading (leaving the loop closes the connection): the request holds blocks.
                held = sum(value(w.metrics(), "meridian_kv_cache_usage_perc") for w in workers)
                assert held > 0
                break
        r.close()
    left = time.monotonic()
    while True:
        samples = [w.metrics() for w in workers]
        held = sum(value(s, "meridian_kv_cache_usage_perc") for s in samples)
        running = sum(value(s, "meridian_num_requests_running") for s in samples)
        if held == 0 and running == 0:
            break
        assert time.monotonic() - left < 1.0, f"still {held:.4f} of the KV cache, {running} running"
        time.sleep(0.02)
    cancelled = sum(
        value(s, "meridian_requests_total", status="cancelled", finished_reason="none")
        for s in samples
    )
    assert cancelled >= 1
