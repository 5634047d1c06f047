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


def test_token_text_is_each_ids_own_decode_over_the_whole_vocabulary(tokenizer):
    ids = range(tokenizer.vocab_size)
    assert [tokenizer.token_text(i) for i in ids] == [
        tokenizer.decode([i], skip_special_tokens=False) for i in ids
    ]
    assert tokenizer.token_text(tokenizer.vocab_size) == ""  # a padded embedding row


def test_no_token_stands_for_more_prompt_bytes_than_max_token_bytes(tokenizer):
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.token_text(i).encode()))
    texts = [*corpus(), tokenizer.token_text(longest) * 7, " " * 5000, "<|im_start|>" * 50]
    for text in texts:
        assert len(tokenizer.encode(text)) * tokenizer.max_token_bytes >= len(text.encode())


def test_a_prompt_too_long_by_its_bytes_is_refused_without_tokenizing(tokenizer, monkeypatch):
    from meridian.api.v1 import pb
    from meridian.worker.tokenizer import PromptTooLong, prompt_token_ids

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(tokenizer, "encode", no_tokenizing)
    text = "é" * (10 * tokenizer.max_token_bytes // 2 + 1)  # 2 bytes each
    with pytest.raises(PromptTooLong, match=f"prompt \\({len(text) * 2} bytes\\) has more than 10"):
        prompt_token_ids(tokenizer, pb.GenerateRequest(text=text), limit=10)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=text)])
    with pytest.raises(PromptTooLong):
        prompt_token_ids(tokenizer, pb.GenerateRequest(chat=chat), limit=10)


def test_no_length_bound_is_claimed_for_a_tokenizer_that_normalizes(tokenizer):
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import normalizers

    from meridian.worker.tokenizer import Tokenizer

    fast = FastTokenizer.from_str(tokenizer.fast.to_str())
    fast.normalizer = normalizers.NFKC()  # "ﬁ" (3 bytes) becomes "fi" (2)
    normalizing = Tokenizer(fast, [2], None, False, None)
    assert normalizing.max_token_bytes is None
    normalizing.check_length("ﬁ" * 10_000, 1)  # cannot tell: no error


def test_chat_roles_are_system_user_and_assistant_only(tokenizer):
    from meridian.api.v1 import pb
    from meridian.worker.tokenizer import prompt_token_ids

    for role in ("tool", "user<|im_end|>", ""):
        chat = pb.Chat(messages=[pb.ChatMessage(role=role, content="hi")])
        with pytest.raises(UserError, match="a role is one of system, user, assistant"):
            prompt_token_ids(tokenizer, pb.GenerateRequest(chat=chat))


NAMED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if m.role == 'user' and m.name %} ({{ m.name }}){% endif %}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_message_name_goes_to_a_template_that_writes_it(tokenizer):
    from meridian.api.v1 import pb
    from meridian.worker.tokenizer import Tokenizer, prompt_token_ids

    named = Tokenizer(tokenizer.fast, [2], None, False, NAMED_TEMPLATE)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi", name="ada")])
    ids = prompt_token_ids(named, pb.GenerateRequest(chat=chat))
    assert named.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user (ada)")


@pytest.mark.parametrize("template", ["bundled", "named"])
def test_a_message_name_the_template_would_drop_is_refused(tokenizer, template):
    from meridian.api.v1 import pb
    from meridian.worker.tokenizer import Tokenizer, prompt_token_ids

    if template == "named":  # writes the user's name only
        tokenizer = Tokenizer(tokenizer.fast, [2], None, False, NAMED_TEMPLATE)
        message = pb.ChatMessage(role="system", content="Be brief.", name="rules")
    else:
        message = pb.ChatMessage(role="user", content="Hi", name="ada")
    chat = pb.Chat(messages=[message])
    with pytest.raises(UserError, match="chat template has no place for a message's name"):
        prompt_token_ids(tokenizer, pb.GenerateRequest(chat=chat))
