"""The worker process's settings, flags and drain-rate measurement (no model needed)."""

import argparse

import pytest

from meridian.errors import UserError
from meridian.worker.engine.llm_engine import EngineSettings
from meridian.worker.server import WorkerSettings, add_arguments, worker_settings
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


@pytest.mark.parametrize(
    "kw", [{"port": 70000}, {"metrics_port": -1}, {"drain_timeout": -1}, {"served_model_name": ""}]
)
def test_bad_settings_are_user_errors(kw):
    with pytest.raises(UserError):
        WorkerSettings(EngineSettings(), **kw)


def test_rate_window_measures_over_the_window_only():
    w = RateWindow(window=5.0)
    assert w.rate() == 0.0
    for t in range(11):  # 10 per second for 10 seconds
        w.add(float(t), 10.0 * t)
    assert w.rate() == pytest.approx(10.0)
    w.add(11.0, 100.0)  # then nothing more for a second
    assert w.rate() < 10.0
    assert w.samples[0][0] >= 5.0  # older samples dropped
