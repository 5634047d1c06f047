"""Engine behaviour a caller sees: prefix reuse, abort, seeds, stop strings (bundled model)."""

import pytest

from meridian.errors import UserError
from meridian.worker.engine.llm_engine import EngineSettings, LLMEngine
from meridian.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LONG = "Here is a long shared system prompt that sets up the assistant's persona in detail. " * 12


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLMEngine(EngineSettings(), checkpoint)


def test_second_request_reuses_a_finished_requests_prefix(engine):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    (first,) = engine.generate([LONG + "Question one?"], greedy)
    before = engine.stats()
    (second,) = engine.generate([LONG + "A different question two?"], greedy)
    after = engine.stats()
    shared = len(engine.tokenizer.encode(LONG)) // 16 * 16
    assert first.cached_tokens == 0
    assert second.cached_tokens >= shared - 16
    prefilled = after.prompt_tokens_computed - before.prompt_tokens_computed
    assert prefilled == second.prompt_tokens - second.cached_tokens  # only the uncached tail ran
    assert after.prefix_cache_hits - before.prefix_cache_hits == second.cached_tokens


def test_abort_mid_generation_returns_every_block(engine):
    engine.add_request("long", LONG, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_blocks_used > 0
    assert engine.abort("long")
    assert engine.stats().kv_blocks_used == 0
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_same_seed_same_text_alone_or_batched(engine):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    (alone,) = engine.generate(["Tell me about cats."], p)
    others = SamplingParams(temperature=1.0, max_tokens=24)
    batched = engine.generate(["Hi", "Tell me about cats.", "Bye"], [others, p, others])
    assert batched[1].token_ids == alone.token_ids
    (different,) = engine.generate(
        ["Tell me about cats."], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24)
    )
    assert different.token_ids != alone.token_ids


def test_stop_string_ends_generation_and_is_cut_from_text(engine):
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    (out,) = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, stop=("Paris",))
    )
    assert out.finish_reason == "stop"
    assert out.text == "The capital of France is "


def test_length_finish_and_usage(engine):
    (out,) = engine.generate(
        ["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert out.finish_reason == "length" and out.completion_tokens == 5 == len(out.token_ids)
    assert out.prompt_tokens == len(engine.tokenizer.encode("Count: 1, 2, 3,"))


def test_logprobs_are_returned_per_token(engine):
    (out,) = engine.generate(
        ["The sky is"], SamplingParams(temperature=0, max_tokens=3, logprobs=2)
    )
    assert len(out.logprobs) == 3
    for token, logprob, top in out.logprobs:
        assert top[0][0] == token and logprob == pytest.approx(top[0][1])  # greedy: the top one


def test_prompt_longer_than_context_is_rejected(engine):
    with pytest.raises(UserError, match="context length"):
        engine.add_request("huge", list(range(10)) * 1000, SamplingParams(max_tokens=1))
    assert not engine.has_unfinished()
