"""Region a loses every worker under load: its gateway fails over to b and c without failing what it
can still retry, and takes a back as soon as a's workers serve again."""

import asyncio
import time
from collections import Counter

import httpx
import pytest
from geo_client import CLIENT_TIMEOUT, Answer, chat

pytestmark = [pytest.mark.geo, pytest.mark.timeout(360)]

CLIENTS = 4  # back-to-back loops: even ones stream, odd ones do not
BEFORE_KILL, AFTER_KILL = 3.0, 6.0  # seconds of load
DETECT_WITHIN = 2.0  # seconds after the kill from which every request must fail over at once
BACK_WITHIN = 10.0  # seconds after a's workers serve again by which a serves again


def test_region_loss_fails_over_then_comes_back(fleet, capsys):
    fleet.wait_idle()
    answers: list[tuple[bool, Answer]] = []  # (streamed, answer)
    times = {}

    async def client(c: httpx.AsyncClient, n: int, stop: asyncio.Event) -> None:
        stream = n % 2 == 0
        for i in range(10_000):
            if stop.is_set():
                return
            prompt = f"Client {n} request {i}: name a colour."
            answers.append((stream, await chat(c, fleet.a.url, prompt, stream=stream)))

    async def load() -> None:
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:
            clients = [asyncio.create_task(client(c, n, stop)) for n in range(CLIENTS)]
            await asyncio.sleep(BEFORE_KILL)
            times["kill"] = time.monotonic()
            await asyncio.to_thread(fleet.workers.kill, "a")  # returns once both are gone
            times["dead"] = time.monotonic()
            await asyncio.sleep(AFTER_KILL)
            stop.set()
            await asyncio.gather(*clients)

    asyncio.run(load())
    kill, dead = times["kill"], times["dead"]
    with capsys.disabled():
        phases = {
            "before the kill": [a for _, a in answers if a.done < kill],
            "across the kill": [a for _, a in answers if a.sent < dead <= a.done],
            "after the kill": [a for _, a in answers if a.sent >= dead],
        }
        print()
        for phase, group in phases.items():
            routes = Counter((a.region, a.route) if a.ok else "failed" for a in group)
            print(f"{phase}: {dict(routes)}")

    # Nothing had reached the client of a non-streamed answer: each one is retried if need be.
    assert all(a.ok for s, a in answers if not s), [a for s, a in answers if not s and not a.ok]
    # A stream is retried until its first token, so none fails before one: only streams that were
    # already under way from a's workers may break. (Whether a token reached the gateway before
    # the kill the client cannot time exactly; that a token came before the error, it can see.)
    broken = [a for s, a in answers if s and not a.ok]
    assert all(a.ttft is not None for a in broken), broken
    assert all(a.sent < dead for a in broken), broken
    # What was waiting for a's workers when they died was answered by b or c instead.
    across = [a for _, a in answers if a.sent < kill and a.done > dead and a.ok]
    moved = [a for a in across if a.route in ("retry", "failover")]
    assert moved and all(a.region in ("b", "c") for a in moved), across
    after = [a for _, a in answers if a.sent >= dead]
    assert all(a.region in ("b", "c") and a.route in ("retry", "failover") for a in after), after
    # Within DETECT_WITHIN of the kill the gateway knows a is gone: no more tries on a first.
    late = [a for a in after if a.sent >= dead + DETECT_WITHIN]
    assert late and all(a.route == "failover" for a in late), [
        a for a in late if a.route != "failover"
    ]

    fleet.workers.restart("a")
    for w in fleet.workers.by_region["a"]:
        w.wait_until(w.serving, "serving again")
    serving = time.monotonic()

    async def until_home() -> list[Answer]:
        probes = []
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as c:
            while time.monotonic() < serving + BACK_WITHIN + 5:
                probe = await chat(c, fleet.a.url, f"Back home {len(probes)}?", stream=False)
                probes.append(probe)
                if probe.region == "a":
                    break
                await asyncio.sleep(0.2)
        return probes

    probes = asyncio.run(until_home())
    with capsys.disabled():
        back = probes[-1].done - serving
        print(f"a served again {back:.1f} s after its workers reported serving: {probes[-1]}")
    assert all(p.ok for p in probes), probes
    assert probes[-1].region == "a" and probes[-1].route == "local", probes
    assert probes[-1].done - serving <= BACK_WITHIN, probes
