"""Whole results of deterministic requests, kept so that asking again costs no worker time.

A request is deterministic when it is greedy (`temperature` set and 0) or seeded (`seed` set: the
same seed and prompt give the same output whatever else the worker runs). An unset temperature
means 1.0, so a request with neither is random and never cached.

The key hashes the request with the fields that cannot change the output cleared: `request_id`,
`priority` and `hops`. A new GenerateRequest field that does not change the output must be cleared
in `_OUTPUT_NEUTRAL_FIELDS` too, or identical requests stop sharing an answer; a field that does
change it must not be, or different requests would get the same answer.

Only complete answers are stored (`cacheable`): a stream cut short by an abort is not the answer.
Entries are kept serialized, so their size in bytes is exact and nothing a caller does to what
`get` returned can change the cache. Responses are stored with `request_id` cleared: it belongs to
the request that produced them, and the caller stamps the current request's id on a replay.
Eviction is least recently used, by bytes; an entry older than `ttl` seconds is a miss.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from meridian.api.v1 import pb

_OUTPUT_NEUTRAL_FIELDS = ("request_id", "priority", "hops")
_COMPLETE = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


def cache_key(request: pb.GenerateRequest) -> bytes | None:
    """16 bytes naming the output of a deterministic request, or None for a random one."""
    sampling = request.sampling
    greedy = sampling.HasField("temperature") and sampling.temperature == 0
    if not (greedy or sampling.HasField("seed")):
        return None
    normalized = pb.GenerateRequest()
    normalized.CopyFrom(request)
    for field in _OUTPUT_NEUTRAL_FIELDS:
        normalized.ClearField(field)
    # deterministic=True: equal messages always give equal bytes (map order, unknown fields).
    payload = normalized.SerializeToString(deterministic=True)
    return hashlib.blake2b(payload, digest_size=16).digest()


def cacheable(responses: Sequence[pb.GenerateResponse]) -> bool:
    """True when the stream ended with a complete answer (stop or length, not abort)."""
    return bool(responses) and responses[-1].finish_reason in _COMPLETE


@dataclass(frozen=True)
class _Entry:
    stored_at: float  # monotonic seconds
    responses: tuple[bytes, ...]  # serialized pb.GenerateResponse, in stream order
    size: int  # bytes: the responses plus the key


class ResultCache:
    """At most `max_bytes` of results (0 turns the cache off), each served for `ttl` seconds."""

    def __init__(self, max_bytes: int, ttl: float):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 (0 turns the cache off)")
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self.max_bytes, self.ttl = max_bytes, ttl
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, now: float) -> list[pb.GenerateResponse] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now - entry.stored_at > self.ttl:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return [pb.GenerateResponse.FromString(data) for data in entry.responses]

    def put(self, key: bytes, responses: Sequence[pb.GenerateResponse], now: float) -> None:
        if key in self._entries:
            self._drop(key)
        stored = tuple(_without_request_id(r) for r in responses)
        size = len(key) + sum(len(data) for data in stored)
        if size > self.max_bytes:
            return  # also the disabled case: max_bytes 0 fits nothing
        while self._bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = _Entry(now, stored, size)
        self._bytes += size

    def _drop(self, key: bytes) -> None:
        self._bytes -= self._entries.pop(key).size


def _without_request_id(response: pb.GenerateResponse) -> bytes:
    copy = pb.GenerateResponse()
    copy.CopyFrom(response)
    copy.ClearField("request_id")
    return copy.SerializeToString(deterministic=True)
