"""The OpenAI SDK (sync and async, streaming and not, chat and completions) against a gateway in
front of two real workers running the bundled model."""

import asyncio

import pytest
from serving_processes import MODEL

pytestmark = pytest.mark.timeout(420)  # the first test also waits for the workers to load

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def chat_prompt_tokens(tokenizer, messages) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))


def test_chat_answer_mentions_paris_and_usage_is_exact(client, tokenizer):
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == chat_prompt_tokens(tokenizer, FRANCE)
    assert r.usage.completion_tokens == len(choice.logprobs.content)  # one entry per token
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content).startswith(choice.message.content)


def test_streamed_chat_equals_non_streamed_for_the_same_seed(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        max_tokens=12,
        temperature=0.9,
        seed=1234,
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    # The same prompt again: its leading blocks now come from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_async_completions_from_token_ids_stream_and_not(async_client, tokenizer):
    ids = tokenizer.encode("The three primary colours are")

    async def main():
        kwargs = dict(model=MODEL, prompt=ids, max_tokens=8, temperature=0.7, seed=7, logprobs=1)
        full = await async_client.completions.create(**kwargs)
        stream = await async_client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        await async_client.close()
        return full, chunks

    full, chunks = asyncio.run(main())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert full.usage.prompt_tokens == len(ids) == chunks[-1].usage.prompt_tokens
    assert full.usage.completion_tokens == len(full.choices[0].logprobs.tokens)
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 8


def test_async_streaming_chat_answers_paris(async_client):
    async def main():
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=FRANCE, max_tokens=24, temperature=0, stream=True
        )
        chunks = [c async for c in stream]
        await async_client.close()
        return chunks

    chunks = asyncio.run(main())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_and_max_tokens(client):
    stopped = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=24, temperature=0, stop=["Paris"]
    )
    assert "Paris" not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"
    cut = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_completion_tokens=3, temperature=0
    )
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
