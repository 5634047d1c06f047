"""Soak: minutes of mixed load at twice what the fleet runs at once, against `meridian serve`, and
whether anything leaks or fails.

The load is a closed loop of 2 x workers x --max-num-seqs clients (what the fleet runs at once,
twice over, so half of them queue), each sending its next request when its last one ends: chat or
completion, streamed or not, one in five with logprobs, one in ten hung up by the client at a
random point. The bounds, each checked and printed:

  - every answer is a 200 or a 429 (hung-up requests: whatever status came before the hang-up),
    and none takes longer than --request-bound seconds;
  - the resident memory and open file descriptors of the serve process (the gateway) and of each
    worker grow by less than 10% from just after the warm-up (the first 10% of the run, at least
    15 s) to the end (medians of the samples of a window, taken every 2 s, in each place);
  - no worker restarts; once the load stops, nothing is in flight anywhere and no KV block is held.

It starts its own `meridian serve` (flags below, its output in a temporary log) or uses --url,
with --pid to watch that serve process and its workers. Prints a table of figures; exits 1 when a
bound is broken.

    python -P bench/soak.py [--minutes 10] [--workers 2] [--max-num-seqs 8] [--url URL --pid PID]
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from meridian.net import free_port
from meridian.worker.loaders import DEFAULT_MODEL

STARTUP_TIMEOUT = 300  # seconds: the workers load the model
GROWTH_BOUND = 0.10  # of RSS and of open file descriptors, after the warm-up
SAMPLE_EVERY = 2.0  # seconds
SETTLE = 5.0  # seconds the gauges get to return to 0 after the load
MAX_MODEL_LEN = 128
PROMPT = "Once upon a time, in a small village by the sea,"
CHAT = [{"role": "user", "content": "Tell me a story about the sea."}]


@dataclass
class Tally:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)  # of answers whose status came
    hung_up: int = 0  # by this client, on purpose
    failures: list = field(default_factory=list)  # client-side: timeouts, resets (first 20)
    failed: int = 0
    bad: list = field(default_factory=list)  # answers that are not 200 or 429 (first 20)
    tokens: int = 0
    latencies: list = field(default_factory=list)  # seconds, of finished 200s


@dataclass
class Sample:
    at: float  # seconds since the load started
    rss: dict  # process name -> bytes
    fds: dict  # process name -> open descriptors
    pids: dict  # process name -> pid


def request_body(rng: random.Random, model: str) -> tuple[str, dict]:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    body = {"model": model, "max_tokens": rng.randint(8, 48), "stream": stream}
    if rng.random() < 0.2:
        body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    if chat:
        return "/v1/chat/completions", body | {"messages": CHAT}
    return "/v1/completions", body | {"prompt": PROMPT}


async def one_request(http: httpx.AsyncClient, rng: random.Random, model: str, tally: Tally, bound):
    path, body = request_body(rng, model)
    hang_up = rng.uniform(0, 2) if rng.random() < 0.1 else None
    status = None
    sent = time.monotonic()
    tally.sent += 1

    async def read() -> None:
        nonlocal status
        async with http.stream("POST", path, json=body) as r:
            status = r.status_code
            if status != 200:
                text = (await r.aread()).decode(errors="replace")
                if status != 429:
                    tally.bad.append(f"{status} {text[:300]}")
                return
            try:
                if body["stream"]:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                tally.bad.append(f"200 stream with an error event: {line[:300]}")
                            tally.tokens += bool(event.get("choices"))
                else:
                    tally.tokens += json.loads(await r.aread())["usage"]["completion_tokens"]
            except (ValueError, KeyError, TypeError) as e:
                tally.bad.append(f"200 with a body that is not an answer: {e!r}")
        tally.latencies.append(time.monotonic() - sent)

    try:
        await asyncio.wait_for(read(), hang_up if hang_up is not None else bound)
    except TimeoutError:
        if hang_up is None:
            tally.failed += 1
            tally.failures.append(f"no end after {bound:g} s: {path} {body}")
            return
        tally.hung_up += 1
    except httpx.HTTPError as e:
        tally.failed += 1
        tally.failures.append(f"{type(e).__name__}: {e}")
        return
    if status is not None:
        tally.statuses[status] += 1


async def clients(url: str, model: str, count: int, seconds: float, bound: float) -> Tally:
    tally = Tally()
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:

        async def client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < end:
                await one_request(http, rng, model, tally, bound)

        await asyncio.gather(*(client(i) for i in range(count)))
    del tally.failures[20:], tally.bad[20:]
    return tally


# ---- the processes ---------------------------------------------------------------------------


def processes(serve_pid: int) -> dict[str, int]:
    """name -> pid: the serve process ("gateway") and its workers ("worker HOST:PORT")."""
    found = {"gateway": serve_pid}
    for pid in _children(serve_pid):
        argv = _cmdline(pid)
        if "worker" in argv and "--port" in argv:
            found[f"worker 127.0.0.1:{argv[argv.index('--port') + 1]}"] = pid
    return found


def worker_metrics_ports(serve_pid: int) -> dict[str, int]:
    """worker name (as in `processes`) -> its metrics port."""
    ports = {}
    for pid in _children(serve_pid):
        argv = _cmdline(pid)
        if "worker" in argv and "--metrics-port" in argv:
            name = f"worker 127.0.0.1:{argv[argv.index('--port') + 1]}"
            ports[name] = int(argv[argv.index("--metrics-port") + 1])
    return ports


def sample(serve_pid: int, at: float) -> Sample:
    rss, fds, pids = {}, {}, processes(serve_pid)
    for name, pid in pids.items():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            rss[name], fds[name] = kb * 1024, len(os.listdir(f"/proc/{pid}/fd"))
    return Sample(at, rss, fds, pids)


async def sampler(serve_pid: int, start: float, samples: list[Sample], stop: asyncio.Event):
    while not stop.is_set():
        samples.append(await asyncio.to_thread(sample, serve_pid, time.monotonic() - start))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except FileNotFoundError:
        return []


def gauges(url: str, serve_pid: int | None) -> dict[str, float]:
    """What must be 0 with no request open: in flight in the gateway and each worker, and each
    worker's running and waiting requests and KV-cache use."""
    found = {"gateway in flight": _sum(f"{url}/metrics", "meridian_requests_in_flight")}
    for name, port in (worker_metrics_ports(serve_pid) if serve_pid else {}).items():
        m = f"http://127.0.0.1:{port}/metrics"
        for what, metric in (
            ("in flight", "meridian_requests_in_flight"),
            ("running", "meridian_num_requests_running"),
            ("waiting", "meridian_num_requests_waiting"),
            ("KV use", "meridian_kv_cache_usage_perc"),
        ):
            found[f"{name} {what}"] = _sum(m, metric)
    return found


