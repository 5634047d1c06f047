"""Routing policy: plain values in, a decision out."""

import random
from collections import Counter

import pytest

from meridian.gateway.routing import (
    DEFAULT_RETRY_AFTER,
    DOWN,
    DRAINING,
    FAILOVER,
    LOCAL,
    SERVING,
    SPILL,
    STARTING,
    PrefillSpeed,
    Reject,
    RetryBudget,
    Route,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
    choose,
    retry_after,
)
from meridian.worker.engine.block_manager import prefix_block_hashes

MODEL = "m"
POLICY = RoutingPolicy(max_queue_per_worker=4, stale_after=5.0)
NOW = 100.0


def worker(address: str, **kw) -> WorkerLoad:
    base = dict(model=MODEL, state=SERVING, max_num_seqs=8, kv_blocks_total=100, reported_at=NOW)
    return WorkerLoad(address, **{**base, **kw})


def pick(workers, request=None, seed=0):
    request = request or RouteRequest(MODEL)
    return choose(request, workers, NOW, POLICY, random.Random(seed))


def test_two_workers_the_less_loaded_one_always_wins():
    workers = [worker("a", running=6), worker("b", running=1)]
    assert {pick(workers, seed=s) for s in range(20)} == {Route("b")}


def test_in_flight_counts_when_reports_lag():
    # b's report says idle, but this gateway has just sent it 7 requests.
    workers = [worker("a", running=3), worker("b", running=0, in_flight=7)]
    assert pick(workers) == Route("a")


def test_ties_break_on_kv_cache_use():
    workers = [worker("a", running=2, kv_blocks_used=90), worker("b", running=2, kv_blocks_used=10)]
    assert pick(workers) == Route("b")


def test_power_of_two_choices_never_picks_the_most_loaded_of_three():
    workers = [worker("a", running=0), worker("b", running=3), worker("c", running=7)]
    picks = Counter(pick(workers, seed=s).address for s in range(300))
    assert picks["c"] == 0
    assert picks["a"] > picks["b"] > 0  # b wins only the draws that leave a out


@pytest.mark.parametrize(
    "unfit",
    [
        worker("x", state=STARTING),
        worker("x", state=DRAINING),
        worker("x", state=DOWN),
        worker("x", reported_at=NOW - 6.0),  # stale: not trusted
        worker("x", model="other"),
    ],
)
def test_workers_that_cannot_take_the_request_are_skipped(unfit):
    fit = worker("a", running=7)
    assert {pick([unfit, fit], seed=s) for s in range(20)} == {Route("a")}


def test_workers_that_failed_this_request_are_skipped():
    workers = [worker("a"), worker("b", running=5)]
    assert pick(workers, RouteRequest(MODEL, frozenset({"a"}))) == Route("b")


def test_unknown_model_is_404_and_names_the_served_ones():
    result = pick([worker("a")], RouteRequest("gpt-4"))
    assert isinstance(result, Reject) and result.status == 404
    assert "'m'" in result.message


def test_nothing_serving_is_503():
    for workers in ([], [worker("a", state=STARTING)], [worker("a", state=DRAINING)]):
        result = pick(workers)
        assert isinstance(result, Reject) and result.status == 503


def test_a_model_only_down_workers_served_is_503_not_404():
    result = pick([worker("a", state=DOWN, model="m")])
    assert isinstance(result, Reject) and result.status == 503


def test_empty_model_goes_to_any_serving_worker():
    assert pick([worker("a")], RouteRequest("")) == Route("a")


def test_every_worker_full_is_429_with_retry_after_from_drain_rate():
    # capacity = max_num_seqs 8 + queue 4 = 12 each; 3 over in total, +1 for this request.
    workers = [
        worker("a", running=8, waiting=6, requests_per_second=1.0),
        worker("b", running=8, waiting=5, requests_per_second=1.0),
    ]
    result = pick(workers)
    assert isinstance(result, Reject) and result.status == 429
    assert result.retry_after == 2  # ceil(4 requests / 2 per second)


def test_one_open_worker_is_enough():
    workers = [worker("a", running=8, waiting=4), worker("b", running=8, waiting=3)]
    assert pick(workers).address == "b"


