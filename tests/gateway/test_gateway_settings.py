"""The gateway process: its settings, and that it runs without torch or a model."""

import argparse
import re
import subprocess
import sys

import pytest

from meridian import cli
from meridian.errors import UserError
from meridian.gateway.server import GatewaySettings, add_arguments, gateway_settings


def test_the_gateway_does_not_import_torch():
    code = "import sys, meridian.gateway.server; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-P", "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"workers": ()},
        {"workers": ("no-port",)},
        {"workers": ("host:0",)},
        {"http_port": 70000},
        {"grpc_port": 8000},  # same as the HTTP port
        {"max_attempts": 0},
        {"max_queue_per_worker": -1},
        {"stale_after": 0.2},  # not longer than the report interval
        {"drain_timeout": -1},
    ],
)
def test_bad_settings_are_user_errors(kw):
    with pytest.raises(UserError):
        GatewaySettings(**{"workers": ("localhost:50061",), **kw})


def test_ipv6_worker_addresses_are_accepted():
    assert GatewaySettings(workers=("[::1]:50061",)).workers == ("[::1]:50061",)


@pytest.mark.parametrize(
    "kw",
    [
        {"peers": ("127.0.0.1:50052",)},  # no region
        {"peers": ("=127.0.0.1:50052",)},
        {"peers": ("eu west=127.0.0.1:50052",)},
        {"peers": ("eu-west=127.0.0.1",)},  # no port
        {"peers": ("eu-west=127.0.0.1:0",)},
        {"peer_dns": ("10.0.0.1",)},  # an IP, not a DNS name
        {"peer_dns": ("not a name",)},
        {"worker_dns": ("workers.svc:99999",)},
        {"worker_endpointslices": ("Llm/Workers",)},
        {"region": ""},
        {"region": "eu/west"},
        {"region": "x" * 64},
        {"dns_server": "resolver.local"},
        {"dns_server": "10.0.0.1:0"},
        {"auto_model": "small"},
        {"auto_model": "small,small"},
        {"auto_model": "auto,large"},
        {"auto_model": "a,b,c"},
        {"request_timeout": 0},
        {"spill_margin": -0.1},
        {"probe_share": 1.0},
        {"result_cache_size": -1},
    ],
)
def test_bad_geo_settings_are_user_errors(kw):
    with pytest.raises(UserError):
        GatewaySettings(**{"workers": ("localhost:50061",), **kw})


def test_a_peer_value_error_shows_the_expected_form():
    with pytest.raises(UserError, match="REGION=HOST:PORT"):
        GatewaySettings(peers=("127.0.0.1:50052",))


def test_a_region_with_peers_and_no_workers_of_its_own_is_valid():
    settings = GatewaySettings(region="ap-south_1", peers=("eu-west=10.1.0.5:50051",))
    assert settings.peer_regions() == {"10.1.0.5:50051": "eu-west"}
    assert GatewaySettings(peer_dns=("_grpc._tcp.gateways.example.com",)).worker_sources() == []


def test_good_dns_servers_are_accepted():
    for server in ("10.96.0.10", "10.96.0.10:5353", "[fd00::10]:53"):
        GatewaySettings(workers=("localhost:50061",), dns_server=server)


def test_help_lists_the_new_flags(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["meridian"])
    with pytest.raises(SystemExit) as exit_:
        cli.main(["gateway", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for flag in (
        "--region",
        "--peer",
        "--peer-dns",
        "--worker-dns",
        "--worker-endpointslices",
        "--api-keys-file",
        "--auto-model",
        "--result-cache-size",
        "--request-timeout",
        "--no-prefix-affinity",
    ):
        assert re.search(rf"(^|\s){flag}\b(?!-)", help_text), flag


def test_flags_become_settings():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--region=eu-west",
            "--peer=us-east=10.2.0.5:50051",
            "--peer=ap=10.3.0.5:50051",
            "--peer-dns=_grpc._tcp.gateways.example.com",
            "--worker-dns=workers.llm.svc.cluster.local:50051",
            "--worker-endpointslices=llm/workers",
            "--api-keys-file=/etc/meridian/keys",
            "--auto-model=small,large",
            "--result-cache-size=0",
            "--request-timeout=30",
            "--no-prefix-affinity",
        ]
    )
    s = gateway_settings(args)
    assert s.region == "eu-west"
    assert s.peers == ("us-east=10.2.0.5:50051", "ap=10.3.0.5:50051")
    assert s.peer_dns == ("_grpc._tcp.gateways.example.com",)
    assert s.worker_dns == ("workers.llm.svc.cluster.local:50051",)
    assert s.worker_endpointslices == ("llm/workers",)
    assert (s.api_keys_file, s.auto_model) == ("/etc/meridian/keys", "small,large")
    assert (s.result_cache_size, s.request_timeout, s.prefix_affinity) == (0, 30.0, False)
    assert gateway_settings(parser.parse_args(["--worker=h:1"])).prefix_affinity is True
