"""How a worker's Generate calls end, seen by a gRPC client: size limits, deadlines, a full queue,
failures of one request or of the worker's own code, a stalled engine (the bundled model, small)."""

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from in_process_worker import InProcessWorker, small_engine

from meridian.api.v1 import pb
from meridian.limits import MAX_REQUEST_BYTES
from meridian.worker import service as service_module
from meridian.worker.server import watch_engine

SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
)


def request(text: str = "The capital of France is", **sampling) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0)
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(**sampling))


def failure(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    return e.value


def trailers(error: grpc.RpcError) -> dict[str, str]:
    return dict(error.trailing_metadata() or ())


class FaultyRunner:
    """The real runner; a step fails once a `doomed` request has generated two tokens."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, batch):
        for seq in batch.decodes:
            if seq.request_id.startswith("doomed") and seq.num_output_tokens >= 2:
                raise RuntimeError("a kernel failed")
        return self.runner.execute(batch)


class BlockingRunner:
    """The real runner, held at the start of each step while `go` is clear."""

    def __init__(self, runner):
        self.runner, self.go = runner, threading.Event()
        self.go.set()

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, batch):
        self.go.wait()
        return self.runner.execute(batch)


@pytest.fixture(scope="module")
def worker(checkpoint):
    engine = small_engine(checkpoint)
    engine.runner = FaultyRunner(engine.runner)
    w = InProcessWorker(engine)
    yield w
    w.close()


@pytest.fixture
def idle(worker):
    """The worker, checked idle (no call, no engine request, no KV block held) after the test."""
    yield worker
    worker.wait_idle()


def test_a_request_as_large_as_a_gateway_takes_is_received_and_refused_by_its_length(idle):
    text = "a" * (MAX_REQUEST_BYTES - 1024)  # over gRPC's default 4 MiB
    error = failure(idle.stub.Generate(request(text), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailers(error)["meridian-error-code"] == "context_length_exceeded"
    assert f"({len(text)} bytes) has more than 63 tokens" in error.details()


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"temperature": float("nan")}, "temperature must be from 0 (greedy) to 2, got nan"),
        ({"temperature": 1e308}, "temperature must be from 0 (greedy) to 2"),
        ({"top_p": float("inf")}, "top_p must be in (0, 1], got inf"),
        ({"logprobs": 2**32 - 1}, "logprobs must be between 0 and 20"),
        ({"stop": ["x"] * 17}, "at most 16 stop strings"),
        ({"stop": ["x" * 257]}, "each stop string must have 1 to 256 characters"),
        ({"stop_token_ids": [2**32 - 1]}, "stop_token_ids must be in [0, 49152)"),
        ({"max_tokens": 2**32 - 1}, "exceeds the context window of 64 tokens"),
    ],
)
def test_out_of_range_sampling_is_invalid_argument(idle, sampling, message):
    error = failure(idle.stub.Generate(request(**sampling), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


def test_the_extremes_the_engine_takes_are_answered(idle):
    sampling = {"temperature": 1e-300, "top_k": 2**32 - 1, "seed": -(2**63), "max_tokens": 2}
    (*_, last) = idle.stub.Generate(request(**sampling), timeout=30)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH


def test_logprob_tokens_are_each_tokens_own_text(idle, tokenizer):
    responses = list(idle.stub.Generate(request(max_tokens=3, logprobs=2), timeout=30))
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert len(logprobs) == 3
    for lp in logprobs:
        assert lp.token == tokenizer.decode([lp.token_id], skip_special_tokens=False)
        assert [t.token for t in lp.top] == [
            tokenizer.decode([t.token_id], skip_special_tokens=False) for t in lp.top
        ]


def test_a_request_failing_in_the_engine_ends_internal_after_its_tokens(idle):
    r = request(max_tokens=20, ignore_eos=True)
    r.request_id = "doomed"
    call = idle.stub.Generate(r, timeout=30)
    received = []
    with pytest.raises(grpc.RpcError) as e:
        for response in call:
            received.append(response)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "the engine failed on this request: RuntimeError: a kernel failed" in e.value.details()
    assert sum(len(r.token_ids) for r in received) == 2
    (ok,) = [r for r in idle.stub.Generate(request(max_tokens=1), timeout=30)]  # engine lives on
    assert ok.finish_reason == pb.FINISH_REASON_LENGTH


def test_an_unexpected_error_ends_the_call_internal_and_its_accounting(idle, monkeypatch):
    def explode(*args):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(service_module, "prompt_token_ids", explode)
    error = failure(idle.stub.Generate(request(), timeout=30))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError: tokenizer exploded" in error.details()
    assert idle.in_flight() == 0


def test_a_name_the_chat_template_would_drop_is_refused(idle):
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi", name="ada")])
    error = failure(idle.stub.Generate(pb.GenerateRequest(chat=chat), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no place for a message's name" in error.details()


def test_the_engine_stops_at_the_deadline_even_while_the_event_loop_is_stuck(idle):
    call = idle.stub.Generate(request(ignore_eos=True), timeout=1.0)  # ~60 tokens: ~3 s
    next(call)  # generating
    idle.loop.call_soon_threadsafe(time.sleep, 2.0)  # no abort can come from the loop now
    time.sleep(1.5)
    assert not idle.engine.engine.has_unfinished()  # the engine thread ended it by itself
    assert failure(call).code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_full_queue_is_resource_exhausted_with_retry_after(checkpoint):
    engine = small_engine(checkpoint, max_num_seqs=1, max_waiting=2)
    runner = engine.runner = BlockingRunner(engine.runner)
    worker = InProcessWorker(engine)
    try:
        runner.go.clear()
        running = worker.stub.Generate(request(max_tokens=2), timeout=30)
        wait_for(lambda: worker.engine.step_started is not None)  # its step holds the engine
        # The engine thread cannot take these in: they wait in its command queue, and count.
        queued = [worker.stub.Generate(request(max_tokens=2), timeout=30) for _ in range(2)]
        wait_for(lambda: len(worker.service.live) == 3)
        error = failure(worker.stub.Generate(request(), timeout=30))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert trailers(error) == {"meridian-error-code": "overloaded", "retry-after": "1"}
        runner.go.set()
        assert [len(list(call)) for call in (running, *queued)] == [2, 2, 2]
        worker.wait_idle()
    finally:
        runner.go.set()
        worker.close()


def test_a_stalled_step_turns_health_not_serving_until_it_returns(checkpoint):
    engine = small_engine(checkpoint)
    runner = engine.runner = BlockingRunner(engine.runner)
    worker = InProcessWorker(engine)

    async def event():
        return asyncio.Event()

    stop = worker.run(event())
    watch = asyncio.run_coroutine_threadsafe(
        watch_engine(worker.service, worker.health, 0.3, stop), worker.loop
    )
    try:
        runner.go.clear()
        stuck = worker.stub.Generate(request(max_tokens=2), timeout=30)
        wait_for(lambda: worker.health_status() == NOT_SERVING)
        assert worker.service.state == pb.SERVING_STATE_STALLED
        refused = failure(worker.stub.Generate(request(), timeout=30))
        assert (refused.code(), refused.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "this worker is stalled (an engine step is overrunning)",
        )
        runner.go.set()
        wait_for(lambda: worker.health_status() == SERVING)
        assert worker.service.state == pb.SERVING_STATE_SERVING
        assert len(list(stuck)) == 2
    finally:
        runner.go.set()
        worker.loop.call_soon_threadsafe(stop.set)
        watch.result(10)
        worker.close()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