def test_retry_after_is_bounded_and_has_a_default():
    full = worker("a", running=12)
    assert retry_after([full], POLICY) == DEFAULT_RETRY_AFTER  # nothing measured yet
    assert retry_after([worker("a", running=500, requests_per_second=0.1)], POLICY) == 60
    assert retry_after([worker("a", running=12, requests_per_second=50.0)], POLICY) == 1


def test_retry_budget_allows_a_fraction_of_requests_plus_a_floor():
    budget = RetryBudget(ratio=0.5, floor=0.2, window=10.0)  # floor: 2 retries per window
    for t in range(10):
        budget.record_request(float(t) / 10)
    allowed = sum(budget.try_retry(1.0) for _ in range(20))
    assert allowed == 7  # 0.5 * 10 requests + 2
    assert budget.try_retry(11.5)  # the window moved on: old retries no longer count


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        RoutingPolicy(max_queue_per_worker=-1)
    with pytest.raises(ValueError):
        RoutingPolicy(stale_after=0)


# ---- the cost model: predicted seconds to first token ----------------------------------------

GEO = RoutingPolicy(max_queue_per_worker=4, stale_after=5.0, probe_share=0.0)
BLOCK = 16
PROMPT = tuple(range(1000, 1000 + 4 * BLOCK))  # four full blocks
HASHES = prefix_block_hashes(list(PROMPT), BLOCK)


def peer(address: str, region: str, **kw) -> WorkerLoad:
    """A peer region's gateway: its load is the sum over its (two) replicas."""
    base = dict(
        state=SERVING,
        peer=True,
        region=region,
        models=frozenset({MODEL}),
        max_num_seqs=16,
        serving_replicas=2,
        reported_at=NOW,
    )
    return WorkerLoad(address, **{**base, **kw})


def route(candidates, request=None, policy=GEO, per_token=0.0, rng=None):
    request = request or RouteRequest(MODEL)
    return choose(request, candidates, NOW, policy, rng or random.Random(0), per_token)


def test_queue_wait_is_requests_ahead_over_the_measured_drain_rate():
    # 11 in the engine that runs 8 at once: this request waits for 4 to finish, at 2 per second.
    busy = worker("a", running=8, waiting=3, requests_per_second=2.0)
    assert route([busy]).queue_wait == pytest.approx(2.0)
    assert route([busy]).cost == pytest.approx(2.0)


def test_queue_wait_uses_the_default_request_time_until_a_rate_is_measured():
    # No rate yet: 8 running at once take default_request_seconds (5 s) each -> 1.6 per second.
    busy = worker("a", running=8, waiting=3)
    assert route([busy]).queue_wait == pytest.approx(4 / 1.6)


def test_no_queue_wait_while_the_batch_has_room():
    assert route([worker("a", running=7, requests_per_second=2.0)]).queue_wait == 0.0


def test_prefill_counts_only_the_prompt_tokens_not_already_cached():
    request = RouteRequest(MODEL, prompt_ids=PROMPT)
    cold = worker("a", block_size=BLOCK)
    warm = worker("a", block_size=BLOCK, prefix_hashes=frozenset(HASHES[:2]))
    assert route([cold], request, per_token=0.01).cost == pytest.approx(64 * 0.01)
    assert route([warm], request, per_token=0.01).cost == pytest.approx(32 * 0.01)


def test_only_the_leading_run_of_cached_blocks_counts():
    # Blocks 0 and 2 are held, block 1 is not: the engine can reuse block 0 only.
    request = RouteRequest(MODEL, prompt_ids=PROMPT)
    holey = worker("a", block_size=BLOCK, prefix_hashes=frozenset({HASHES[0], HASHES[2]}))
    assert route([holey], request, per_token=0.01).cost == pytest.approx(48 * 0.01)


def test_a_block_cached_after_another_prefix_does_not_count():
    # The same 16 tokens as the prompt's second block, but after a different first block.
    other = [7] * BLOCK + list(PROMPT[BLOCK : 2 * BLOCK])
    elsewhere = worker(
        "a", block_size=BLOCK, prefix_hashes=frozenset(prefix_block_hashes(other, BLOCK))
    )
    request = RouteRequest(MODEL, prompt_ids=PROMPT)
    assert route([elsewhere], request, per_token=0.01).cost == pytest.approx(64 * 0.01)


