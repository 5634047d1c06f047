"""A fault confined to one request fails that request only; a broken engine stops; deadlines end
requests nobody waits for (the bundled model, a small KV pool, faults injected around the runner)."""

import asyncio
import time

import pytest

from meridian.worker import model_runner
from meridian.worker.detokenizer import IncrementalDetokenizer
from meridian.worker.engine import llm_engine
from meridian.worker.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
)
from meridian.worker.engine.llm_engine import EngineBrokenError, EngineSettings, LLMEngine
from meridian.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]


class FaultyRunner:
    """The real model runner, except that a step holding one of the `bad` requests raises."""

    def __init__(self, runner, bad: set[str], error: BaseException | None = None):
        self.runner, self.bad = runner, bad
        self.error = error or RuntimeError("injected fault")

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, batch):
        ids = {s.request_id for s in batch.decodes} | {s.request_id for s, _ in batch.prefills}
        if ids & self.bad or "*" in self.bad:
            raise self.error
        return self.runner.execute(batch)


def small_engine(checkpoint) -> LLMEngine:
    blocks = 64  # 1,024 tokens of KV
    kv = float(blocks * 16 * checkpoint.config.kv_bytes_per_token(4))
    return LLMEngine(EngineSettings(max_model_len=256, kv_cache_memory=kv), checkpoint)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return small_engine(checkpoint)


@pytest.fixture
def broken(checkpoint):
    """An engine of its own whose every step fails, as a broken device would."""
    engine = small_engine(checkpoint)
    engine.runner = FaultyRunner(engine.runner, {"*"})
    return engine


@pytest.fixture
def clean(engine):
    """Each test leaves the engine as it found it: no request, every KV block free."""
    yield engine
    assert not engine.has_unfinished()
    assert engine.stats().kv_blocks_used == 0


def run_all(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outs) -> list[int]:
    return [t for out in outs for t in out.token_ids]


def test_a_request_that_breaks_its_step_fails_alone_and_the_others_are_unchanged(
    clean, monkeypatch
):
    engine = clean
    expected = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    monkeypatch.setattr(engine, "runner", FaultyRunner(engine.runner, {"bad"}))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ok-{i}", prompt, GREEDY)
    outputs = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)

    step()
    step()  # the good ones are decoding when the bad one arrives
    engine.add_request("bad", "Tell me a story about a dragon.", GREEDY)
    step()
    (bad,) = outputs["bad"]
    assert (bad.finish_reason, bad.error, bad.token_ids) == (
        "error",
        "RuntimeError: injected fault",
        [],
    )
    # The failed try advanced nothing; the retry advanced each good sequence by its one token.
    assert [s.request_id for s in engine.scheduler.running] == ["ok-0", "ok-1", "ok-2"]
    assert all(s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running)
    held = {b for s in engine.scheduler.running for b in s.block_table}
    assert engine.stats().kv_blocks_used == len(held)  # the bad one's blocks are free again
    while engine.has_unfinished():
        step()
    assert [tokens(outputs[f"ok-{i}"]) for i in range(3)] == expected


def test_a_retried_step_draws_the_same_sampling_noise(clean, monkeypatch):
    engine = clean
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    (expected,) = engine.generate(["Tell me about cats."], seeded)
    real_sample = model_runner.sample

    def sample(logits, params, generators):  # fails after every row has drawn its noise
        result = real_sample(logits, params, generators)
        if any("<fail>" in p.stop for p in params):
            raise RuntimeError("sampler fault")
        return result

    monkeypatch.setattr(model_runner, "sample", sample)
    failing = SamplingParams(max_tokens=6, stop=("<fail>",))
    seeded_out, failed = engine.generate(["Tell me about cats.", "Hi"], [seeded, failing])
    assert failed.finish_reason == "error"
    assert seeded_out.token_ids == expected.token_ids


