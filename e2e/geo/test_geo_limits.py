"""What the gateway refuses and what it answers without a worker: saturation, API keys, results.

Every gateway of this module's fleet lets a worker queue only one request beyond the 4 it runs, so
a few dozen requests saturate all three regions.
"""

import asyncio

import httpx
import pytest
from geo_client import CLIENT_TIMEOUT, Answer, chat
from serving_processes import value

pytestmark = [pytest.mark.geo, pytest.mark.timeout(360)]

MAX_QUEUE_PER_WORKER = 1
SATURATING = 48  # the fleet admits (4 + 1) per worker, 20 in all; the rest must get 429
RSS_GROWTH_BOUND = 100 * 2**20  # bytes


@pytest.fixture(scope="module")
def gateway_flags() -> list[str]:
    return ["--max-queue-per-worker", str(MAX_QUEUE_PER_WORKER)]


def resident_bytes(gateway) -> float:
    return value(gateway.metrics(), "process_resident_memory_bytes")


def test_saturated_fleet_answers_429_with_retry_after_and_bounded_memory(fleet, capsys):
    fleet.wait_idle()
    before = resident_bytes(fleet.a)
    peak = before

    async def main() -> list[Answer]:
        nonlocal peak
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:
            burst = asyncio.gather(
                *(
                    chat(
                        c,
                        fleet.a.url,
                        f"Saturation {i}: describe the sea.",
                        stream=i % 2 == 0,
                        max_tokens=32,
                        ignore_eos=True,
                    )
                    for i in range(SATURATING)
                )
            )
            while not burst.done():
                peak = max(peak, await asyncio.to_thread(resident_bytes, fleet.a))
                await asyncio.wait([burst], timeout=0.5)
            return burst.result()

    answers = asyncio.run(main())
    statuses = [a.status for a in answers]
    served = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 429]
    with capsys.disabled():
        regions = sorted(a.region for a in served)
        print(
            f"\n{SATURATING} requests on a saturated fleet: {len(served)} served {regions}, "
            f"{len(refused)} refused (Retry-After {sorted({a.headers['retry-after'] for a in refused})}); "
            f"gateway a resident memory {before / 2**20:.0f} -> peak {peak / 2**20:.0f} MiB"
        )
    # No 5xx, no transport error, no client timeout: only answers and 429s.
    assert set(statuses) <= {200, 429}, [a for a in answers if a.status not in (200, 429)]
    assert all(a.ok for a in served), [a for a in served if not a.ok]
    # 429 only once every region was full: each served some.
    assert {a.region for a in served} == {"a", "b", "c"}, served
    assert refused, "nothing was refused: the fleet was not saturated"
    for a in refused:
        assert int(a.headers["retry-after"]) >= 1, a.headers
        assert a.body["error"]["code"] == "overloaded", a.body
    assert peak - before < RSS_GROWTH_BOUND

    fleet.wait_idle()

    async def once() -> Answer:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:
            return await chat(c, fleet.a.url, "After saturation: hello?", stream=False)

    after = asyncio.run(once())
    assert after.ok and after.route == "local", after


def test_api_keys_refuse_unknown_callers_and_limit_requests_per_key(fleet, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("limited-key rpm=3\nunlimited-key\n")
    flags = ["--api-keys-file", str(keys)]
    with fleet.gateway("gateway-a-keys", "a", fleet.workers.addresses("a"), flags) as g:

        async def main() -> dict[str, list[Answer]]:
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:

                async def ask(key: str | None, n: int) -> Answer:
                    content = f"Key {key} request {n}: say hi."
                    return await chat(c, g.url, content, stream=False, max_tokens=4, api_key=key)

                return {
                    "none": [await ask(None, 0)],
                    "unknown": [await ask("not-a-key", 0)],
                    "limited": [await ask("limited-key", n) for n in range(4)],
                    "unlimited": [await ask("unlimited-key", n) for n in range(5)],
                }

        answers = asyncio.run(main())
    assert answers["none"][0].status == 401, answers["none"]
    assert answers["unknown"][0].status == 401, answers["unknown"]
    *allowed, fourth = answers["limited"]
    assert all(a.ok for a in allowed), allowed
    assert fourth.status == 429, fourth
    assert 1 <= int(fourth.headers["retry-after"]) <= 60, fourth.headers
    assert fourth.headers["x-ratelimit-limit-requests"] == "3", fourth.headers
    assert fourth.headers["x-ratelimit-remaining-requests"] == "0", fourth.headers
    assert "x-ratelimit-reset-requests" in fourth.headers, fourth.headers
    assert all(a.ok for a in answers["unlimited"]), answers["unlimited"]


def test_result_cache_replays_deterministic_answers_only(fleet):
    async def main() -> tuple[list[Answer], list[Answer]]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:
            url, question = fleet.a.url, "Result cache: what is the capital of Italy?"
            greedy = [await chat(c, url, question, stream=False) for _ in range(2)]
            random = [await chat(c, url, question, stream=False, temperature=1) for _ in range(2)]
            return greedy, random

    hits_before = value(fleet.a.metrics(), "meridian_result_cache_lookups_total", result="hit")
    (first, second), random = asyncio.run(main())
    hits = value(fleet.a.metrics(), "meridian_result_cache_lookups_total", result="hit")
    assert first.ok and first.route != "cache", first
    assert second.ok and second.route == "cache", second
    assert second.text == first.text
    assert hits - hits_before == 1
    assert all(a.ok and a.route != "cache" for a in random), random
