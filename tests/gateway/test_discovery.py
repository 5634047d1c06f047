"""Discovery: flag parsing, address sets from DNS answers and EndpointSlices, and the follow loops
driven by scripted lookups and a scripted API (no sockets, no sleeping)."""

import asyncio
import json
import logging
import threading
import time

import dns.exception
import dns.name
import dns.rdata
import dns.resolver
import dns.rrset
import pytest
from kubernetes.client import (
    DiscoveryV1EndpointPort,
    V1Endpoint,
    V1EndpointConditions,
    V1EndpointSlice,
    V1EndpointSliceList,
    V1ListMeta,
    V1ObjectMeta,
)

from meridian.errors import UserError
from meridian.gateway import discovery
from meridian.gateway.discovery import (
    SliceFollower,
    Source,
    follow_dns,
    format_address,
    parse_dns,
    parse_endpointslices,
    parse_nameserver,
    parse_static,
    refresh_after,
    slice_addresses,
    srv_addresses,
    watch,
)

# ---- parsing ------------------------------------------------------------------------------------


def test_static_addresses_are_kept_as_given():
    source = parse_static(["10.0.0.1:50051", "[fd00::1]:50051", "worker-0:7000"])
    assert source == Source(
        "static", addresses=frozenset({"10.0.0.1:50051", "[fd00::1]:50051", "worker-0:7000"})
    )


@pytest.mark.parametrize(
    "value", ["10.0.0.1", ":50051", "host:0", "host:65536", "host:grpc", "fd00::1:50051"]
)
def test_static_address_without_a_usable_port_is_refused(value):
    with pytest.raises(UserError, match=rf"'{value}' is not HOST:PORT \(e.g. 10.0.0.5:50051"):
        parse_static([value])


def test_static_needs_an_address():
    with pytest.raises(UserError, match="at least one HOST:PORT"):
        parse_static([])


def test_dns_name_alone_means_srv_and_name_with_port_means_a_records():
    assert parse_dns("_grpc._tcp.workers.llm.svc.cluster.local") == Source(
        "dns", name="_grpc._tcp.workers.llm.svc.cluster.local"
    )
    assert parse_dns("workers.llm.svc.cluster.local.:50051") == Source(
        "dns", name="workers.llm.svc.cluster.local.", port=50051
    )
    assert str(parse_dns("workers:7000")) == "dns workers:7000"


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("workers:http", "port 'http' is not 1-65535; give NAME to follow its SRV records"),
        ("workers:0", "port '0' is not 1-65535"),
        ("workers:", "port '' is not 1-65535"),
        ("10.0.0.1:50051", "is an IP address: give it as a static HOST:PORT"),
        ("work ers", "'work ers' is not a DNS name; give NAME"),
        ("a..b:50051", "'a..b' is not a DNS name; give NAME .* or NAME:PORT to follow its A/AAAA"),
        ("-bad.example", "is not a DNS name"),
        ("x" * 64 + ".example", "is not a DNS name"),
        ("[fd00::1]:53", "is not a DNS name"),
    ],
)
def test_bad_dns_values_say_what_to_give(value, complaint):
    with pytest.raises(UserError, match=complaint):
        parse_dns(value)


def test_endpointslices_default_to_the_grpc_port():
    assert parse_endpointslices("llm/workers") == Source(
        "endpointslices", name="workers", namespace="llm", port_name="grpc"
    )
    assert parse_endpointslices("llm-prod/gw-1:peer").port_name == "peer"


@pytest.mark.parametrize(
    "value", ["workers", "llm/", "/workers", "LLM/workers", "llm/1workers", "llm/workers:", "a/b/c"]
)
def test_bad_endpointslice_values_say_the_form(value):
    with pytest.raises(UserError, match=r"is not NAMESPACE/SERVICE or NAMESPACE/SERVICE:PORT_NAME"):
        parse_endpointslices(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10.96.0.10", ("10.96.0.10", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("fd00::a", ("fd00::a", 53)),
        ("[fd00::a]:5353", ("fd00::a", 5353)),
    ],
)
def test_nameserver(value, expected):
    assert parse_nameserver(value) == expected


@pytest.mark.parametrize("value", ["dns.local", "10.0.0.1:x", "[fd00::a]:", "10.0.0.1:0"])
def test_bad_nameserver(value):
    with pytest.raises(UserError, match="is not IP, IP:PORT or \\[IPv6\\]:PORT"):
        parse_nameserver(value)


# ---- address sets -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ttl", "seconds"), [(None, 1.0), (0, 1.0), (0.2, 1.0), (7, 7.0), (30, 30.0), (86400, 30.0)]
)
def test_refresh_follows_the_ttl_within_one_and_thirty_seconds(ttl, seconds):
    assert refresh_after(ttl) == seconds


