"""Where gateway a sends requests: home when it can, the nearer peer when a is full, and within a
the replica that holds the prompt's prefix."""

import asyncio
import random
from collections import Counter

import httpx
import pytest
from geo_client import CLIENT_TIMEOUT, Answer, chat, percentile
from serving_processes import value

pytestmark = [pytest.mark.geo, pytest.mark.timeout(480)]

# Region a runs 2 x 4 requests at once. 14 leaves 6 to place elsewhere: more than b alone runs at
# once (4), so the gateway has to choose between b and c, and fewer than b and c together run (8),
# so that with spilling nobody waits for a place in a batch.
OVERLOAD_STREAMS = 14


def test_light_load_stays_in_region_a(fleet):
    async def main() -> list[Answer]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:
            return [
                await chat(
                    c,
                    fleet.a.url,
                    f"Light load {i}: what is {i} plus {i}?",
                    stream=False,
                    max_tokens=8,
                )
                for i in range(40)
            ]

    answers = asyncio.run(main())
    assert all(a.ok for a in answers), [a for a in answers if not a.ok]
    home = [a for a in answers if a.route == "local" and a.region == "a"]
    # 1% of requests may probe a peer to keep its figures measured; nothing else leaves a.
    assert len(home) >= 0.95 * len(answers), Counter((a.region, a.route) for a in answers)
    assert {a.replica for a in home} <= set(fleet.workers.addresses("a"))


def overload(url: str, tag: str) -> list[Answer]:
    """OVERLOAD_STREAMS streams at once, each generating 32 tokens (EOS ignored)."""

    async def main() -> list[Answer]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:
            return await asyncio.gather(
                *(
                    chat(
                        c,
                        url,
                        f"{tag} {i}: tell me a story about a lighthouse.",
                        stream=True,
                        max_tokens=32,
                        ignore_eos=True,
                    )
                    for i in range(OVERLOAD_STREAMS)
                )
            )

    return asyncio.run(main())


def test_overload_spills_to_the_nearer_peer_first(fleet, capsys):
    # The baseline: the same workers and the same load, behind a gateway of a without peers.
    with fleet.gateway("gateway-a-alone", "a", fleet.workers.addresses("a")) as alone:
        fleet.wait_idle()
        without_peers = overload(alone.url, "alone")
    fleet.wait_idle()
    with_peers = overload(fleet.a.url, "geo")
    for answers in (without_peers, with_peers):
        assert all(a.ok and a.ttft is not None for a in answers), [a for a in answers if not a.ok]
    assert {(a.region, a.route) for a in without_peers} == {("a", "local")}

    spilled = Counter(a.region for a in with_peers if a.route == "spill")
    p90_alone = percentile([a.ttft for a in without_peers], 90)
    p90_geo = percentile([a.ttft for a in with_peers], 90)
    with capsys.disabled():
        print(
            f"\n{OVERLOAD_STREAMS} streams at once on region a: TTFT p90 {p90_geo:.2f} s with "
            f"peers (spilled: b {spilled['b']}, c {spilled['c']}), {p90_alone:.2f} s without"
        )
    assert spilled, Counter((a.region, a.route) for a in with_peers)
    # b is 40 ms away and c 120 ms: c only gets what b cannot start at once.
    assert spilled["b"] > spilled["c"], spilled
    assert p90_geo < p90_alone


# Prefix affinity: 24 system prompts of ~190 tokens (12 KV blocks), asked about 3 times each, in
# turn, one request at a time. The first round misses everywhere. With affinity every later
# request finds its prefix; with power of two choices a later request lands on the replica without
# it half the time (about 7/12 of all requests miss), so the median request is a miss there and a
# hit with affinity. The prefixes fit one worker's cache (364 blocks), so neither side evicts them.
PREFIXES, ROUNDS, PREFIX_WORDS = 24, 3, 180
WORD_TEXT = (
    "river stone light garden window market engine violet silver harbor morning winter copper "
    "meadow lantern thunder pocket orchard candle bridge feather island mirror saddle velvet "
    "canyon whistle basket marble tunnel blanket compass ladder puzzle"
)
WORDS = WORD_TEXT.split()
QUESTIONS = ("Which word comes first?", "Summarize the notes.", "Is a river mentioned?")


def system_prompt(tag: str, k: int) -> str:
    rng = random.Random(f"{tag}-{k}")
    return f"Notes {tag}-{k}: " + " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))


def shared_prefix_run(url: str, tag: str) -> list[Answer]:
    async def main() -> list[Answer]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:
            return [
                await chat(
                    c,
                    url,
                    QUESTIONS[r],
                    system=system_prompt(tag, k),
                    stream=True,
                    max_tokens=1,  # the first token is all that is measured
                )
                for r in range(ROUNDS)
                for k in range(PREFIXES)
            ]

    return asyncio.run(main())


def prefix_cache_counts(workers) -> tuple[float, float]:
    samples = [w.metrics() for w in workers]
    hits = sum(value(s, "meridian_prefix_cache_hits_total") for s in samples)
    return hits, sum(value(s, "meridian_prefix_cache_queries_total") for s in samples)


def test_prefix_affinity_beats_power_of_two_choices(fleet, capsys):
    a_workers = fleet.workers.by_region["a"]
    addresses = [w.address for w in a_workers]
    results = {}
    # Power of two choices first, on prefixes of its own: the affinity run that follows then
    # starts from caches holding none of its prefixes either.
    for name, flags in (("p2c", ["--no-prefix-affinity"]), ("affinity", [])):
        with fleet.gateway(f"gateway-a-{name}", "a", addresses, flags) as g:
            fleet.wait_idle()
            hits, queries = prefix_cache_counts(a_workers)
            answers = shared_prefix_run(g.url, name)
            after_hits, after_queries = prefix_cache_counts(a_workers)
        good = [a for a in answers if a.ok and a.region == "a" and a.ttft is not None]
        assert len(good) == len(answers), [a for a in answers if a not in good]
        ttfts = [a.ttft for a in answers]
        results[name] = (
            (after_hits - hits) / (after_queries - queries),
            percentile(ttfts, 50),
            percentile(ttfts, 90),
            Counter(a.replica for a in answers),
        )
    with capsys.disabled():
        print()
        for name, (rate, p50, p90, replicas) in results.items():
            print(
                f"{name:>8}: prefix-cache hit rate {rate:.2f}, TTFT p50 {p50:.3f} s, "
                f"p90 {p90:.3f} s, requests per replica {sorted(replicas.values())}"
            )
    (p2c_rate, p2c_p50, *_), (affinity_rate, affinity_p50, *_) = results.values()
    assert affinity_rate > p2c_rate
    assert affinity_p50 < p2c_p50