def _sum(url: str, name: str) -> float:
    text = httpx.get(url, timeout=5).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


# ---- figures and bounds ----------------------------------------------------------------------


def window_median(samples: list[Sample], what: str, name: str, start: float, end: float):
    values = [
        getattr(s, what)[name] for s in samples if start <= s.at <= end and name in getattr(s, what)
    ]
    return statistics.median(values) if values else None


def check(tally: Tally, samples: list[Sample], seconds: float, quiet: dict) -> tuple[list, list]:
    """The figures table's rows and the broken bounds."""
    warmup = max(15.0, 0.1 * seconds)
    window = max(10.0, 0.05 * seconds)
    rows, broken = [], []
    bad_statuses = {s: n for s, n in tally.statuses.items() if s not in (200, 429)}
    if bad_statuses or tally.bad:
        broken.append(f"answers other than 200/429: {bad_statuses}; first: {tally.bad[:3]}")
    if tally.failed:
        broken.append(f"{tally.failed} requests failed on the client side: {tally.failures[:3]}")
    names = sorted({name for s in samples for name in s.rss}, key=lambda n: (n != "gateway", n))
    for name in names:
        pids = {s.pids.get(name) for s in samples} - {None}
        if len(pids) > 1:
            broken.append(f"{name} restarted during the soak (pids {sorted(pids)})")
        row = [name]
        for what, unit in (("rss", 2**20), ("fds", 1)):
            before = window_median(samples, what, name, warmup, warmup + window)
            after = window_median(samples, what, name, seconds - window, seconds)
            if before is None or after is None:
                row += ["-", "-", "-"]
                continue
            growth = after / before - 1
            row += [f"{before / unit:.1f}", f"{after / unit:.1f}", f"{growth:+.1%}"]
            if growth >= GROWTH_BOUND:
                label = "RSS" if what == "rss" else "open file descriptors"
                broken.append(f"{name}: {label} grew {growth:+.1%} after the warm-up")
        rows.append(row)
    busy = {k: v for k, v in quiet.items() if v}
    if busy:
        broken.append(f"still in flight {SETTLE:g} s after the load: {busy}")
    return rows, broken


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(clients_count: int, tally: Tally, seconds: float, rows, broken, quiet) -> str:
    p50, p99 = percentile(tally.latencies, 0.5), percentile(tally.latencies, 0.99)
    lines = [
        f"soak: {seconds / 60:.1f} min, {clients_count} clients, warm-up "
        f"{max(15.0, 0.1 * seconds):.0f} s",
        f"  requests           {tally.sent:>8}  ({tally.sent / seconds:.1f}/s)",
    ]
    for status, n in sorted(tally.statuses.items()):
        lines.append(f"    {status}              {n:>8}")
    lines += [
        f"    hung up (client) {tally.hung_up:>8}",
        f"    client failures  {tally.failed:>8}",
        f"  tokens generated   {tally.tokens:>8}  ({tally.tokens / seconds:.1f}/s)",
        f"  latency of a 200   p50 {p50:.2f} s, p99 {p99:.2f} s",
        f"  {'process':<26}{'RSS MiB after warm-up':>22}{'at end':>9}{'growth':>9}"
        f"{'fds after warm-up':>19}{'at end':>8}{'growth':>9}",
    ]
    for name, *v in rows:
        lines.append(f"  {name:<26}{v[0]:>22}{v[1]:>9}{v[2]:>9}{v[3]:>19}{v[4]:>8}{v[5]:>9}")
    lines.append(f"  gauges after the load: {quiet}")
    lines.append("bounds: " + ("all kept" if not broken else "BROKEN"))
    lines += [f"  - {b}" for b in broken]
    return "\n".join(lines)


