"""Hostile input: schemathesis generates requests from the gateway's own OpenAPI document, valid
ones and ones that break it, and sends them to a live `meridian serve`. Every answer must be a 2xx
or a 4xx with OpenAI's error body, within a bound; afterwards nothing is left in flight or in the KV
cache, no worker has died, and the server still answers a plain question."""

import collections
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest
import requests
import schemathesis
from chaos_serve import MODEL
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

REQUESTS = 2000
RESPONSE_BOUND = 30.0  # seconds; a valid request generates at most 63 tokens (64-token context)
SERVED_MAX_TOKENS = 4  # cases that name the served model generate this many tokens at most


def served(case):
    """The case with the served model named (generated names are almost never it), so that valid
    requests reach a worker; short, to keep 2,000 requests within minutes."""
    body = case.body
    if isinstance(body, dict):
        body["model"] = MODEL
        body["max_tokens"] = min(body.get("max_tokens") or SERVED_MAX_TOKENS, SERVED_MAX_TOKENS)
        if body.get("max_completion_tokens") is not None:  # it wins over max_tokens
            body["max_completion_tokens"] = min(body["max_completion_tokens"], SERVED_MAX_TOKENS)
    return case


@dataclass
class Outcomes:
    sent: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    # (operation, what was wrong) -> (count, first request, first answer)
    failures: dict = field(default_factory=dict)
    slowest: float = 0.0

    def record(self, case, response: schemathesis.Response | None, took: float, error: str = ""):
        self.sent += 1
        self.slowest = max(self.slowest, took)
        status = response.status_code if response is not None else 0
        self.statuses[(case.operation.label, status)] += 1
        if not error and took >= RESPONSE_BOUND:  # schemathesis cuts a stream off at its timeout
            error = f"no end within {RESPONSE_BOUND:g} s"
        problem = error or _problem(response)
        if problem:
            key = (case.operation.label, problem)
            count, request, answer = self.failures.get(key, (0, _request(case), _answer(response)))
            self.failures[key] = (count + 1, request, answer)

    def report(self) -> str:
        lines = [f"{self.sent} requests, {len(self.failures)} kinds of failure:"]
        for (operation, problem), (count, request, answer) in self.failures.items():
            lines.append(
                f"  {count} x {operation}: {problem}\n    request {request}\n    answer  {answer}"
            )
        return "\n".join(lines)


def _problem(r: schemathesis.Response) -> str:
    """What is wrong with an answer ('' when nothing)."""
    if not (200 <= r.status_code < 300 or 400 <= r.status_code < 500):
        return f"status {r.status_code}"
    if r.status_code >= 400:
        try:
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"]
            assert isinstance(error["type"], str) and error["type"]
            assert "param" in error and "code" in error
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"status {r.status_code} without an OpenAI error body"
        return ""
    if r.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        # schemathesis reads 20 events at most, then hangs up
        if (not events or events[-1] != "[DONE]") and not r.stream_cut_short:
            return "a 2xx stream that does not end with [DONE]"
        try:
            if any("error" in json.loads(e) for e in events[:-1]):
                return "a 2xx stream with an error event"
        except ValueError:
            return "a 2xx stream with an event that is not JSON"
        return ""
    try:
        r.json()
    except ValueError:
        return f"a {r.status_code} whose body is not JSON"
    return ""


def _request(case) -> str:
    body = case.body if not isinstance(case.body, bytes) else case.body[:200]
    return f"{case.method} {case.path} {str(body)[:400]}"


def _answer(r: schemathesis.Response | None) -> str:
    return "none" if r is None else f"{r.status_code} {r.text[:400]!r}"


def test_generated_requests_get_2xx_or_4xx_and_leave_nothing_behind(serve, capsys):
    before = serve.wait_healthy()
    schema = schemathesis.openapi.from_url(f"{serve.url}/openapi.json")
    valid = schema.as_strategy(GenerationMode.POSITIVE)
    cases = st.one_of(valid, schema.as_strategy(GenerationMode.NEGATIVE), valid.map(served))
    outcomes = Outcomes()
    seeds = []

    def fuzz_round(run_seed: int) -> None:
        @seed(run_seed)
        @settings(
            max_examples=REQUESTS - outcomes.sent,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # failures are collected, not raised: nothing to shrink
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases)
        def fuzz(case):
            start = time.monotonic()
            try:
                response = case.call(base_url=serve.url, timeout=RESPONSE_BOUND)
            except requests.RequestException as e:
                outcomes.record(case, None, time.monotonic() - start, f"no answer: {e!r}"[:300])
            else:
                outcomes.record(case, response, time.monotonic() - start)

        fuzz()

    start = time.monotonic()
    while outcomes.sent < REQUESTS:  # hypothesis may stop short of max_examples
        seeds.append(random.randrange(2**32))
        fuzz_round(seeds[-1])
    wall = time.monotonic() - start
    with capsys.disabled():
        statuses = dict(sorted(outcomes.statuses.items()))
        print(
            f"\nfuzz: {outcomes.sent} requests in {wall:.0f} s (hypothesis seeds {seeds}), "
            f"slowest {outcomes.slowest:.1f} s; statuses {statuses}"
        )
    problems = [outcomes.report()] if outcomes.failures else []
    try:
        serve.wait_quiet(5)
    except AssertionError as e:
        problems.append(str(e))
    if serve.workers() != before:
        problems.append(f"a worker died (or was restarted): {before} -> {serve.workers()}")
    france = {"role": "user", "content": "What is the capital of France?"}
    body = {"model": MODEL, "messages": [france], "max_tokens": 20, "temperature": 0}
    r = httpx.post(f"{serve.url}/v1/chat/completions", json=body, timeout=RESPONSE_BOUND)
    if r.status_code != 200 or "Paris" not in r.json()["choices"][0]["message"]["content"]:
        problems.append(f"a plain question afterwards: {r.status_code} {r.text[:400]}")
    assert not problems, "\n".join(problems)
