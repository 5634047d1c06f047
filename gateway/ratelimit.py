"""API keys and their per-minute limits on requests and tokens.

A key may limit requests per minute (rpm) and tokens per minute (tpm). Each limit is a token
bucket that holds one minute's worth and refills continuously at limit/60 per second: a key may
burst its whole minute, then runs at the steady rate. A request takes one from the rpm bucket and
its estimated cost (prompt + max output tokens) from the tpm bucket, both or neither; when it ends,
`settle` refunds what it did not use or takes what it used beyond, without refusing (the bucket
goes negative and the key's next request waits longer). A request costing more than a whole
minute of tokens can never run, however long the client waits (see `Admission`). State exists only
for keys in the file, so memory is bounded by it; the gateway's event loop is the only caller, so
there are no locks. Keys are looked up by SHA-256 digest, so no comparison leaks timing about a
real key, and no message repeats a key.
"""

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from meridian.errors import UserError

_FORMAT = "write one key per line, optionally followed by rpm=N and/or tpm=N"
_OPTIONS = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute"}


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for limit in (self.requests_per_minute, self.tokens_per_minute):
            if limit is not None and limit < 1:
                raise ValueError("a per-minute limit must be >= 1 (None: unlimited)")


def load_api_keys(path: str | Path) -> dict[str, KeyLimits]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read the API key file {path}: {e.strerror}") from e
    return parse_api_keys(text, str(path))


def parse_api_keys(text: str, source: str) -> dict[str, KeyLimits]:
    """`KEY [rpm=N] [tpm=N]` per line; `#` starts a comment. `source` names the file in errors."""
    keys: dict[str, KeyLimits] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        key, *options = words
        where = f"{source}:{number}"
        if "=" in key:
            raise UserError(f"{where}: the line starts with an option, not a key; {_FORMAT}")
        if key in first_line:
            raise UserError(f"{where}: repeats the key from line {first_line[key]}; give it once")
        keys[key], first_line[key] = KeyLimits(**_parse_options(options, where)), number
    if not keys:
        raise UserError(f"{source} has no API keys; {_FORMAT} (or serve without a key file)")
    return keys


def _parse_options(options: list[str], where: str) -> dict[str, int]:
    limits: dict[str, int] = {}
    for option in options:
        name, _, value = option.partition("=")
        if name not in _OPTIONS:
            raise UserError(f"{where}: unknown option {name!r}; {_FORMAT}")
        if _OPTIONS[name] in limits:
            raise UserError(f"{where}: {name} is given twice; give it once")
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise UserError(f"{where}: {name}={value!r} is not a whole number above 0; {_FORMAT}")
        limits[_OPTIONS[name]] = int(value)
    return limits


