"""Where the gateway finds its local workers or its peer gateways, followed without a restart.

watch(source) yields the whole set of "HOST:PORT" ("[v6]:PORT") as soon as it is first known (even
empty), then again each time it changes. Three sources:
- static: the HOST:PORT values given, once.
- dns: NAME is looked up as SRV (each target's A/AAAA records, with the record's port); NAME:PORT as
  A/AAAA (a headless Service). Looked up again when the TTL runs out, clamped to [1, 30] s. NXDOMAIN
  or no records means no endpoints; a timeout or SERVFAIL keeps the last set (a DNS hiccup must not
  drop every worker), warns once per streak of failures and retries in 1-2 s.
- endpointslices: NAMESPACE/SERVICE[:PORT_NAME]: the Service's EndpointSlices, listed then watched
  in a thread (the kubernetes client is synchronous). Endpoints whose ready condition is not False,
  on the port named PORT_NAME ("grpc") or a slice's only, unnamed port. 410 Gone relists; other API
  errors keep the last set and retry with backoff.
"""

import asyncio
import ipaddress
import logging
import os
import random
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.resolver
import kubernetes
import urllib3

from meridian.errors import UserError

log = logging.getLogger(__name__)

MIN_REFRESH, MAX_REFRESH = 1.0, 30.0  # seconds between DNS lookups, whatever the TTL says
RETRY_AFTER = (1.0, 2.0)  # seconds (uniform) before retrying a failed DNS lookup
DNS_TIMEOUT, DNS_LIFETIME = 1.0, 3.0  # seconds: per query sent, per lookup with its retries
WATCH_SECONDS = 5  # the API server ends each watch after this; a stopped thread notices by then
MAX_BACKOFF = 30.0  # seconds between attempts while the API server fails
DEFAULT_PORT_NAME = "grpc"

_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"
DNS_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
_K8S_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"  # RFC 1123: namespaces, port names
SERVICE_REF = re.compile(
    rf"(?P<namespace>{_K8S_LABEL})/(?P<service>[a-z]([-a-z0-9]{{0,61}}[a-z0-9])?)"
    rf"(:(?P<port_name>{_K8S_LABEL}))?"
)


@dataclass(frozen=True)
class Source:
    """One place addresses come from, parsed from a flag value."""

    kind: str  # "static", "dns", "endpointslices"
    addresses: frozenset[str] = frozenset()  # static
    name: str = ""  # dns: the name looked up; endpointslices: the Service
    port: int | None = None  # dns: the port given with NAME:PORT; None means SRV
    namespace: str = ""  # endpointslices
    port_name: str = DEFAULT_PORT_NAME  # endpointslices

    def __str__(self) -> str:
        if self.kind == "dns":
            return f"dns {self.name} SRV" if self.port is None else f"dns {self.name}:{self.port}"
        if self.kind == "endpointslices":
            return f"endpointslices {self.namespace}/{self.name}:{self.port_name}"
        return ",".join(sorted(self.addresses))


def parse_static(values: Iterable[str]) -> Source:
    addresses = frozenset(values)
    if not addresses:
        raise UserError("give at least one HOST:PORT address")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not _is_port(port) or (":" in host and not host.startswith("[")):
            raise UserError(f"{address!r} is not HOST:PORT (e.g. 10.0.0.5:50051, [fd00::5]:50051)")
    return Source("static", addresses=addresses)


def parse_dns(value: str) -> Source:
    name, sep, port = value.rpartition(":") if ":" in value else (value, "", "")
    usage = (
        "give NAME to follow its SRV records (e.g. _grpc._tcp.workers.llm.svc.cluster.local) or "
        "NAME:PORT to follow its A/AAAA records (e.g. workers.llm.svc.cluster.local:50051)"
    )
    if sep and not _is_port(port):
        raise UserError(f"DNS discovery {value!r}: port {port!r} is not 1-65535; {usage}")
    if _is_ip(name):
        raise UserError(f"DNS discovery {value!r} is an IP address: give it as a static HOST:PORT")
    if len(name) > 253 or not DNS_NAME.fullmatch(name):
        raise UserError(f"DNS discovery {value!r}: {name!r} is not a DNS name; {usage}")
    return Source("dns", name=name, port=int(port) if sep else None)


def parse_endpointslices(value: str) -> Source:
    match = SERVICE_REF.fullmatch(value)
    if match is None:
        raise UserError(
            f"EndpointSlice discovery {value!r} is not NAMESPACE/SERVICE or NAMESPACE/SERVICE:"
            "PORT_NAME, each a lowercase Kubernetes name (e.g. llm/workers or llm/workers:grpc)"
        )
    return Source(
        "endpointslices",
        name=match["service"],
        namespace=match["namespace"],
        port_name=match["port_name"] or DEFAULT_PORT_NAME,
    )