def test_rtt_adds_to_the_cost():
    far = peer("b:1", "b", rtt=0.2, block_size=BLOCK)
    request = RouteRequest(MODEL, prompt_ids=PROMPT)
    assert route([far], request, per_token=0.01).cost == pytest.approx(0.2 + 64 * 0.01)


# ---- prefix affinity within the region -------------------------------------------------------


def cached(address: str, blocks: int, **kw) -> WorkerLoad:
    return worker(address, block_size=BLOCK, prefix_hashes=frozenset(HASHES[:blocks]), **kw)


def test_the_longest_cached_prefix_wins():
    workers = [cached("a", 1), cached("b", 3, running=2), cached("c", 0)]
    request = RouteRequest(MODEL, prompt_ids=PROMPT)
    assert {route(workers, request, rng=random.Random(s)).address for s in range(20)} == {"b"}


def test_a_hot_replica_loses_its_prefix_to_a_cool_one():
    # Guard: load <= least (0) x 1.5 + 4. b holds more of the prompt but runs 5.
    request = RouteRequest(MODEL, prompt_ids=PROMPT)
    assert route([cached("a", 1), cached("b", 3, running=4)], request).address == "b"
    assert route([cached("a", 1), cached("b", 3, running=5)], request).address == "a"


def test_without_prompt_ids_it_is_power_of_two_choices_on_load():
    workers = [cached("a", 4, running=3), worker("b", running=1)]
    picks = {route(workers, rng=random.Random(s)).address for s in range(20)}
    assert picks == {"b"}  # the prefix a holds plays no part
    with_ids = RouteRequest(MODEL, prompt_ids=PROMPT)
    assert route(workers, with_ids).address == "a"


# ---- across regions ----------------------------------------------------------------------------

# A local replica whose queue costs 0.5 s: 2 requests ahead at 4 finishing per second.
QUEUED = worker("a", running=8, waiting=1, requests_per_second=4.0)


@pytest.mark.parametrize(
    ("rtt", "expected"),
    [(0.1, Route("b:1", SPILL, 0.1)), (0.3, Route("a", LOCAL, 0.5, 0.5))],
)
def test_a_peer_takes_the_request_only_when_it_wins_by_the_spill_margin(rtt, expected):
    # spill_margin 0.25: 0.1 + 0.25 < 0.5 spills; 0.3 + 0.25 does not.
    result = route([QUEUED, peer("b:1", "b", rtt=rtt)])
    assert result.address == expected.address and result.route == expected.route
    assert result.cost == pytest.approx(expected.cost)


@pytest.mark.parametrize(("spilling", "expected"), [(True, SPILL), (False, LOCAL)])
def test_once_spilling_the_smaller_exit_margin_keeps_the_peer(spilling, expected):
    # The peer wins by 0.2 s: less than spill_margin (0.25), more than spill_exit_margin (0.05).
    request = RouteRequest(MODEL, spilling=spilling)
    assert route([QUEUED, peer("b:1", "b", rtt=0.3)], request).route == expected


def test_spilling_stops_when_the_peer_wins_by_less_than_the_exit_margin():
    request = RouteRequest(MODEL, spilling=True)
    assert route([QUEUED, peer("b:1", "b", rtt=0.47)], request).route == LOCAL


def test_the_nearer_of_two_idle_peers_gets_the_spill():
    peers = [peer("b:1", "b", rtt=0.2), peer("c:1", "c", rtt=0.05)]
    assert route([QUEUED, *peers]) == Route("c:1", SPILL, pytest.approx(0.05), probe=False)
    full = worker("a", running=8, waiting=4)
    assert route([full, *peers]).address == "c:1"


@pytest.mark.parametrize(
    "locals_",
    [[], [worker("a", state=STARTING)], [worker("a", state=DOWN)], [worker("a", state=DRAINING)]],
)
def test_no_local_replica_serving_fails_over_to_a_peer(locals_):
    assert route([*locals_, peer("b:1", "b")]).route == FAILOVER


def test_local_replicas_all_full_spill_to_a_peer():
    full = worker("a", running=8, waiting=4)  # capacity 8 + 4
    assert route([full, peer("b:1", "b", rtt=5.0)]) == Route("b:1", SPILL, pytest.approx(5.0))


