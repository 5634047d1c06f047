"""The engine's outputs do not depend on how requests are batched, preempted, chunked or cached:
32 requests of mixed lengths, submitted together, give what each gives alone and what Hugging Face
`transformers` gives (greedy, fp32, the bundled model)."""

import random

import pytest

from meridian.worker.engine.llm_engine import EngineSettings, LLMEngine
from meridian.worker.sampling_params import SamplingParams

# The transformers reference for 32 requests alone is computed inside the first test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Books became cheaper, "
    "literacy spread, and ideas travelled faster than ever before. Scholars could compare the same "
    "text across cities, scientists shared results, and reformers printed pamphlets by the thousand. "
    "Within fifty years presses operated in more than two hundred European towns. "
)


def workload(tokenizer) -> list[tuple[list[int], int]]:
    """32 (prompt ids, max_tokens): prompts 5 to 500 tokens, several sharing leading text."""
    stream = tokenizer.encode(PASSAGE * 12)
    rng = random.Random(7)
    lengths = [5, 500, 17, 260, 64, 333, 9, 128, 480, 40, 200, 77, 12, 300, 150, 31]
    lengths += [rng.randint(5, 500) for _ in range(16)]
    requests = []
    for i, n in enumerate(lengths):
        start = 0 if i % 4 == 0 else rng.randint(0, len(stream) - n)  # every 4th shares a prefix
        requests.append((stream[start : start + n], rng.choice([4, 9, 16, 24, 40])))
    return requests


@pytest.fixture(scope="module")
def requests(tokenizer):
    return workload(tokenizer)


@pytest.fixture(scope="module")
def reference(requests, hf_greedy):
    """What transformers generates for each request on its own."""
    return [hf_greedy(ids, max_tokens) for ids, max_tokens in requests]


def run(checkpoint, requests, **settings):
    engine = LLMEngine(EngineSettings(**settings), checkpoint)
    outs = engine.generate(
        [ids for ids, _ in requests],
        [SamplingParams(temperature=0, max_tokens=m) for _, m in requests],
    )
    return [o.token_ids for o in outs], engine.stats()


def test_alone_equals_transformers(checkpoint, requests, reference):
    alone, stats = run(checkpoint, requests, max_num_seqs=1)
    assert stats.batch_seqs_total == stats.steps  # one sequence per step
    assert alone == reference


def test_batched_equals_transformers(checkpoint, requests, reference):
    batched, stats = run(checkpoint, requests)
    assert stats.batch_seqs_total / stats.steps > 4  # really batched
    assert stats.prefix_cache_hits > 0  # shared prefixes were reused
    assert batched == reference


def test_preemption_does_not_change_outputs(checkpoint, requests, reference):
    # about 1,200 tokens of KV: far less than the 32 requests need together
    budget = 80 * 16 * checkpoint.config.kv_bytes_per_token(4)
    outs, stats = run(checkpoint, requests, kv_cache_memory=float(budget))
    assert stats.kv_blocks_total == 80
    assert stats.preemptions > 0
    assert outs == reference


def test_prefix_caching_off_gives_same_outputs(checkpoint, requests, reference):
    outs, stats = run(checkpoint, requests, enable_prefix_caching=False)
    assert stats.prefix_cache_hits == 0
    assert outs == reference


def test_chunked_prefill_splits_do_not_change_outputs(checkpoint, requests, reference):
    outs, stats = run(checkpoint, requests, max_num_batched_tokens=48)
    assert stats.last_batch_tokens <= 48
    longest = max(len(ids) for ids, _ in requests)
    assert stats.steps > longest // 48  # the longest prompt alone needed many steps
    assert outs == reference
