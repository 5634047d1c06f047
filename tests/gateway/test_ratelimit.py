"""API keys and rate limits: the key file, the buckets, and what a client is told."""

import math
import re

import pytest

from meridian.errors import UserError
from meridian.gateway.ratelimit import (
    AuthError,
    KeyLimits,
    RateLimiter,
    TokenBucket,
    format_reset,
    load_api_keys,
    parse_api_keys,
)

# ---- the key file --------------------------------------------------------------------------------


def test_key_file_with_comments_blank_lines_and_options():
    text = """
# team A
sk-a rpm=60 tpm=1000
sk-b                  # no limits
  sk-c   tpm=500   rpm=3
"""
    assert parse_api_keys(text, "keys.txt") == {
        "sk-a": KeyLimits(requests_per_minute=60, tokens_per_minute=1000),
        "sk-b": KeyLimits(),
        "sk-c": KeyLimits(requests_per_minute=3, tokens_per_minute=500),
    }


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("sk-secret\nsk-other\nsk-secret\n", "keys.txt:3: repeats the key from line 1"),
        ("sk-a rpm=many", "keys.txt:1: rpm='many' is not a whole number above 0"),
        ("sk-a\nsk-b tpm=0", "keys.txt:2: tpm='0' is not a whole number above 0"),
        ("sk-a rpm=-5", "keys.txt:1: rpm='-5' is not a whole number"),
        ("sk-a rpm", "keys.txt:1: rpm='' is not a whole number"),
        ("sk-a burst=5", "keys.txt:1: unknown option 'burst'; write one key per line"),
        ("sk-a rpm=1 rpm=2", "keys.txt:1: rpm is given twice"),
        ("rpm=5 sk-a", "keys.txt:1: the line starts with an option, not a key"),
        ("", "keys.txt has no API keys"),
        ("# only a comment\n\n", "keys.txt has no API keys"),
    ],
)
def test_key_file_mistakes_name_the_line_and_the_fix(text, says):
    with pytest.raises(UserError, match=f"^{says}") as e:
        parse_api_keys(text, "keys.txt")
    assert "secret" not in str(e.value)  # a key never ends up in a log


def test_load_reads_the_file_and_names_it_when_it_cannot(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a rpm=5\n")
    assert load_api_keys(path) == {"sk-a": KeyLimits(requests_per_minute=5)}
    with pytest.raises(UserError, match=r"cannot read the API key file .*missing"):
        load_api_keys(tmp_path / "missing")
    path.write_text("sk-a\nsk-a\n")
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}:2: "):
        load_api_keys(path)


# ---- the bucket ----------------------------------------------------------------------------------


def test_bucket_starts_full_and_takes_only_what_it_has():
    bucket = TokenBucket(capacity=10, per_second=2, now=0)
    assert bucket.remaining(0) == 10
    assert bucket.take(7, now=0) == 0.0
    assert bucket.take(5, now=0) == 1.0  # 2 missing at 2 per second
    assert bucket.remaining(0) == 3  # the refused take removed nothing
    assert bucket.take(5, now=1) == 0.0
    assert bucket.remaining(1) == 0


def test_bucket_refills_continuously_up_to_capacity():
    bucket = TokenBucket(capacity=10, per_second=2, now=0)
    bucket.take(10, now=0)
    assert bucket.remaining(2.5) == 5
    assert bucket.reset_after(2.5) == 2.5
    assert bucket.remaining(100) == 10
    assert bucket.reset_after(100) == 0


def test_bucket_refunds_stop_at_capacity_and_overdraw_delays():
    bucket = TokenBucket(capacity=10, per_second=2, now=0)
    bucket.take(4, now=0)
    bucket.give_back(100, now=0)
    assert bucket.remaining(0) == 10
    bucket.overdraw(16, now=0)
    assert bucket.remaining(0) == -6
    assert bucket.take(1, now=0) == 3.5  # 7 missing at 2 per second


def test_bucket_never_holds_more_than_its_capacity():
    assert TokenBucket(capacity=10, per_second=2, now=0).take(11, now=0) == math.inf


# ---- admission -----------------------------------------------------------------------------------


def limiter(**keys: KeyLimits) -> RateLimiter:
    return RateLimiter(keys)


def test_requests_per_minute_refuses_with_retry_after():
    rl = limiter(a=KeyLimits(requests_per_minute=2))  # one request back every 30 s
    assert rl.admit("a", 10, now=0).allowed
    assert rl.admit("a", 10, now=0).allowed
    refused = rl.admit("a", 10, now=0)
    assert not refused.allowed and not refused.never and refused.limit == "requests"
    assert refused.retry_after == 30
    assert "2 requests per minute" in refused.message
    assert rl.admit("a", 10, now=29).retry_after == 1
    assert rl.admit("a", 10, now=30).allowed


def test_tokens_per_minute_refuses_with_retry_after():
    rl = limiter(a=KeyLimits(tokens_per_minute=600))  # 10 tokens back per second
    assert rl.admit("a", 500, now=0).allowed
    refused = rl.admit("a", 200, now=0)  # 100 short
    assert not refused.allowed and refused.retry_after == 10 and refused.limit == "tokens"
    assert "600 tokens per minute" in refused.message
    assert rl.admit("a", 200, now=10).allowed


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one():
    rl = limiter(a=KeyLimits(requests_per_minute=7), b=KeyLimits(tokens_per_minute=600))
    for _ in range(7):
        rl.admit("a", 1, now=0)
    assert rl.admit("a", 1, now=0).retry_after == 9  # 60/7 = 8.6 s
    rl.admit("b", 600, now=0)
    assert rl.admit("b", 1, now=0.09).retry_after == 1  # 0.01 s away still says 1
    c = limiter(c=KeyLimits(requests_per_minute=20))  # one request back every 3 s
    for _ in range(20):
        c.admit("c", 1, now=0)
    assert (
        c.admit("c", 1, now=1.0).retry_after == 2
    )  # not 3 from float residue (2.0000000000000004)


