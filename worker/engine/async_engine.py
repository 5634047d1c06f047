"""The engine behind an asyncio server: a background thread steps while work exists and sleeps
(without spinning) when there is none; each request is an async iterator of output deltas."""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from meridian.worker.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from meridian.worker.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served by this process any more."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """A snapshot taken after the latest step (safe from any thread)."""
        return self._stats

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its deltas until it finishes. Bad input raises UserError
        before anything is queued. Leaving the iterator early aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        seq = self.engine.make_sequence(request_id, prompt, params, priority)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", seq))
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"engine failed: {out}") from out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
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
                self._apply_commands()
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                self._stats = self.engine.stats()
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
            else:
                self.engine.abort(arg)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