# ---- running it ------------------------------------------------------------------------------


@contextlib.contextmanager
def serve_process(args, log: Path):
    """`meridian serve` on free ports; stopped with Ctrl-C's signal (then killed) at the end."""
    port = free_port()
    argv = [sys.executable, "-P", "-m", "meridian.cli", "serve", "--port", str(port)]
    argv += ["--grpc-port", str(free_port()), "--workers", str(args.workers)]
    argv += ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(MAX_MODEL_LEN)]
    argv += ["--kv-cache-memory", "64MiB", "--model", args.model]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while "meridian serve: ready" not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"meridian serve did not start; its output:\n{log.read_text()}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def soak(url: str, serve_pid: int | None, args) -> tuple[str, bool]:
    seconds = args.minutes * 60
    count = args.clients or 2 * args.workers * args.max_num_seqs
    samples: list[Sample] = []
    stop = asyncio.Event()
    start = time.monotonic()
    watch = asyncio.create_task(sampler(serve_pid, start, samples, stop)) if serve_pid else None
    tally = await clients(url, args.model, count, seconds, args.request_bound)
    stop.set()
    if watch is not None:
        await watch
    elapsed = time.monotonic() - start
    deadline = time.monotonic() + SETTLE
    while any((quiet := await asyncio.to_thread(gauges, url, serve_pid)).values()):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    rows, broken = check(tally, samples, seconds, quiet)
    return report(count, tally, elapsed, rows, broken, quiet), not broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run (10)")
    parser.add_argument(
        "--workers", type=int, default=2, help="workers of the serve (started, or at --url) (2)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=8, help="sequences a worker runs at once (8)"
    )
    parser.add_argument("--clients", type=int, help="default: 2 x workers x max-num-seqs")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"({DEFAULT_MODEL})")
    parser.add_argument(
        "--request-bound", type=float, default=120.0, help="seconds any answer may take (120)"
    )
    parser.add_argument("--url", help="soak a running serve's gateway instead of starting one")
    parser.add_argument("--pid", type=int, help="with --url: its serve process, to watch")
    args = parser.parse_args(argv)
    if args.pid and not args.url:
        parser.error("--pid goes with --url")
    if args.url:
        text, ok = asyncio.run(soak(args.url.rstrip("/"), args.pid, args))
    else:
        with tempfile.TemporaryDirectory(prefix="meridian-soak-") as tmp:
            log = Path(tmp) / "serve.log"
            with serve_process(args, log) as (url, pid):
                text, ok = asyncio.run(soak(url, pid, args))
            if not ok:
                text += "\n--- meridian serve output (last 30 lines) ---\n"
                text += "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
