"""Tokenization and chat templates agree exactly with Hugging Face `transformers` (the oracle)."""

import random

import pytest

from meridian.errors import UserError

HAND_WRITTEN = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nand\r carriage returns",
    "\n\n\n\n",
    "multiple     spaces      between",
    "naïve café résumé façade",
    "日本語のテキストと中文文本",
    "Здравствуй, мир! Γειά σου κόσμε",
    "emoji 🚀🎉👩‍👩‍👧‍👦 and flags 🇫🇷",
    "مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT * FROM users WHERE id = 42;",
    '<html><body class="x">text</body></html>',
    "1234567890 3.14159 -2e10 0x1F",
    "I'm you're they'll we've she'd it's",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text after special",
    "<repo_name>meridian<file_sep>main.py",
    "<|im_start|><|im_start|>",
    "not special: <|im_start and im_end|>",
    "UPPER lower MiXeD",
    "a" * 300,
    "ab " * 100,
    "\u200b zero width \u00a0 nbsp",
    "math: ∑ ∫ √ ∞ ≤ ≥ ≠ ±",
    "https://example.com/path?q=1&r=two#frag",
    "user@example.com",
]

PIECES = [
    "the",
    " quick",
    " brown",
    "fox",
    "  ",
    "\n",
    "\t",
    "123",
    "9",
    "é",
    "ß",
    "中",
    "😀",
    "<|im_end|>",
    "'s",
    "'LL",
    "(",
    ")",
    "{}",
    "::",
    "->",
    "=>",
    "    ",
    "\r\n",
    "Ω",
    "x_y",
    "__init__",
    "!",
    "?",
]


def corpus() -> list[str]:
    rng = random.Random(1234)
    generated = ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))) for _ in range(200)]
    return HAND_WRITTEN + generated


def test_at_least_200_strings_tokenize_exactly_like_transformers(tokenizer, hf_tokenizer):
    strings = corpus()
    assert len(strings) >= 200
    mismatches = [s for s in strings if tokenizer.encode(s) != hf_tokenizer(s).input_ids]
    assert mismatches == []


def test_decode_round_trips(tokenizer):
    for s in corpus():
        if "<|" in s or "<repo_name>" in s:
            continue  # special tokens are dropped from decoded text
        assert tokenizer.decode(tokenizer.encode(s)) == s


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.eos_token_ids == [2]


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(
    tokenizer, hf_tokenizer, messages, add_generation_prompt
):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == ref


def test_malformed_messages_are_a_user_error(tokenizer):
    with pytest.raises(UserError, match="role"):
        tokenizer.apply_chat_template([{"content": "no role"}])


def test_the_tokenizer_a_gateway_gets_over_grpc_gives_the_same_prompt_ids(tokenizer):
    from meridian.api.v1 import pb
    from meridian.worker.tokenizer import Tokenizer, prompt_token_ids

    wire = pb.TokenizerResponse.FromString(tokenizer.to_pb("m").SerializeToString())
    remote = Tokenizer.from_pb(wire)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is 2+2? <|im_end|>")])
    for request in (pb.GenerateRequest(text=s) for s in corpus()[:50] if s):
        assert prompt_token_ids(remote, request) == prompt_token_ids(tokenizer, request)
    request = pb.GenerateRequest(chat=chat)
    assert prompt_token_ids(remote, request) == prompt_token_ids(tokenizer, request)
