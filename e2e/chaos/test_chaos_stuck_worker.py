"""A worker that stops answering (SIGSTOP) under load: the gateway stops routing to it within 5 s,
what it had not started answering goes to the other worker, nothing waits past its deadline, and
after SIGCONT it gets requests again."""

import asyncio
import signal
import time

import pytest
from chaos_client import Load, client, until
from chaos_serve import REQUEST_TIMEOUT, value

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

CLIENTS = 8
DETECT = 5.0  # seconds the gateway may take to stop routing to a stopped worker
SLACK = 5.0  # seconds past a request's deadline before it counts as hung


def test_a_stopped_worker_is_routed_around_and_rejoins_after_sigcont(serve, capsys):
    victim, other = serve.wait_healthy()
    answers, times = asyncio.run(_stop_one_under_load(serve, victim))
    stopped, detected, resumed, rejoined = times
    with capsys.disabled():
        print(
            f"\nstuck worker: {len(answers)} requests; routed around after "
            f"{detected - stopped:.1f} s; stopped for {resumed - stopped:.1f} s; "
            f"answered again {rejoined - resumed:.1f} s after SIGCONT"
        )
    problems = []
    if detected - stopped > DETECT:
        problems.append(f"the gateway took {detected - stopped:.1f} s to stop routing to it")
    open_at_stop = [a for a in answers if a.sent < stopped and (a.ended or 1e18) > stopped]
    # Streams that had a token from it (a stopped process sends none): too late to move them.
    on_victim = [a for a in open_at_stop if a.stream and a.replica == victim.address]
    for a in answers:
        if a.failure or a.ended is None:
            problems.append(f"hung past its deadline: {a.describe()}")
        elif a.ended - a.sent > REQUEST_TIMEOUT + SLACK:
            problems.append(f"ended {a.ended - a.sent:.1f} s after it was sent: {a.describe()}")
        elif a.status != 200 and not a.stream and a in open_at_stop:
            # Nothing of a whole answer reaches the client before its end, so it may always start
            # again elsewhere (DESIGN: retries happen until the first token reaches the client), as
            # it does when its worker is killed (test_chaos_killed_worker).
            problems.append(
                f"a whole answer open at SIGSTOP was not started again on the other worker: "
                f"{a.describe()}"
            )
        elif a.status != 200:
            problems.append(f"not answered: {a.describe()}")
        elif a in on_victim:
            if not a.done:
                problems.append(
                    f"a stream on the stopped worker did not end with [DONE]: {a.describe()}"
                )
        elif a.replica == victim.address and stopped < a.sent < resumed:
            problems.append(f"answered by the stopped worker: {a.describe()}")
        elif a.stream and (a.error_events or not a.done):
            problems.append(
                f"a stream that had no token from the stopped worker failed: {a.describe()}"
            )
        elif stopped + DETECT < a.sent < resumed and a.route != "local":
            problems.append(
                f"sent to the stopped worker {a.sent - stopped:.1f} s after SIGSTOP: {a.describe()}"
            )
    moved = [a for a in open_at_stop if a not in on_victim and a.replica == other.address]
    with capsys.disabled():
        print(
            f"  open at SIGSTOP: {len(open_at_stop)} ({len(on_victim)} streaming from it, "
            f"{len(moved)} answered by the other worker); how the streams on it ended: "
            f"{[a.events[-2:] for a in on_victim]}"
        )
    try:
        serve.wait_quiet(10)
    except AssertionError as e:
        problems.append(str(e))
    assert not problems, "\n".join(problems)


async def _stop_one_under_load(serve, victim):
    async with client(serve.url) as http:
        load = Load(http, CLIENTS, timeout=REQUEST_TIMEOUT + SLACK).start()
        try:
            await until(lambda: _busy(load, victim), 60, "streaming from it, and running more")
            stopped = time.monotonic()
            victim.signal(signal.SIGSTOP)
            try:
                await until(lambda: _serving(serve) == 1, 30, "routed around")
                detected = time.monotonic()
                # Every request open at the stop has met its deadline (or ended before it).
                open_at_stop = [a for a in load.answers if a.ended is None]
                await until(
                    lambda: all(a.ended or a.failure for a in open_at_stop),
                    REQUEST_TIMEOUT + 2 * SLACK,
                    "every request open at SIGSTOP ended",
                )
            finally:
                victim.signal(signal.SIGCONT)
            resumed = time.monotonic()
            await until(
                lambda: any(a.sent > resumed and a.replica == victim.address for a in load.answers),
                30,
                "answered by the worker again after SIGCONT",
            )
            rejoined = time.monotonic()
        finally:
            answers = await load.stop()
    return answers, (stopped, detected, resumed, rejoined)


def _busy(load: Load, worker) -> bool:
    """A stream from `worker` has had a token, and the worker runs more requests than those
    streams: whole answers (or streams before their first token) are there too."""
    streams = sum(
        a.stream and a.replica == worker.address and a.ended is None for a in load.answers
    )
    running = value(worker.metrics(), "meridian_num_requests_running")
    return streams > 0 and running > streams


def _serving(serve) -> float:
    """Workers in state serving, as the gateway's metrics say."""
    return value(serve.metrics(), "meridian_workers", state="serving")
