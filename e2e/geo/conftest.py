"""A three-region fleet on loopback for the geo suite (see geo_fleet.py for its shape).

The workers are started once for the suite (loading the model takes most of a minute on 2 cores)
and revived if a test left some dead; toxiproxy, dnsmasq and the gateways are started per module,
so each module routes with fresh gateways (no RTT, spill or cache state from another module) and
may set its own gateway flags by overriding the `gateway_flags` fixture.
"""

import pytest
from geo_fleet import Fleet, Workers


@pytest.fixture(scope="session")
def geo_log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("geo-logs")


@pytest.fixture(scope="session")
def geo_workers(geo_log_dir):
    workers = Workers(geo_log_dir)
    try:
        workers.wait_serving()
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def gateway_flags() -> list[str]:
    """Flags every gateway of the module's fleet gets."""
    return []


@pytest.fixture(scope="module")
def fleet(request, tmp_path_factory, geo_workers, gateway_flags):
    geo_workers.revive()
    log_dir = tmp_path_factory.mktemp(f"{request.module.__name__}-logs")  # gateways, proxies
    fleet = Fleet(log_dir, geo_workers, gateway_flags)
    try:
        yield fleet
    finally:
        fleet.stop()
