"""A real worker (InferenceService, AsyncEngine, the worker's gRPC server) on 127.0.0.1, its event
loop in a thread of its own, so that tests call it with plain blocking stubs."""

import asyncio
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meridian.api.v1 import pb, pb_grpc
from meridian.metrics import RequestMetrics, new_registry
from meridian.worker.engine.async_engine import AsyncEngine
from meridian.worker.engine.llm_engine import EngineSettings, LLMEngine
from meridian.worker.metrics import COMPONENT, queue_time_histogram
from meridian.worker.server import grpc_server
from meridian.worker.service import InferenceService

MODEL = "smollm"


def small_engine(checkpoint, max_model_len: int = 64, blocks: int = 32, **settings) -> LLMEngine:
    kv = float(blocks * 16 * checkpoint.config.kv_bytes_per_token(4))
    return LLMEngine(
        EngineSettings(max_model_len=max_model_len, kv_cache_memory=kv, **settings), checkpoint
    )


class InProcessWorker:
    def __init__(self, engine: LLMEngine):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.registry = new_registry()
        self.service, self.health, port = self.run(self._start(engine))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def _start(self, engine: LLMEngine):
        service = InferenceService(
            MODEL, RequestMetrics(self.registry, COMPONENT), queue_time_histogram(self.registry)
        )
        service.engine = AsyncEngine(engine)
        service.set_state(pb.SERVING_STATE_SERVING)
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self.server = grpc_server(service, health_servicer)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return service, health_servicer, port

    def run(self, coro, timeout: float = 30.0):
        """Run a coroutine on the worker's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def engine(self) -> AsyncEngine:
        return self.service.engine

    def in_flight(self) -> float:
        labels = {"model": MODEL, "component": COMPONENT}
        return self.registry.get_sample_value("meridian_requests_in_flight", labels)

    def health_status(self) -> int:
        return self.health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no call is in flight and the engine holds no request and no KV block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            idle = not self.service.live and not self.engine.engine.has_unfinished()
            if idle and self.in_flight() == 0 and self.engine.stats().kv_blocks_used == 0:
                return
            time.sleep(0.02)
        raise AssertionError(
            f"worker not idle: live={self.service.live}, in flight={self.in_flight()}, "
            f"engine stats={self.engine.stats()}"
        )

    def close(self) -> None:
        self.channel.close()
        self.run(self.server.stop(0))
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
