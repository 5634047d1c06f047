"""The engine behind an asyncio server: a background thread steps while work exists and sleeps
(without spinning) when there is none; each request is an async iterator of output deltas.

The queue is bounded: a request that would wait behind more than `max_waiting` others (beyond what
the running batch has room for) is refused. The thread records when its current step started
(`step_started`), so that a watchdog can tell a stalled engine from an idle one.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from meridian.worker.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from meridian.worker.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served by this process any more."""


class EngineOverloadedError(RuntimeError):
    """The engine's queue is full; the request may be retried later or elsewhere."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request alone; it has ended, and the others go on."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._prefix_hashes = tuple(engine.block_manager.cached_block_hashes())
        self._prefix_hashes_at = time.monotonic()
        self._stopping = False
        self._adds_in_flight = 0  # "add" commands sent and not yet applied
        self._adds_lock = threading.Lock()
        self.error: BaseException | None = None
        self.step_started: float | None = None  # time.monotonic(); None while idle
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """A snapshot taken after the latest step (safe from any thread)."""
        return self._stats

    def prefix_cache_hashes(self) -> tuple[int, ...]:
        """Hashes of the blocks the prefix cache holds, as of a recent step (safe from any thread)."""
        return self._prefix_hashes

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its deltas until it finishes. Bad input raises UserError and
        a full queue EngineOverloadedError, before anything is queued. A failure of the engine on
        this request alone raises RequestFailedError; of the whole engine, EngineDeadError. Leaving
        the iterator early, or `deadline` (time.monotonic()) passing, aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        seq = self.engine.make_sequence(request_id, prompt, params, priority, deadline)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.backlog() >= self.engine.settings.max_waiting:
            raise EngineOverloadedError(
                f"this worker's queue is full ({self.engine.settings.max_waiting} requests wait "
                "beyond its running batch); retry shortly"
            )
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        with self._adds_lock:
            self._adds_in_flight += 1
        self._send(("add", seq))
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"engine failed: {out}") from out
                finished = out.finished
                if out.finish_reason == "error":
                    raise RequestFailedError(out.error)
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def backlog(self) -> int:
        """Requests that must wait for a running one to finish: those queued in the engine or on
        their way to it, less the running batch's free room (safe from any thread)."""
        scheduler = self.engine.scheduler  # len() of its lists is safe from any thread
        room = max(0, self.engine.settings.max_num_seqs - len(scheduler.running))
        return len(scheduler.waiting) + self._adds_in_flight - room

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a finish_reason "abort" output."""
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if not self.engine.has_unfinished() and self._commands.empty():
                    self._wake.wait()
                    self._wake.clear()
                self.step_started = time.monotonic()
                self._apply_commands()
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                self._stats = self.engine.stats()
                self._publish_prefix_hashes()
                self.step_started = None
        except BaseException as e:
            log.exception("engine loop failed")
            self.error = e
            for request_id in list(self._streams):
                self._deliver(request_id, e)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if arg.request_id in self._streams:  # not cancelled while queued
                    self.engine.add_request(arg.request_id, arg)
                with self._adds_lock:  # after adding: counted twice for a moment, never missed
                    self._adds_in_flight -= 1
            else:
                out = self.engine.abort(arg)
                if out is not None:  # a caller still reading gets the end of its stream
                    self._deliver(arg, out)

    def _publish_prefix_hashes(self) -> None:
        # Copying costs O(cached blocks); load reports need it a few times a second, not every step.
        now = time.monotonic()
        if now - self._prefix_hashes_at >= 0.1 or not self.engine.has_unfinished():
            self._prefix_hashes = tuple(self.engine.block_manager.cached_block_hashes())
            self._prefix_hashes_at = now

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
