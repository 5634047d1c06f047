"""Request metrics shared by worker and gateway."""

import asyncio
import contextlib
import time

from prometheus_client import generate_latest

from meridian import metrics


def sample(registry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, {"model": "m", "component": "worker", **labels})
    return 0.0 if value is None else value


def test_a_request_is_timed_and_counted():
    registry = metrics.new_registry()
    m = metrics.RequestMetrics(registry, "worker")
    timer = m.start("m")
    assert sample(registry, "meridian_requests_in_flight") == 1
    time.sleep(0.01)
    timer.tokens(1, prompt_tokens=5)
    timer.tokens(2, prompt_tokens=5)  # two tokens in one response: two inter-token gaps
    timer.tokens(0, prompt_tokens=5)  # a final response with no new token changes nothing
    timer.finish(metrics.OK, "stop")
    timer.finish(metrics.ERROR)  # a second finish is ignored
    assert sample(registry, "meridian_time_to_first_token_seconds_count") == 1
    assert sample(registry, "meridian_time_to_first_token_seconds_sum") >= 0.01
    assert sample(registry, "meridian_inter_token_latency_seconds_count") == 2
    assert sample(registry, "meridian_e2e_request_latency_seconds_count") == 1
    assert sample(registry, "meridian_prompt_tokens_total") == 5
    assert sample(registry, "meridian_generation_tokens_total") == 3
    assert sample(registry, "meridian_requests_total", status="ok", finished_reason="stop") == 1
    assert sample(registry, "meridian_requests_total", status="error", finished_reason="none") == 0
    assert sample(registry, "meridian_requests_in_flight") == 0


def test_failed_requests_are_counted_but_not_timed_as_served():
    registry = metrics.new_registry()
    m = metrics.RequestMetrics(registry, "worker")
    m.start("m").finish(metrics.INVALID)
    assert (
        sample(registry, "meridian_requests_total", status="invalid", finished_reason="none") == 1
    )
    assert sample(registry, "meridian_e2e_request_latency_seconds_count") == 0
    assert b"process_cpu_seconds_total" in generate_latest(registry)


def test_a_timer_block_ends_the_request_once_however_it_is_left():
    registry = metrics.new_registry()
    m = metrics.RequestMetrics(registry, "worker")

    class Refused(Exception):
        metric_status = metrics.REJECTED

    with m.start("m") as timer:
        timer.outcome(metrics.OK, "stop")
    for error in (ValueError("a bug"), Refused(), asyncio.CancelledError()):
        with contextlib.suppress(BaseException), m.start("m"):
            raise error
    with m.start("m"):
        pass  # left without an outcome: the client went away before one was known

    def count(status, reason="none"):
        return sample(registry, "meridian_requests_total", status=status, finished_reason=reason)

    assert count(metrics.OK, "stop") == 1
    assert count(metrics.ERROR) == 1
    assert count(metrics.REJECTED) == 1
    assert count(metrics.CANCELLED) == 2
    assert sample(registry, "meridian_requests_in_flight") == 0


def test_model_names_nothing_serves_share_one_label_value():
    registry = metrics.new_registry()
    m = metrics.RequestMetrics(registry, "gateway", known_models=lambda: {"m"})
    for junk in ("x" * 300, "another", "m"):
        m.start(junk).finish(metrics.NOT_FOUND)
    families = {
        s.labels["model"]
        for family in registry.collect()
        if family.name == "meridian_requests"
        for s in family.samples
    }
    assert families == {"m", metrics.UNKNOWN_MODEL}
