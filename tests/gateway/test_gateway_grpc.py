"""The gateway's meridian.v1 gRPC front end, health and reflection, in front of scripted workers."""

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from scripted_workers import MODEL, ScriptedWorker, running_gateway

from meridian.api.v1 import pb, pb_grpc


def channel(gateway):
    return grpc.aio.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}")


def test_generate_is_proxied_and_the_request_keeps_its_id(run):
    async def main():
        worker = ScriptedWorker(tokens=2)
        async with running_gateway([worker]) as gw, channel(gw) as ch:
            stub = pb_grpc.InferenceStub(ch)
            request = pb.GenerateRequest(text="hi", request_id="abc")  # empty model: the only one
            responses = [r async for r in stub.Generate(request)]
            assert [r.text for r in responses] == ["w0 ", "w1 "]
            assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert worker.calls[0].request_id == "abc" and worker.calls[0].model == MODEL

    run(main())


@pytest.mark.parametrize(
    ("workers", "model", "code", "tag"),
    [
        (
            [ScriptedWorker()],
            "gpt-4",
            grpc.StatusCode.NOT_FOUND,
            ("meridian-error-code", "model_not_found"),
        ),
        (
            [ScriptedWorker(running=8)],
            MODEL,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ("retry-after", "2"),
        ),
        (
            [ScriptedWorker(mode="too_long")],
            MODEL,
            grpc.StatusCode.INVALID_ARGUMENT,
            ("meridian-error-code", "context_length_exceeded"),
        ),
    ],
)
def test_errors_carry_status_and_trailers(run, workers, model, code, tag):
    async def main():
        async with running_gateway(workers, max_queue_per_worker=0) as gw, channel(gw) as ch:
            stub = pb_grpc.InferenceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(pb.GenerateRequest(model=model, text="hi")):
                    pass
            assert e.value.code() == code
            assert tag in tuple(e.value.trailing_metadata())

    run(main())


def test_load_report_sums_the_region(run):
    async def main():
        a, b = ScriptedWorker(running=2, max_num_seqs=8), ScriptedWorker(running=3, max_num_seqs=4)
        async with running_gateway([a, b]) as gw, channel(gw) as ch:
            stream = pb_grpc.InferenceStub(ch).LoadReport(
                pb.LoadReportRequest(interval_seconds=0.05, include_prefix_cache=True)
            )
            load = await stream.read()
            stream.cancel()
            assert load.state == pb.SERVING_STATE_SERVING and load.serving_replicas == 2
            assert (load.running, load.max_num_seqs, load.kv_blocks_total) == (5, 12, 128)
            assert len(load.prefix_cache.block_hashes) == 2  # one per worker

    run(main())


def test_health_reflection_and_models(run):
    async def main():
        async with running_gateway([ScriptedWorker()]) as gw, channel(gw) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "meridian.v1.Inference"):
                status = (await health.Check(health_pb2.HealthCheckRequest(service=service))).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
            call = reflection.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            services = {s.name for s in (await call.read()).list_services_response.service}
            await call.done_writing()
            assert {"meridian.v1.Inference", "grpc.health.v1.Health"} <= services
            models = await pb_grpc.InferenceStub(ch).Models(pb.ModelsRequest())
            assert [m.id for m in models.models] == [MODEL]

    run(main())


@pytest.mark.parametrize("whose", ["client", "gateway"])
def test_a_deadline_reaches_the_worker(run, whose):
    # The client's gRPC deadline, or the gateway's own --request-timeout, ends the worker's call.
    async def main():
        worker = ScriptedWorker(mode="hang")
        timeout = {"request_timeout": 0.5} if whose == "gateway" else {}
        async with running_gateway([worker], **timeout) as gw, channel(gw) as ch:
            stub = pb_grpc.InferenceStub(ch)
            call = stub.Generate(
                pb.GenerateRequest(text="hi"), timeout=0.5 if whose == "client" else None
            )
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(40):
                if worker.cancelled_at is not None:
                    break
                await asyncio.sleep(0.05)
            assert worker.cancelled_at is not None and worker.cancelled_at - start < 1.5

    run(main())