def test_ipv6_addresses_are_bracketed():
    assert format_address("fd00::1", 80) == "[fd00::1]:80"
    assert format_address("10.0.0.1", 80) == "10.0.0.1:80"


def test_srv_records_give_each_targets_ips_with_the_records_port():
    records = [("w0.example.", 50051), ("w1.example.", 50052), ("gone.example.", 50053)]
    ips = {"w0.example.": ["10.0.0.1", "fd00::1"], "w1.example.": ["10.0.0.2"], "gone.example.": []}
    assert srv_addresses(records, ips) == {"10.0.0.1:50051", "[fd00::1]:50051", "10.0.0.2:50052"}


def endpoint(address, ready=True, terminating=None):
    conditions = V1EndpointConditions(ready=ready, serving=ready, terminating=terminating)
    return V1Endpoint(addresses=[address], conditions=conditions)


def endpoint_slice(name, endpoints, ports=(("grpc", 50051),), address_type="IPv4", version="1"):
    return V1EndpointSlice(
        address_type=address_type,
        metadata=V1ObjectMeta(name=name, resource_version=version),
        endpoints=endpoints,
        ports=[DiscoveryV1EndpointPort(name=n, port=p, protocol="TCP") for n, p in ports],
    )


def test_slice_keeps_ready_endpoints_and_those_of_unknown_readiness():
    s = endpoint_slice(
        "w-abc",
        [
            endpoint("10.0.0.1"),
            endpoint("10.0.0.2", ready=None),
            V1Endpoint(addresses=["10.0.0.3"]),
            endpoint("10.0.0.4", ready=False),
            endpoint("10.0.0.5", ready=False, terminating=True),
        ],
    )
    assert slice_addresses(s, "grpc") == {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"}


def test_slice_uses_the_named_port():
    s = endpoint_slice("w", [endpoint("10.0.0.1")], ports=[("metrics", 9090), ("grpc", 50051)])
    assert slice_addresses(s, "grpc") == {"10.0.0.1:50051"}
    assert slice_addresses(s, "metrics") == {"10.0.0.1:9090"}
    assert slice_addresses(s, "peer") == frozenset()


def test_slice_with_one_unnamed_port_uses_it_whatever_the_name_asked():
    s = endpoint_slice("w", [endpoint("fd00::7")], ports=[(None, 7000)], address_type="IPv6")
    assert slice_addresses(s, "grpc") == {"[fd00::7]:7000"}
    several = endpoint_slice("w", [endpoint("10.0.0.1")], ports=[(None, 7000), ("x", 7001)])
    assert slice_addresses(several, "grpc") == frozenset()


def test_slice_without_endpoints_or_ports_is_empty():
    assert slice_addresses(endpoint_slice("w", None), "grpc") == frozenset()
    assert slice_addresses(endpoint_slice("w", [endpoint("10.0.0.1")], ports=()), "grpc") == set()


def test_watch_events_keep_one_set_per_slice_and_publish_their_union():
    published = []
    follower = SliceFollower(None, parse_endpointslices("llm/w"), published.append)
    follower.apply("ADDED", endpoint_slice("a", [endpoint("10.0.0.1")]))
    follower.apply("ADDED", endpoint_slice("b", [endpoint("10.0.0.2")]))
    follower.apply("MODIFIED", endpoint_slice("a", [endpoint("10.0.0.1", ready=False)]))
    follower.apply("BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    follower.apply("DELETED", endpoint_slice("b", []))
    assert published == [
        {"10.0.0.1:50051"},
        {"10.0.0.1:50051", "10.0.0.2:50051"},
        {"10.0.0.2:50051"},
        frozenset(),
    ]


# ---- the DNS loop --------------------------------------------------------------------------------


class Exhausted(Exception):
    """The scripted lookups ran out (not a DNS error, so it ends the loop)."""


def follow_script(run, steps, limit=100):
    """Run follow_dns over scripted lookups: each step is (addresses, ttl) or an exception."""
    script = iter(steps)
    sleeps, yielded = [], []

    async def resolve():
        step = next(script, None)
        if step is None:
            raise Exhausted
        if isinstance(step, BaseException):
            raise step
        return frozenset(step[0]), step[1]

    async def sleep(seconds):
        sleeps.append(seconds)

    async def main():
        with pytest.raises(Exhausted):
            async for addresses in follow_dns(resolve, "test", sleep):
                yielded.append(addresses)

    run(main())
    return yielded, sleeps


A, B = "10.0.0.1:50051", "10.0.0.2:50051"


def test_dns_loop_yields_only_changes_and_waits_the_clamped_ttl(run):
    yielded, sleeps = follow_script(run, [({A}, 10), ({A}, 0), ({A, B}, 3600), ({A, B}, 5)])
    assert yielded == [{A}, {A, B}]
    assert sleeps == [10, 1.0, 30.0, 5]


def test_dns_loop_first_yield_may_be_empty(run):
    yielded, _ = follow_script(run, [(set(), 5), ({A}, 5)])
    assert yielded == [frozenset(), {A}]


def test_nxdomain_and_empty_answers_mean_no_endpoints(run):
    yielded, sleeps = follow_script(
        run, [({A}, 5), dns.resolver.NXDOMAIN(), ({B}, 5), dns.resolver.NoAnswer()]
    )
    assert yielded == [{A}, frozenset(), {B}, frozenset()]
    assert sleeps == [5, 1.0, 5, 1.0]


def test_dns_failures_keep_the_last_set_warn_once_and_retry_soon(run, caplog):
    failures = [dns.resolver.LifetimeTimeout(timeout=3.0, errors={}), dns.resolver.NoNameservers()]
    with caplog.at_level(logging.WARNING, logger=discovery.__name__):
        yielded, sleeps = follow_script(run, [({A, B}, 5), *failures, ({A, B}, 5), failures[1]])
    assert yielded == [{A, B}]
    assert sleeps[0] == 5 and sleeps[3] == 5
    assert all(1.0 <= s <= 2.0 for s in (sleeps[1], sleeps[2], sleeps[4]))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per streak of failures
    assert "keeping the last addresses" in warnings[0].getMessage()


def test_a_failure_before_anything_is_known_yields_the_empty_set_once(run):
    timeout = dns.exception.Timeout()
    yielded, _ = follow_script(run, [timeout, timeout, ({A}, 5)])
    assert yielded == [frozenset(), {A}]


class FakeAnswer:
    def __init__(self, name, ttl, rdtype, *records):
        self.rrset = dns.rrset.from_text(name, ttl, "IN", rdtype, *records) if records else None

    def __iter__(self):
        return iter(self.rrset or ())


class FakeResolver:
    """Answers from a table of (name, type) -> FakeAnswer; names not in it do not exist."""

    def __init__(self, answers):
        self.answers = answers

    async def resolve(self, name, rdtype, raise_on_no_answer=True):
        if not any(n == name for n, _ in self.answers):
            raise dns.resolver.NXDOMAIN
        answer = self.answers.get((name, rdtype), FakeAnswer(name, 0, rdtype))
        if answer.rrset is None and raise_on_no_answer:
            raise dns.resolver.NoAnswer
        return answer


def test_srv_lookup_resolves_each_target_and_takes_the_smallest_ttl(run):
    srv = "_grpc._tcp.w.example."
    resolver = FakeResolver(
        {
            (srv, "SRV"): FakeAnswer(
                srv,
                20,
                "SRV",
                "0 0 50051 w0.example.",
                "0 0 7000 w1.example.",
                "0 0 1 gone.",
                "0 0 0 .",
            ),
            ("w0.example.", "A"): FakeAnswer("w0.example.", 8, "A", "10.0.0.1"),
            ("w0.example.", "AAAA"): FakeAnswer("w0.example.", 9, "AAAA", "fd00::1"),
            ("w1.example.", "A"): FakeAnswer("w1.example.", 30, "A", "10.0.0.2", "10.0.0.3"),
        }
    )
    addresses, ttl = run(discovery._resolve(resolver, parse_dns(srv)))
    assert addresses == {"10.0.0.1:50051", "[fd00::1]:50051", "10.0.0.2:7000", "10.0.0.3:7000"}
    assert ttl == 1.0  # "gone." does not exist: look again soon


def test_a_lookup_with_a_port(run):
    name = "w.example."
    resolver = FakeResolver({(name, "A"): FakeAnswer(name, 12, "A", "10.0.0.1", "10.0.0.2")})
    addresses, ttl = run(discovery._resolve(resolver, parse_dns(f"{name}:50051")))
    assert (addresses, ttl) == ({"10.0.0.1:50051", "10.0.0.2:50051"}, 12)


def test_a_name_without_records_has_no_endpoints_and_is_looked_up_again_soon(run):
    empty = FakeResolver({("w.example.", "A"): FakeAnswer("w.example.", 300, "A")})
    for resolver in (empty, FakeResolver({})):
        assert run(discovery._resolve(resolver, parse_dns("w.example.:1"))) == (frozenset(), 1.0)
    with pytest.raises(dns.resolver.NoAnswer):  # the loop takes it as no endpoints
        run(discovery._resolve(empty, parse_dns("w.example.")))


def test_static_source_yields_once_then_waits(run):
    async def main():
        stream = watch(parse_static(["10.0.0.1:1"]))
        assert await anext(stream) == {"10.0.0.1:1"}
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(stream), 0.05)

    run(main())


# ---- the EndpointSlice loop, against a scripted API ---------------------------------------------


def slice_json(name, version, *addresses, ready=True):
    endpoints = [{"addresses": [a], "conditions": {"ready": ready}} for a in addresses]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "resourceVersion": version},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "grpc", "port": 50051, "protocol": "TCP"}],
    }


