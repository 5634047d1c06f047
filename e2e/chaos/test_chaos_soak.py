"""bench/soak.py for one minute (its own `meridian serve`): mixed load at twice what the fleet runs
at once answers only 200s and 429s, and memory and file descriptors stay flat."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_a_one_minute_soak_keeps_every_bound(capsys):
    run = subprocess.run(
        [sys.executable, "-P", str(SOAK), "--minutes", "1"],
        capture_output=True,
        text=True,
        timeout=400,  # startup (the model, twice) + the minute + the last requests + shutdown
    )
    with capsys.disabled():
        print("\n" + run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