def parse_nameserver(value: str) -> tuple[str, int]:
    """A nameserver given as IP, IP:PORT or [IPv6]:PORT -> (ip, port); port 53 when not given."""
    host, port = value, "53"
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    if not _is_ip(host) or not _is_port(port):
        raise UserError(f"nameserver {value!r} is not IP, IP:PORT or [IPv6]:PORT (e.g. 10.96.0.10)")
    return host, int(port)


def _is_port(text: str) -> bool:
    return text.isdigit() and 0 < int(text) < 65536


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def refresh_after(ttl: float | None) -> float:
    """Seconds until the next lookup: the answer's TTL, within [MIN_REFRESH, MAX_REFRESH]."""
    return min(max(ttl or 0, MIN_REFRESH), MAX_REFRESH)


def srv_addresses(
    records: Iterable[tuple[str, int]], ips: Mapping[str, Iterable[str]]
) -> frozenset[str]:
    """SRV records as (target, port), and each target's IPs -> every IP with its record's port."""
    return frozenset(format_address(ip, port) for target, port in records for ip in ips[target])


def slice_addresses(
    endpoint_slice: kubernetes.client.V1EndpointSlice, port_name: str
) -> frozenset[str]:
    """The addresses of a slice's endpoints that are not marked unready, on the named port."""
    ports = endpoint_slice.ports or []
    named = [p.port for p in ports if p.name == port_name]
    if not named and len(ports) == 1 and not ports[0].name:
        named = [ports[0].port]
    if not named or named[0] is None:
        return frozenset()
    return frozenset(
        format_address(address, named[0])
        for endpoint in endpoint_slice.endpoints or []
        if endpoint.conditions is None or endpoint.conditions.ready is not False
        for address in endpoint.addresses
    )


async def watch(
    source: Source, nameserver: str | None = None, *, api_client=None
) -> AsyncIterator[frozenset[str]]:
    """The source's addresses: first as soon as known, then each time they change.

    `nameserver` (IP or IP:PORT) replaces /etc/resolv.conf; `api_client` (a kubernetes ApiClient)
    replaces the in-cluster config or kubeconfig.
    """
    if source.kind == "static":
        yield source.addresses
        await asyncio.Event().wait()
    elif source.kind == "dns":
        resolver = _resolver(nameserver)
        async for addresses in follow_dns(lambda: _resolve(resolver, source), str(source)):
            yield addresses
    elif source.kind == "endpointslices":
        async for addresses in _follow_endpointslices(source, api_client or _api_client()):
            yield addresses
    else:
        raise ValueError(f"unknown discovery source kind {source.kind!r}")


async def follow_dns(
    resolve: Callable[[], Awaitable[tuple[frozenset[str], float | None]]],
    what: str,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncIterator[frozenset[str]]:
    """Call resolve() -> (addresses, TTL) again and again; yield the addresses when they change.

    A failure before anything is known yields the empty set, so that callers need not wait for DNS.
    """
    last: frozenset[str] | None = None
    failing = False
    while True:
        try:
            addresses, ttl = await resolve()
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            addresses, ttl = frozenset(), None
        except dns.exception.DNSException as e:
            if not failing:
                log.warning("discovery %s: lookup failed, keeping the last addresses: %r", what, e)
            failing = True
            if last is None:
                last = frozenset()
                yield last
            await sleep(random.uniform(*RETRY_AFTER))
            continue
        if failing:
            log.info("discovery %s: lookups work again", what)
            failing = False
        if addresses != last:
            log.info("discovery %s: %d address(es): %s", what, len(addresses), sorted(addresses))
            last = addresses
            yield addresses
        await sleep(refresh_after(ttl))


def _resolver(nameserver: str | None) -> dns.asyncresolver.Resolver:
    if nameserver is None:
        try:
            resolver = dns.asyncresolver.Resolver()
        except dns.resolver.NoResolverConfiguration as e:
            raise UserError(f"no nameserver in /etc/resolv.conf ({e}): give one explicitly") from e
        resolver.use_search_by_default = True  # short names such as "workers.llm", as in a pod
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(*parse_nameserver(nameserver))]
    resolver.timeout, resolver.lifetime = DNS_TIMEOUT, DNS_LIFETIME
    return resolver


async def _resolve(
    resolver: dns.asyncresolver.Resolver, source: Source
) -> tuple[frozenset[str], float]:
    """The source's addresses and the smallest TTL of the answers used."""
    if source.port is not None:
        ips, ttl = await _host_ips(resolver, source.name)
        return frozenset(format_address(ip, source.port) for ip in ips), ttl
    answer = await resolver.resolve(source.name, "SRV")
    # A target of "." says the service is deliberately not offered there (RFC 2782).
    records = [(r.target.to_text(), r.port) for r in answer if r.target != dns.name.root]
    targets = sorted({target for target, _ in records})
    found = await asyncio.gather(*(_host_ips(resolver, target) for target in targets))
    ips = {target: target_ips for target, (target_ips, _) in zip(targets, found, strict=True)}
    return srv_addresses(records, ips), min([answer.rrset.ttl, *(ttl for _, ttl in found)])


