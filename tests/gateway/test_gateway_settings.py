"""The gateway process: its settings, and that it runs without torch or a model."""

import subprocess
import sys

import pytest

from meridian.errors import UserError
from meridian.gateway.server import GatewaySettings


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
