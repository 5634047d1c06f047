"""Routing policy: plain values in, a decision out."""

import random
from collections import Counter

import pytest

from meridian.gateway.routing import (
    DEFAULT_RETRY_AFTER,
    DOWN,
    DRAINING,
    SERVING,
    STARTING,
    Reject,
    RetryBudget,
    Route,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
    choose,
    retry_after,
)

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
