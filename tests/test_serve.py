"""`meridian serve` hands its engine flags and timeouts on unchanged, and restarts a worker that
exits (but not one that keeps dying, nor one that dies while loading)."""

import argparse
import asyncio
import os
import sys

import pytest

from meridian.serve import (
    LocalWorker,
    RestartPolicy,
    ServeSettings,
    add_arguments,
    keep_running,
    worker_command,
)
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


def test_timeouts_reach_every_gateway():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--regions", "a,b", "--request-timeout", "30", "--first-token-timeout", "5"]
    )
    settings = ServeSettings(
        EngineSettings(),
        regions=args.regions,
        request_timeout=args.request_timeout,
        first_token_timeout=args.first_token_timeout,
    )
    gateways = settings.gateways()
    assert [(g.request_timeout, g.first_token_timeout) for g in gateways] == [(30, 5), (30, 5)]


def test_restart_waits_longer_while_a_worker_keeps_dying_young_then_gives_up():
    policy = RestartPolicy(max_restarts=5, young=60, first_backoff=0.5, max_backoff=8)
    deaths, delays = 0, []
    for _ in range(6):
        deaths = policy.young_deaths(deaths, lived=10)
        delays.append(policy.delay(deaths))
    assert delays == [0.5, 1, 2, 4, 8, None]
    # A worker that ran for longer than `young` starts its count afresh.
    assert policy.young_deaths(5, lived=600) == 0
    assert policy.delay(policy.young_deaths(5, lived=600)) == 0.5


def fake_worker(code: str) -> LocalWorker:
    worker = LocalWorker("127.0.0.1:1", [sys.executable, "-c", code], dict(os.environ), 0)
    worker.start()
    return worker


async def supervise(worker: LocalWorker, policy: RestartPolicy, ready: bool, timeout: float):
    loaded, stopping = asyncio.Event(), asyncio.Event()
    if ready:
        loaded.set()
    try:
        return await asyncio.wait_for(keep_running(worker, policy, loaded, stopping, 0.01), timeout)
    finally:
        if worker.running():
            worker.process.kill()
            worker.process.wait()


QUICK = RestartPolicy(max_restarts=2, young=60, first_backoff=0.01, max_backoff=0.01)


def test_a_worker_that_keeps_dying_stops_serve_with_its_exit_status():
    worker = fake_worker("import sys; sys.exit(7)")
    reason = asyncio.run(supervise(worker, QUICK, ready=True, timeout=60))
    assert worker.restarts == 2
    assert reason == (
        "worker 127.0.0.1:1 exited (status 7) 3 times in a row within 60 s of starting; "
        "giving up and stopping"
    )


def test_a_worker_that_exits_while_loading_stops_serve_at_once():
    worker = fake_worker("import sys; sys.exit(3)")
    reason = asyncio.run(supervise(worker, QUICK, ready=False, timeout=60))
    assert worker.restarts == 0
    assert reason == "worker 127.0.0.1:1 exited (status 3) while loading; stopping"


def test_a_worker_that_lived_long_enough_is_restarted_again_and_again():
    policy = RestartPolicy(max_restarts=0, young=0.1, first_backoff=0.01, max_backoff=0.01)
    worker = fake_worker("import time; time.sleep(0.3)")
    with pytest.raises(TimeoutError):
        asyncio.run(supervise(worker, policy, ready=True, timeout=3))
    assert worker.restarts >= 2
    assert worker.young_deaths == 0


def test_nothing_is_restarted_once_serve_is_stopping():
    worker = fake_worker("import time; time.sleep(0.2)")
    loaded, stopping = asyncio.Event(), asyncio.Event()
    loaded.set()

    async def stop_soon():
        task = asyncio.ensure_future(keep_running(worker, QUICK, loaded, stopping, 0.01))
        await asyncio.sleep(0.05)
        stopping.set()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(stop_soon()) is None
    worker.process.wait(10)
    assert worker.restarts == 0


def test_a_worker_starts_from_the_repository_root_without_pythonsafepath(tmp_path):
    # The repository's `operator/` folder must not shadow the standard library's `operator`.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    code = "import enum, signal; open(sys.argv[1], 'w').write('ok')".replace(
        "sys", "__import__('sys')"
    )
    worker = LocalWorker("127.0.0.1:1", [sys.executable, "-c", code, str(tmp_path / "ran")], env, 0)
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cwd = os.getcwd()
    os.chdir(repo_root)
    try:
        worker.start()
    finally:
        os.chdir(cwd)
    assert worker.process.wait(30) == 0
    assert (tmp_path / "ran").read_text() == "ok"
