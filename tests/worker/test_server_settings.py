"""The worker process's settings, flags, watchdog decision and drain-rate measurement (no model
needed)."""

import argparse

import pytest

from meridian.api.v1 import pb
from meridian.errors import UserError
from meridian.worker.engine.llm_engine import EngineSettings
from meridian.worker.server import WorkerSettings, add_arguments, watchdog_state, worker_settings
from meridian.worker.service import RateWindow


def parse(*argv: str) -> WorkerSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return worker_settings(parser.parse_args(list(argv)))


def test_flags_build_the_settings():
    s = parse("--port", "6000", "--host", "0.0.0.0", "--drain-timeout", "5", "--max-num-seqs", "4")
    assert (s.host, s.port, s.drain_timeout, s.engine.max_num_seqs) == ("0.0.0.0", 6000, 5.0, 4)
    assert s.model_name == s.engine.model  # served under the name it was loaded by
    assert parse("--served-model-name", "chat").model_name == "chat"
    s = parse("--step-timeout", "2.5", "--max-waiting", "8")
    assert (s.step_timeout, s.engine.max_waiting) == (2.5, 8)
    assert parse().step_timeout == 30.0 and parse().engine.max_waiting == 256


@pytest.mark.parametrize(
    "kw",
    [
        {"port": 70000},
        {"metrics_port": -1},
        {"drain_timeout": -1},
        {"served_model_name": ""},
        {"step_timeout": 0},
    ],
)
def test_bad_settings_are_user_errors(kw):
    with pytest.raises(UserError):
        WorkerSettings(EngineSettings(), **kw)
    with pytest.raises(UserError, match="max_waiting"):
        EngineSettings(max_waiting=-1)


SERVING, STALLED = pb.SERVING_STATE_SERVING, pb.SERVING_STATE_STALLED


@pytest.mark.parametrize(
    ("state", "step_started", "expected"),
    [
        (SERVING, None, SERVING),  # idle
        (SERVING, 95.0, SERVING),  # a step of 5 s so far
        (SERVING, 89.0, STALLED),  # 11 s: over the 10 s bound
        (STALLED, 89.0, STALLED),  # still in that step
        (STALLED, 99.9, SERVING),  # a new step: the stuck one returned
        (STALLED, None, SERVING),
        (pb.SERVING_STATE_DRAINING, 0.0, pb.SERVING_STATE_DRAINING),  # other states are not its
        (pb.SERVING_STATE_STARTING, 0.0, pb.SERVING_STATE_STARTING),
    ],
)
def test_watchdog_stalls_only_while_a_step_overruns(state, step_started, expected):
    assert watchdog_state(state, step_started, now=100.0, step_timeout=10.0) == expected


def test_rate_window_measures_over_the_window_only():
    w = RateWindow(window=5.0)
    assert w.rate() == 0.0
    for t in range(11):  # 10 per second for 10 seconds
        w.add(float(t), 10.0 * t)
    assert w.rate() == pytest.approx(10.0)
    w.add(11.0, 100.0)  # then nothing more for a second
    assert w.rate() < 10.0
    assert w.samples[0][0] >= 5.0  # older samples dropped