def test_a_request_takes_from_both_limits_or_from_neither():
    rl = limiter(a=KeyLimits(requests_per_minute=2, tokens_per_minute=600))
    assert rl.admit("a", 400, now=0).allowed
    assert not rl.admit("a", 300, now=0).allowed  # tokens short: the request is not counted
    assert rl.admit("a", 100, now=0).allowed  # so the second request still fits
    refused = rl.admit("a", 1, now=0)  # requests short: no tokens are taken
    assert "rate limit of 2 requests per minute reached" in refused.message
    assert refused.headers["x-ratelimit-remaining-tokens"] == "100"


def test_both_limits_hit_are_named_and_the_longer_wait_wins():
    rl = limiter(a=KeyLimits(requests_per_minute=1, tokens_per_minute=60))
    rl.admit("a", 60, now=0)
    refused = rl.admit("a", 60, now=0)
    assert "1 requests and 60 tokens per minute" in refused.message
    assert refused.retry_after == 60


def test_a_request_bigger_than_the_whole_minute_can_never_run():
    rl = limiter(a=KeyLimits(requests_per_minute=5, tokens_per_minute=600))
    refused = rl.admit("a", 601, now=0)
    assert not refused.allowed and refused.never and refused.retry_after is None
    assert "601 tokens" in refused.message and "600 tokens per minute" in refused.message
    assert "max_tokens" in refused.message
    assert refused.headers["x-ratelimit-remaining-requests"] == "5"  # nothing was taken
    assert rl.admit("a", 600, now=0).allowed


def test_headers_report_each_limit_the_key_has():
    rl = limiter(a=KeyLimits(requests_per_minute=60, tokens_per_minute=6000))
    assert rl.admit("a", 150, now=0).headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5850",
        "x-ratelimit-reset-tokens": "1.5s",
    }


def test_headers_leave_out_limits_the_key_lacks():
    rl = limiter(a=KeyLimits(requests_per_minute=60), b=KeyLimits())
    assert set(rl.admit("a", 10**9, now=0).headers) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }
    unlimited = rl.admit("b", 10**9, now=0)
    assert unlimited.allowed and unlimited.headers == {}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.02, "20ms"), (0.9996, "1s"), (1, "1s"), (1.5, "1.5s"), (360, "6m0s"),
     (61.25, "1m1.25s")],
)  # fmt: skip
def test_reset_durations_read_like_openais(seconds, text):
    assert format_reset(seconds) == text


def test_one_key_throttled_leaves_another_alone():
    rl = limiter(a=KeyLimits(requests_per_minute=1), b=KeyLimits(requests_per_minute=1))
    rl.admit("a", 1, now=0)
    assert not rl.admit("a", 1, now=0).allowed
    assert rl.admit("b", 1, now=0).allowed


def test_settle_refunds_unused_tokens():
    rl = limiter(a=KeyLimits(tokens_per_minute=600))
    rl.admit("a", 600, now=0)
    rl.settle("a", estimated=600, actual=100, now=0)
    assert rl.admit("a", 500, now=0).allowed
    rl.settle("a", estimated=500, actual=0, now=0)
    rl.settle("a", estimated=500, actual=0, now=0)  # refunds stop at the key's limit
    assert rl.admit("a", 1, now=0).headers["x-ratelimit-remaining-tokens"] == "599"


def test_settle_charges_overuse_without_refusing_and_delays_the_next_request():
    rl = limiter(a=KeyLimits(tokens_per_minute=600))
    rl.admit("a", 600, now=0)
    rl.settle("a", estimated=600, actual=900, now=0)  # 300 in debt
    refused = rl.admit("a", 60, now=0)
    assert refused.retry_after == 36  # 360 tokens at 10 per second
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"


# ---- authentication ------------------------------------------------------------------------------


def test_no_keys_means_no_authentication():
    assert not RateLimiter({}).enabled
    assert limiter(a=KeyLimits()).enabled


@pytest.mark.parametrize("header", ["Bearer sk-a", "bearer sk-a", "  Bearer   sk-a ", "sk-a"])
def test_bearer_header_or_bare_key_authenticates(header):
    assert limiter(**{"sk-a": KeyLimits()}).authenticate(header) == "sk-a"


@pytest.mark.parametrize(
    ("header", "says"),
    [
        (None, "no API key"),
        ("", "no API key"),
        ("Bearer", "malformed"),
        ("Basic c2stYQ==", "malformed"),
        ("Bearer sk-a sk-b", "malformed"),
        ("Bearer sk-wrong", "invalid API key"),
        ("sk-A", "invalid API key"),  # keys are case-sensitive
    ],
)
def test_authentication_failures_say_what_was_wrong_without_the_key(header, says):
    with pytest.raises(AuthError, match=says) as e:
        limiter(**{"sk-a": KeyLimits()}).authenticate(header)
    assert "sk-" not in str(e.value) and "c2st" not in str(e.value)