async def _host_ips(resolver: dns.asyncresolver.Resolver, name: str) -> tuple[list[str], float]:
    """A and AAAA records of a name (none when it does not exist) and their smallest TTL."""
    ips: list[str] = []
    ttl = MAX_REFRESH
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, rdtype, raise_on_no_answer=False)
        except dns.resolver.NXDOMAIN:
            return [], MIN_REFRESH
        if answer.rrset is not None:
            ips += [r.address for r in answer.rrset]
            ttl = min(ttl, answer.rrset.ttl)
    return ips, ttl if ips else MIN_REFRESH


def _api_client() -> kubernetes.client.ApiClient:
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config = kubernetes.client.Configuration()
            kubernetes.config.load_incluster_config(client_configuration=config)
            return kubernetes.client.ApiClient(config)
        return kubernetes.config.new_client_from_config(persist_config=False)
    except kubernetes.config.ConfigException as e:
        raise UserError(
            f"EndpointSlice discovery needs a pod's service account or KUBECONFIG: {e}"
        ) from e


async def _follow_endpointslices(source: Source, api_client) -> AsyncIterator[frozenset[str]]:
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[frozenset[str] | BaseException] = asyncio.Queue()

    def publish(update: frozenset[str] | BaseException) -> None:  # called from the thread
        try:
            loop.call_soon_threadsafe(updates.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            follower.stopped.set()

    follower = SliceFollower(kubernetes.client.DiscoveryV1Api(api_client), source, publish)
    threading.Thread(target=follower.run, name=f"discovery {source}", daemon=True).start()
    last: frozenset[str] | None = None
    try:
        while True:
            update = await updates.get()
            if isinstance(update, BaseException):
                raise update
            if update != last:
                log.info("discovery %s: %d address(es): %s", source, len(update), sorted(update))
                last = update
                yield update
    finally:
        follower.stop()


class SliceFollower:
    """List, then watch, a Service's EndpointSlices; publish the union of their addresses after each
    change, and the last known union after each failure."""

    def __init__(self, api: kubernetes.client.DiscoveryV1Api, source: Source, publish: Callable):
        self.api, self.source, self.publish = api, source, publish
        self.slices: dict[str, frozenset[str]] = {}  # slice name -> its addresses
        self.stopped = threading.Event()
        self._watch: kubernetes.watch.Watch | None = None

    def stop(self) -> None:
        self.stopped.set()
        if self._watch is not None:
            self._watch.stop()  # shuts its socket down: a read blocked in the thread returns now

    def run(self) -> None:
        try:
            self._follow()
        except BaseException as e:  # not an API failure but a bug: raised where watch() is iterated
            self.publish(e)

    def _follow(self) -> None:
        s = self.source
        query = {"label_selector": f"kubernetes.io/service-name={s.name}"}
        version: str | None = None  # None: list again
        failures = 0
        while not self.stopped.is_set():
            try:
                if version is None:
                    listed = self.api.list_namespaced_endpoint_slice(
                        s.namespace, **query, _request_timeout=(5, 30)
                    )
                    self.slices = {
                        i.metadata.name: slice_addresses(i, s.port_name) for i in listed.items
                    }
                    version = listed.metadata.resource_version
                    self._publish()
                self._watch = kubernetes.watch.Watch()
                for event in self._watch.stream(
                    self.api.list_namespaced_endpoint_slice,
                    s.namespace,
                    **query,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=WATCH_SECONDS,
                    _request_timeout=(5, WATCH_SECONDS + 10),
                ):
                    self.apply(event["type"], event["object"])
                version = self._watch.resource_version or version
                failures = 0
            except kubernetes.client.ApiException as e:
                if e.status == 410:  # our resourceVersion is too old to watch from
                    version = None
                    continue
                error = f"{e.status} {e.reason}"
                if e.status == 403:
                    error += (
                        " (the gateway needs list and watch on endpointslices.discovery.k8s.io)"
                    )
                failures = self._failed(failures, error)
            except (urllib3.exceptions.HTTPError, OSError) as e:
                failures = self._failed(failures, repr(e))

    def apply(self, kind: str, endpoint_slice) -> None:
        """One watch event; BOOKMARKs only move the resourceVersion on."""
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        name = endpoint_slice.metadata.name
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = slice_addresses(endpoint_slice, self.source.port_name)
        self._publish()

    def _publish(self) -> None:
        self.publish(frozenset().union(*self.slices.values()))

    def _failed(self, failures: int, error: str) -> int:
        """Keep the last set, log the first failure of a streak and wait out the backoff."""
        if self.stopped.is_set():
            return failures
        if not failures:
            log.warning(
                "discovery %s: Kubernetes API failed, keeping the last addresses: %s",
                self.source,
                error,
            )
        self._publish()
        self.stopped.wait(min(2.0**failures, MAX_BACKOFF))
        return failures + 1