class WatchStream:
    """What the client reads a watch from: one JSON event per line."""

    status = 200

    def __init__(self, events, hold=0.0):
        self.lines = [json.dumps(event).encode() + b"\n" for event in events]
        self.hold = hold  # seconds to stay open after the events, as a quiet watch does

    def stream(self, amt=None, decode_content=False):
        yield from self.lines
        time.sleep(self.hold)

    def close(self):
        pass

    def release_conn(self):
        pass


class ScriptedAPI:
    """list_namespaced_endpoint_slice answering from a script: a list result, a WatchStream, an
    exception, or a callable run at that point."""

    def __init__(self, steps):
        self.steps = list(steps)
        self.calls = []

    def list_namespaced_endpoint_slice(self, namespace, **kwargs) -> "V1EndpointSliceList":
        self.calls.append((namespace, kwargs))
        step = self.steps.pop(0) if self.steps else WatchStream([], hold=0.05)
        if callable(step):
            step = step()
        if isinstance(step, BaseException):
            raise step
        return step


def listed(version, *slices):
    return V1EndpointSliceList(metadata=V1ListMeta(resource_version=version), items=list(slices))


def test_follower_lists_watches_resumes_and_relists_after_410():
    from kubernetes.client import ApiException

    published = []
    gone = {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
    bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}}
    follower = None

    def stop():
        follower.stopped.set()
        return ApiException(status=500, reason="stopping")

    api = ScriptedAPI(
        [
            listed("10", endpoint_slice("a", [endpoint("10.0.0.1")])),
            WatchStream([{"type": "ADDED", "object": slice_json("b", "11", "10.0.0.2")}, bookmark]),
            WatchStream([gone]),
            listed("20", endpoint_slice("c", [endpoint("10.0.0.3")])),
            WatchStream([{"type": "DELETED", "object": slice_json("c", "21")}]),
            stop,
        ]
    )
    follower = SliceFollower(api, parse_endpointslices("llm/w"), published.append)
    follower.run()
    assert published == [
        {"10.0.0.1:50051"},
        {"10.0.0.1:50051", "10.0.0.2:50051"},
        {"10.0.0.3:50051"},
        frozenset(),
    ]
    selectors = {kwargs["label_selector"] for _, kwargs in api.calls}
    assert selectors == {"kubernetes.io/service-name=w"}
    versions = [
        (kwargs.get("watch", False), kwargs.get("resource_version")) for _, kwargs in api.calls
    ]
    assert versions == [
        (False, None),
        (True, "10"),
        (True, "12"),  # resumed after the bookmark
        (False, None),  # 410: listed again
        (True, "20"),
        (True, "21"),
    ]


