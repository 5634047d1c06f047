"""meridian.v1 over gRPC: through the gateway with a plain stub, and straight to a worker (health,
reflection, and the load reports the gateway routes by)."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving_processes import MAX_MODEL_LEN, MODEL

from meridian.api.v1 import pb, pb_grpc
from meridian.worker.engine.block_manager import prefix_block_hashes

pytestmark = pytest.mark.timeout(420)

FRANCE = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])


def test_generate_through_the_gateway(gateway, tokenizer):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(
            model=MODEL, chat=FRANCE, sampling=pb.SamplingParams(max_tokens=24, temperature=0)
        )
        responses = list(stub.Generate(request, timeout=120))
        models = stub.Models(pb.ModelsRequest(), timeout=10).models
    assert "Paris" in "".join(r.text for r in responses)
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    messages = [{"role": "user", "content": FRANCE.messages[0].content}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    usage = responses[-1].usage
    assert usage.prompt_tokens == len(prompt)
    assert usage.completion_tokens == sum(len(r.token_ids) for r in responses)
    assert [(m.id, m.max_model_len) for m in models] == [(MODEL, MAX_MODEL_LEN)]


def test_worker_health_reflection_and_load_report(workers, tokenizer):
    worker = workers[0]
    text = "A prompt long enough to fill two blocks of the prefix cache, and then a few more words."
    ids = tokenizer.encode(text)
    with grpc.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "meridian.v1.Inference"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(reflection.ServerReflectionInfo(iter([request]), timeout=5))
        services = {s.name for s in reply.list_services_response.service}
        assert {"meridian.v1.Inference", "grpc.health.v1.Health"} <= services

        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(
            text=text, sampling=pb.SamplingParams(max_tokens=2, temperature=0)
        )
        assert list(stub.Generate(request, timeout=120))[-1].usage.prompt_tokens == len(ids)
        reports = stub.LoadReport(
            pb.LoadReportRequest(interval_seconds=0.1, include_prefix_cache=True), timeout=30
        )
        load = next(reports)
        reports.cancel()
    assert load.state == pb.SERVING_STATE_SERVING and load.serving_replicas == 1
    assert load.model == MODEL and load.max_num_seqs == 32 and load.block_size == 16
    assert 0 <= load.kv_blocks_used <= load.kv_blocks_total and load.kv_blocks_total > 0
    # The hashes a gateway would compute from the prompt's tokens are in the worker's cache.
    held = set(load.prefix_cache.block_hashes)
    assert set(prefix_block_hashes(ids, load.block_size)) <= held


def test_gateway_reports_the_region(gateway, workers):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        reports = pb_grpc.InferenceStub(channel).LoadReport(pb.LoadReportRequest(), timeout=30)
        load = next(reports)
        reports.cancel()
    assert load.state == pb.SERVING_STATE_SERVING
    assert load.serving_replicas == len(workers) and load.max_num_seqs == 32 * len(workers)
