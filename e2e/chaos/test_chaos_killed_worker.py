"""A worker killed (SIGKILL) mid-stream: its streams end with an error event and [DONE], never in
silence; whole answers and new requests are served by the other worker; `meridian serve` starts
the worker again on the same address and the gateway routes to it once it serves."""

import asyncio
import signal
import time

import pytest
from chaos_client import Load, client, until
from chaos_serve import REQUEST_TIMEOUT, grpc_serving

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]

CLIENTS = 8
NOTICE = 5.0  # seconds a stream on a killed worker may take to end
SLACK = 5.0  # seconds past a request's deadline before it counts as hung
RELOAD = 180.0  # seconds a restarted worker may take to load the model (2 busy cores)


def test_a_killed_worker_ends_its_streams_with_an_error_and_is_restarted(serve, capsys):
    victim, other = serve.wait_healthy()
    answers, (killed, restarted, back, rejoined) = asyncio.run(_kill_one_under_load(serve, victim))
    with capsys.disabled():
        print(
            f"\nkilled worker: {len(answers)} requests; restarted {restarted - killed:.1f} s "
            f"after SIGKILL, serving again after {back - killed:.1f} s, answering after "
            f"{rejoined - killed:.1f} s"
        )
    log = serve.log(400)
    assert f"worker {victim.address} exited (status -9)" in log, log
    open_at_kill = [a for a in answers if a.sent < killed and (a.ended or 1e18) > killed]
    on_victim = [a for a in open_at_kill if a.stream and a.replica == victim.address]
    assert on_victim, "no stream was running on the worker when it was killed"
    with capsys.disabled():
        print(f"  how the streams on it ended: {[a.events[-2:] for a in on_victim]}")
    problems = []
    for a in answers:
        if a.failure or a.ended is None:
            problems.append(f"hung: {a.describe()}")
        elif a.status != 200:
            problems.append(f"not answered: {a.describe()}")
        elif a in on_victim:
            if not a.ended_with_error():
                problems.append(
                    f"a stream on the killed worker did not end with an error event "
                    f"and [DONE]: {a.describe()}"
                )
            elif a.ended - killed > NOTICE:
                problems.append(
                    f"a stream on the killed worker ended {a.ended - killed:.1f} s "
                    f"after the kill: {a.describe()}"
                )
        elif a.stream and (a.error_events or not a.done):
            problems.append(f"failed: {a.describe()}")
        elif killed < a.sent < back and a.replica != other.address:
            problems.append(f"answered by the killed worker: {a.describe()}")
    try:
        serve.wait_quiet(10)
    except AssertionError as e:
        problems.append(str(e))
    assert not problems, "\n".join(problems)


async def _kill_one_under_load(serve, victim):
    async with client(serve.url) as http:
        load = Load(http, CLIENTS, timeout=REQUEST_TIMEOUT + SLACK).start()
        try:
            await until(lambda: _streaming_on(load, victim.address), 60, "streaming from it")
            killed = time.monotonic()
            victim.signal(signal.SIGKILL)
            await until(lambda: _restarted(serve, victim), 15, "restarted by meridian serve")
            restarted = time.monotonic()
            await until(
                lambda: grpc_serving(victim.address) and serve.serving() == 2,
                RELOAD,
                "serving again (and routed to)",
            )
            back = time.monotonic()
            await until(
                lambda: any(a.sent > back and a.replica == victim.address for a in load.answers),
                30,
                "answered by the restarted worker",
            )
            rejoined = time.monotonic()
        finally:
            answers = await load.stop()
    return answers, (killed, restarted, back, rejoined)


def _streaming_on(load: Load, address: str) -> bool:
    return any(a.stream and a.replica == address and a.ended is None for a in load.answers)


def _restarted(serve, victim) -> bool:
    now = serve.worker(victim.address)
    return now is not None and now.pid != victim.pid
