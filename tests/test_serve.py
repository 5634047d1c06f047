"""`meridian serve` hands its engine flags to each worker unchanged."""

import argparse

from meridian.serve import worker_command
from meridian.worker.arguments import add_engine_arguments, engine_flags, engine_settings
from meridian.worker.engine.llm_engine import EngineSettings


def parse_engine(argv: list[str]) -> EngineSettings:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_settings(parser.parse_args(argv))


def test_engine_flags_round_trip():
    for settings in (
        EngineSettings(),
        EngineSettings(
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=64,
            max_model_len=512,
            kv_cache_memory=2**28,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            dtype="bfloat16",
        ),
    ):
        assert parse_engine(engine_flags(settings)) == settings


def test_worker_command_runs_the_worker_module_without_the_cwd_on_sys_path():
    command = worker_command(EngineSettings(), "127.0.0.1:7001", 9001, 5.0)
    assert command[1:5] == ["-P", "-m", "meridian.cli", "worker"]
    assert command[command.index("--port") + 1] == "7001"
    assert command[command.index("--metrics-port") + 1] == "9001"