def test_a_request_whose_detokenizing_fails_fails_alone(clean, monkeypatch):
    class Broken(IncrementalDetokenizer):
        def push(self, token_id: int) -> None:
            if "<fail>" in self.stop:
                raise UnicodeError("cannot decode")
            super().push(token_id)

    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", Broken)
    engine = clean
    good, bad = engine.generate(
        PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=6, stop=("<fail>",))]
    )
    assert (good.finish_reason, len(good.token_ids)) == ("length", 6)
    assert (bad.finish_reason, bad.error) == ("error", "UnicodeError: cannot decode")


def test_a_step_that_fails_for_every_sequence_is_a_broken_engine(broken):
    for i, prompt in enumerate(PROMPTS):
        broken.add_request(f"r{i}", prompt, GREEDY)
    with pytest.raises(EngineBrokenError, match="injected fault"):
        broken.step()


def test_single_requests_failing_step_after_step_is_a_broken_engine(broken):
    for i in range(llm_engine.MAX_FAILING_STEPS - 1):
        broken.add_request(f"r{i}", PROMPTS[0], GREEDY)
        (out,) = broken.step()
        assert out.finish_reason == "error"  # alone in its step, it may be the request's fault
        assert broken.stats().kv_blocks_used == 0
    broken.add_request("last", PROMPTS[0], GREEDY)
    with pytest.raises(EngineBrokenError):
        broken.step()


def test_memory_error_is_never_blamed_on_a_request(broken):
    broken.runner.error = MemoryError()
    broken.add_request("r", PROMPTS[0], GREEDY)
    with pytest.raises(MemoryError):
        broken.step()


def test_a_deadline_already_past_ends_the_request_before_it_runs(clean):
    engine = clean
    steps = engine.stats().steps
    engine.add_request("late", PROMPTS[0], GREEDY, deadline=time.monotonic() - 1)
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason, out.completion_tokens) == ("late", "abort", 0)
    assert engine.stats().steps == steps  # no model step ran for it


def test_a_deadline_passing_mid_generation_stops_the_work_and_frees_the_blocks(clean):
    engine = clean
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("slow", PROMPTS[1], long, deadline=time.monotonic() + 0.5)
    start = time.monotonic()
    outs = run_all(engine)["slow"]
    assert outs[-1].finish_reason == "abort"
    assert 0 < outs[-1].completion_tokens < 200
    assert time.monotonic() - start < 0.5 + 1.0  # within a step or so of the deadline


def test_async_engine_fails_the_culprit_and_serves_the_others(engine, monkeypatch):
    monkeypatch.setattr(engine, "runner", FaultyRunner(engine.runner, {"bad"}))

    async def main():
        async_engine = AsyncEngine(engine)
        try:

            async def collect(request_id: str) -> list[int]:
                ids = engine.tokenizer.encode(PROMPTS[0])
                return [
                    t
                    async for out in async_engine.generate(request_id, ids, GREEDY)
                    for t in out.token_ids
                ]

            return await asyncio.gather(collect("good"), collect("bad"), return_exceptions=True)
        finally:
            async_engine.shutdown()

    good, bad = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(good) == GREEDY.max_tokens
    assert isinstance(bad, RequestFailedError) and "injected fault" in str(bad)
    assert not engine.has_unfinished()


def test_async_engine_stops_for_good_when_the_engine_is_broken(broken):
    async def main():
        async_engine = AsyncEngine(broken)
        try:

            async def consume(request_id: str) -> None:
                async for _ in async_engine.generate(request_id, [1, 2, 3], GREEDY):
                    pass

            results = await asyncio.gather(
                consume("a"), consume("b"), consume("c"), return_exceptions=True
            )
            return results, async_engine.error
        finally:
            async_engine.shutdown()

    results, error = asyncio.run(asyncio.wait_for(main(), 60))
    assert isinstance(error, EngineBrokenError)  # what makes the worker report FAILED and exit 1
    assert all(isinstance(r, EngineDeadError) for r in results)
