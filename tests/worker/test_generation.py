"""Greedy generation equals Hugging Face `transformers` token for token (fp32, the bundled model)."""

import pytest

from meridian.worker.engine.llm_engine import EngineSettings, LLMEngine
from meridian.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PLAIN = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans",
    "A recipe for pancakes:\n1.",
    "The quick brown fox",
    "import numpy as np\nx = np.",
    "Photosynthesis is the process by which",
    "Les chats sont",
    "List of planets in the solar system: Mercury,",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain recursion to a child.",
    "What is 17 times 23?",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Write a Python function that reverses a string.",
    "What causes rain?",
    "Name a famous painting by Leonardo da Vinci.",
    "Summarize the plot of Cinderella in one sentence.",
    "Is a tomato a fruit or a vegetable?",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLMEngine(EngineSettings(), checkpoint)


def test_answers_paris(engine):
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.text


def test_24_prompts_plain_and_chat_match_transformers(engine, hf_greedy):
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PLAIN]
    prompts += [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in CHAT]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    mismatched = []
    for ids, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(ids, NEW_TOKENS)
        if out.token_ids != ref:
            mismatched.append((tok.decode(ids), out.token_ids, ref))
    assert mismatched == []


def test_bfloat16_runs_and_stays_close(checkpoint):
    engine = LLMEngine(EngineSettings(dtype="bfloat16"), checkpoint)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out.text