class TokenBucket:
    """Holds up to `capacity`, refills at `per_second`, starts full; may go negative (overdraw)."""

    def __init__(self, capacity: float, per_second: float, now: float):
        self.capacity, self.per_second = capacity, per_second
        self._level, self._at = capacity, now

    def remaining(self, now: float) -> float:
        if now > self._at:
            self._level = min(self.capacity, self._level + (now - self._at) * self.per_second)
            self._at = now
        return self._level

    def wait(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available: 0.0 now, inf when more than the capacity."""
        if amount > self.capacity:
            return math.inf
        return max(amount - self.remaining(now), 0.0) / self.per_second

    def take(self, amount: float, now: float) -> float:
        """Take `amount` and return 0.0, or take nothing and return the seconds to wait."""
        seconds = self.wait(amount, now)
        if seconds == 0.0:
            self._level -= amount
        return seconds

    def overdraw(self, amount: float, now: float) -> None:
        self._level = self.remaining(now) - amount

    def give_back(self, amount: float, now: float) -> None:
        self._level = min(self.capacity, self.remaining(now) + amount)

    def reset_after(self, now: float) -> float:
        """Seconds until full."""
        return (self.capacity - self.remaining(now)) / self.per_second


class AuthError(Exception):
    """No key, a malformed header or an unknown key: answer 401 (gRPC UNAUTHENTICATED)."""


@dataclass(frozen=True)
class Admission:
    """Allowed, or refused: with `retry_after`, answer 429 (RESOURCE_EXHAUSTED) and Retry-After;
    with `never` (the request alone costs more than the key's tpm), answer 400 (INVALID_ARGUMENT,
    param max_tokens) and no Retry-After: SDKs retry every 429, and no wait makes it fit.
    `headers` go on every answer, refused or not."""

    allowed: bool
    headers: dict[str, str]  # OpenAI's x-ratelimit-* names
    retry_after: int | None = None  # whole seconds
    never: bool = False
    message: str = ""
    limit: str = ""  # refused: the limit that refused it ("requests" or "tokens")


class RateLimiter:
    def __init__(self, keys: dict[str, KeyLimits]):
        self._by_digest = {_digest(key): key for key in keys}
        self._per_minute = {
            key: {"requests": limits.requests_per_minute, "tokens": limits.tokens_per_minute}
            for key, limits in keys.items()
        }
        # key -> "requests" / "tokens" -> bucket, for the limits the key has; made on first use.
        self._buckets: dict[str, dict[str, TokenBucket]] = {}

    @property
    def enabled(self) -> bool:
        """False without keys: the gateway then serves everyone, unauthenticated and unlimited."""
        return bool(self._per_minute)

    def authenticate(self, header_value: str | None) -> str:
        """The key from `Authorization: Bearer KEY`, or a bare key (gRPC metadata)."""
        words = (header_value or "").split()
        if not words:
            raise AuthError("no API key: send the header 'Authorization: Bearer YOUR_KEY'")
        if len(words) == 2 and words[0].lower() == "bearer":
            words = words[1:]
        if len(words) != 1 or words[0].lower() == "bearer":
            raise AuthError(
                "malformed Authorization header: write 'Authorization: Bearer YOUR_KEY'"
            )
        key = self._by_digest.get(_digest(words[0]))
        if key is None:
            raise AuthError("invalid API key: check the key you were given")
        return key

    def admit(self, key: str, tokens: int, now: float) -> Admission:
        """Admit a request estimated to cost `tokens` (prompt + max output) for a known key."""
        buckets, cost = self._state(key, now), {"requests": 1, "tokens": tokens}
        tpm = int(buckets["tokens"].capacity) if "tokens" in buckets else None
        if tpm is not None and tokens > tpm:
            message = (
                f"this request may use up to {tokens} tokens (prompt + max_tokens), more than "
                f"this key's whole limit of {tpm} tokens per minute; lower max_tokens or shorten "
                "the prompt"
            )
            return Admission(
                False, _headers(buckets, now), never=True, message=message, limit="tokens"
            )
        waits = {kind: bucket.wait(cost[kind], now) for kind, bucket in buckets.items()}
        if hit := {kind: seconds for kind, seconds in waits.items() if seconds > 0}:
            # The epsilon keeps float residue (30.000000001 s) from adding a whole second.
            retry_after = max(math.ceil(max(hit.values()) - 1e-9), 1)
            limits = " and ".join(f"{int(buckets[kind].capacity)} {kind}" for kind in hit)
            message = f"rate limit of {limits} per minute reached; retry after {retry_after} s"
            limit = max(hit, key=hit.get)  # the one that keeps the key waiting longest
            return Admission(
                False, _headers(buckets, now), retry_after, message=message, limit=limit
            )
        for kind, bucket in buckets.items():
            bucket.take(cost[kind], now)
        return Admission(True, _headers(buckets, now))

    def settle(self, key: str, estimated: int, actual: int, now: float) -> None:
        """After the request ends: refund what it did not use, or charge what it used beyond."""
        bucket = self._state(key, now).get("tokens")
        if bucket is not None and actual < estimated:
            bucket.give_back(estimated - actual, now)
        elif bucket is not None:
            bucket.overdraw(actual - estimated, now)

    def _state(self, key: str, now: float) -> dict[str, TokenBucket]:
        if key not in self._buckets:
            limits = self._per_minute[key].items()
            self._buckets[key] = {k: TokenBucket(n, n / 60, now) for k, n in limits if n}
        return self._buckets[key]


def _headers(buckets: dict[str, TokenBucket], now: float) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers, for the limits the key has."""
    headers = {}
    for kind, bucket in buckets.items():
        headers[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(math.floor(bucket.remaining(now)), 0))
        headers[f"x-ratelimit-reset-{kind}"] = format_reset(bucket.reset_after(now))
    return headers


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes it in x-ratelimit-reset-*: "20ms", "1s", "1.5s", "6m0s"."""
    ms = round(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