def test_api_errors_keep_the_last_set_and_retry(monkeypatch):
    from kubernetes.client import ApiException

    published, waits = [], []
    follower = SliceFollower(
        ScriptedAPI(
            [
                listed("1", endpoint_slice("a", [endpoint("10.0.0.1")])),
                ApiException(status=503, reason="Unavailable"),
                ApiException(status=403, reason="Forbidden"),
                lambda: follower.stopped.set() or OSError("stopping"),
            ]
        ),
        parse_endpointslices("llm/w"),
        published.append,
    )
    monkeypatch.setattr(follower.stopped, "wait", waits.append)
    follower.run()
    assert published == [{"10.0.0.1:50051"}] * 3
    assert waits == [1.0, 2.0]


def test_watch_raises_what_the_follower_cannot_handle_and_stops_its_thread(run, monkeypatch):
    def bug(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(discovery.kubernetes.client, "DiscoveryV1Api", lambda client: api)
    api = ScriptedAPI([listed("1", endpoint_slice("a", [endpoint("10.0.0.1")])), bug])

    async def main():
        stream = watch(parse_endpointslices("llm/w"), api_client=object())
        assert await anext(stream) == {"10.0.0.1:50051"}
        with pytest.raises(ValueError, match="a bug"):
            await anext(stream)

    run(main())


def test_closing_the_watch_stops_its_thread(run, monkeypatch):
    api = ScriptedAPI([listed("1", endpoint_slice("a", [endpoint("10.0.0.1")]))])
    monkeypatch.setattr(discovery.kubernetes.client, "DiscoveryV1Api", lambda client: api)

    async def main():
        stream = watch(parse_endpointslices("llm/w"), api_client=object())
        assert await anext(stream) == {"10.0.0.1:50051"}
        await stream.aclose()

    run(main())
    deadline = time.monotonic() + 2
    while any(t.name.startswith("discovery ") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the EndpointSlice thread outlived its watch"
        time.sleep(0.01)