def test_a_request_that_passed_a_gateway_never_goes_to_a_peer():
    forwarded = RouteRequest(MODEL, hops=1)
    idle_peer = peer("b:1", "b")
    full = worker("a", running=8, waiting=4, requests_per_second=1.0)
    refused = route([full, idle_peer], forwarded)
    assert isinstance(refused, Reject) and refused.status == 429
    unavailable = route([worker("a", state=STARTING), idle_peer], forwarded)
    assert isinstance(unavailable, Reject) and unavailable.status == 503
    assert route([QUEUED, idle_peer], forwarded).route == LOCAL  # however much cheaper the peer


def test_stale_peer_reports_are_ignored():
    stale = peer("b:1", "b", reported_at=NOW - 6.0)
    result = route([stale])
    assert isinstance(result, Reject) and result.status == 503
    assert route([QUEUED, stale]).route == LOCAL


def test_peers_without_serving_replicas_are_skipped():
    empty = peer("b:1", "b", serving_replicas=0)
    assert route([empty, peer("c:1", "c", rtt=1.0)]).address == "c:1"
    result = route([empty])
    assert isinstance(result, Reject) and result.status == 503


def test_ejected_candidates_are_skipped_unless_all_of_them_are():
    ejected = dict(ejected_until=NOW + 1.0)
    workers = [worker("a", **ejected), worker("b", running=6)]
    assert {route(workers, rng=random.Random(s)).address for s in range(20)} == {"b"}
    expired = [worker("a", ejected_until=NOW), worker("b", running=6)]
    assert route(expired).address == "a"
    all_ejected = [worker("a", running=6, **ejected), worker("b", **ejected)]
    assert route(all_ejected).address == "b"  # never eject everything
    peers = [peer("b:1", "b", **ejected), peer("c:1", "c", rtt=1.0)]
    assert route(peers).address == "c:1"
    assert route(peers[:1]).address == "b:1"


def test_a_probe_share_of_requests_goes_to_a_peer_that_would_never_win():
    candidates = [worker("a"), peer("b:1", "b", rtt=10.0)]
    policy = RoutingPolicy(max_queue_per_worker=4, probe_share=0.1)
    rng = random.Random(7)
    decisions = [route(candidates, policy=policy, rng=rng) for _ in range(2000)]
    probes = [d for d in decisions if d.address == "b:1"]
    assert 150 <= len(probes) <= 250  # about 10 %
    # Marked as probes, so that they do not switch the model's spill hysteresis on.
    assert all(d.probe and d.route == SPILL for d in probes)
    assert not any(d.probe for d in decisions if d.address == "a")
    routes = Counter(route(candidates, rng=rng).address for _ in range(2000))  # GEO: share 0
    assert routes["b:1"] == 0


def test_unknown_model_404_lists_the_models_peers_serve_too():
    candidates = [worker("a"), peer("b:1", "b", models=frozenset({MODEL, "big"}))]
    result = route(candidates, RouteRequest("gpt-4"))
    assert isinstance(result, Reject) and result.status == 404
    assert "['big', 'm']" in result.message
    assert route(candidates, RouteRequest("big")) == Route("b:1", FAILOVER)


def test_retry_after_counts_full_peers_too():
    # a: 2 over its 12; b: 1 over its 16 + 2 x 4; plus this request -> 4, at 1 + 1 per second.
    full = worker("a", running=8, waiting=6, requests_per_second=1.0)
    full_peer = peer("b:1", "b", running=16, waiting=9, requests_per_second=1.0)
    result = route([full, full_peer])
    assert isinstance(result, Reject) and result.status == 429
    assert result.retry_after == 2


def test_prefill_speed_is_the_marginal_cost_per_token_not_the_step_overhead():
    speed = PrefillSpeed()
    assert speed.seconds_per_token == speed.initial  # nothing measured yet
    # Every first token costs a 150 ms step plus 1 ms per uncached prompt token.
    for i in range(200):
        tokens = 20 + (i * 37) % 400
        speed.add(tokens, 0.150 + 0.001 * tokens)
    assert speed.seconds_per_token == pytest.approx(0.001, rel=0.05)


def test_prefill_speed_needs_prompts_of_different_lengths():
    speed = PrefillSpeed()
    for _ in range(50):
        speed.add(37, 0.2)  # one chat prompt over and over: the slope is unknowable
    assert speed.seconds_per_token == speed.initial
