"""DNS discovery against a real DNS server (dnsmasq, TTL 1 s): SRV and A records, changes, outages.

About 15 s in all, most of it waiting for records to expire.
"""

import asyncio
import logging

import pytest
from dns_server import Dnsmasq

from meridian.gateway import discovery
from meridian.gateway.discovery import parse_dns, watch

pytestmark = pytest.mark.timeout(120)

SRV = "_grpc._tcp.workers.meridian.test"
W0, W1 = "w0.meridian.test", "w1.meridian.test"
WORKERS = "workers.meridian.test"


def test_srv_with_two_targets_gives_every_address_of_both(dnsmasq: Dnsmasq, follow):
    dnsmasq.set_records(
        srv={SRV: [(W0, 50051), (W1, 50052)]},
        hosts={W0: ["127.0.0.11"], W1: ["127.0.0.12", "fd00::12"]},
    )

    async def main():
        changes = follow(watch(parse_dns(SRV), dnsmasq.nameserver))
        assert await changes.next(5) == {"127.0.0.11:50051", "127.0.0.12:50052", "[fd00::12]:50052"}
        await changes.close()

    asyncio.run(main())


def test_a_records_of_a_name_with_a_port(dnsmasq: Dnsmasq, follow):
    dnsmasq.set_records(srv={}, hosts={WORKERS: ["127.0.0.21", "127.0.0.22"]})

    async def main():
        changes = follow(watch(parse_dns(f"{WORKERS}:7000"), dnsmasq.nameserver))
        assert await changes.next(5) == {"127.0.0.21:7000", "127.0.0.22:7000"}
        await changes.close()

    asyncio.run(main())


def test_record_changes_are_followed_within_seconds(dnsmasq: Dnsmasq, follow):
    dnsmasq.set_records(srv={SRV: [(W0, 50051)]}, hosts={W0: ["127.0.0.31"]})

    async def main():
        changes = follow(watch(parse_dns(SRV), dnsmasq.nameserver))
        assert await changes.next(5) == {"127.0.0.31:50051"}
        two_targets = {SRV: [(W0, 50051), (W1, 50052)]}
        dnsmasq.set_records(two_targets, hosts={W0: ["127.0.0.31"], W1: ["127.0.0.32"]})
        await changes.until({"127.0.0.31:50051", "127.0.0.32:50052"}, timeout=5)
        dnsmasq.set_records(two_targets, hosts={W0: ["127.0.0.33"], W1: ["127.0.0.32"]})
        await changes.until({"127.0.0.33:50051", "127.0.0.32:50052"}, timeout=5)
        dnsmasq.set_records(srv={}, hosts={})  # NXDOMAIN: no workers
        await changes.until(set(), timeout=5)
        dnsmasq.set_records(srv={SRV: [(W1, 50052)]}, hosts={W1: ["127.0.0.32"]})
        await changes.until({"127.0.0.32:50052"}, timeout=5)
        await changes.close()

    asyncio.run(main())


def test_the_server_going_away_keeps_the_last_set(follow, caplog: pytest.LogCaptureFixture):
    with (
        Dnsmasq(hosts={WORKERS: ["127.0.0.41", "127.0.0.42"]}) as server,
        caplog.at_level(logging.WARNING, discovery.__name__),
    ):

        async def main():
            changes = follow(watch(parse_dns(f"{WORKERS}:7000"), server.nameserver))
            assert await changes.next(5) == {"127.0.0.41:7000", "127.0.0.42:7000"}
            server.stop()
            with pytest.raises(AssertionError, match="nothing came"):
                await changes.next(5)  # several TTLs and retries: the set stands
            server.set_records(srv={}, hosts={WORKERS: ["127.0.0.43"]})
            await changes.until({"127.0.0.43:7000"}, timeout=10)  # a 3 s lookup may be under way
            await changes.close()

        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once for the whole outage
    assert "keeping the last addresses" in warnings[0]
