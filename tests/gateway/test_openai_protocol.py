"""OpenAI request validation, translation to meridian.v1, and response shapes."""

import pytest
from pydantic import ValidationError

from meridian.api.v1 import pb
from meridian.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_request_maps_every_sampling_option():
    body = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 7,
            "stop": "END",
            "logprobs": True,
            "top_logprobs": 3,
            "ignore_eos": True,
            "priority": -1,
        }
    )
    r = body.to_pb("req-1")
    assert r.request_id == "req-1" and r.model == "m" and r.priority == -1
    assert [(m.role, m.content) for m in r.chat.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
    ]
    s = r.sampling
    assert s.max_tokens == 5  # max_completion_tokens wins over the older max_tokens
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.5, pytest.approx(0.9), 40, 7)
    assert list(s.stop) == ["END"] and s.logprobs == 3 and s.ignore_eos


def test_unset_options_stay_unset_so_the_worker_applies_its_defaults():
    s = ChatCompletionRequest.model_validate(CHAT).to_pb("r").sampling
    for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        assert not s.HasField(name), name
    assert (
        ChatCompletionRequest.model_validate({**CHAT, "logprobs": True})
        .to_pb("r")
        .sampling.logprobs
        == 0
    )


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": -1},
        {"max_tokens": 0},
        {"max_tokens": "5"},  # strict: no string-to-number coercion
        {"temperature": 3},
        {"top_p": 0},
        {"n": 2},
        {"presence_penalty": 0.5},
        {"stop": ["x", ""]},
        {"stop": ["s"] * 17},
        {"tools": []},  # unknown fields are refused, not ignored
        {"messages": []},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"top_logprobs": 2},  # without logprobs
        {"top_logprobs": 21, "logprobs": True},
        {"seed": -1},
        {"model": ""},
    ],
)
def test_invalid_chat_requests_are_refused(change):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, **change})


def test_completion_prompt_forms():
    def prompt(p):
        return CompletionRequest.model_validate({"model": "m", "prompt": p}).to_pb("r")

    assert prompt("hello").text == "hello"
    assert list(prompt([1, 2, 3]).token_ids.ids) == [1, 2, 3]
    assert prompt(["one"]).text == "one"
    assert list(prompt([[4, 5]]).token_ids.ids) == [4, 5]
    for bad in (["a", "b"], [[1], [2]], [-1], 5, None):
        with pytest.raises(ValidationError):
            prompt(bad)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 21})


def _response(text="", ids=(), reason=0, logprobs=(), usage=(3, 2, 1)):
    p, c, cached = usage
    return pb.GenerateResponse(
        text=text,
        token_ids=list(ids),
        finish_reason=reason,
        logprobs=list(logprobs),
        usage=pb.Usage(prompt_tokens=p, completion_tokens=c, cached_tokens=cached),
    )


LP = [
    pb.TokenLogprob(
        token_id=1, token="Hé", logprob=-0.5, top=[pb.TopLogprob(token="Hé", logprob=-0.5)]
    ),
    pb.TokenLogprob(
        token_id=2, token="!", logprob=-1.0, top=[pb.TopLogprob(token="?", logprob=-0.25)]
    ),
]


def test_chat_response_shape():
    fmt = ChatFormat("chatcmpl-1", 10, "m", logprobs=True)
    body = fmt.response(
        "Hé!", LP, pb.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1), 1
    )
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hé!"}
    assert choice["finish_reason"] == "stop"
    first = choice["logprobs"]["content"][0]
    assert first == {
        "token": "Hé",
        "logprob": -0.5,
        "bytes": [72, 195, 169],
        "top_logprobs": [{"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]}],
    }
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_chat_stream_chunks():
    fmt = ChatFormat("c", 10, "m", logprobs=False)
    assert fmt.first_chunk()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunk = fmt.delta_chunk(_response("Hi", [1]))
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0] == {
        "index": 0,
        "delta": {"content": "Hi"},
        "logprobs": None,
        "finish_reason": None,
    }
    last = fmt.delta_chunk(_response("", [2], reason=pb.FINISH_REASON_LENGTH))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert fmt.usage_chunk(pb.Usage(prompt_tokens=1))["choices"] == []


def test_completion_stream_logprob_offsets_continue_across_chunks():
    fmt = CompletionFormat("cmpl-1", 10, "m", logprobs=True)
    a = fmt.delta_chunk(_response("Hé", [1], logprobs=LP[:1]))
    b = fmt.delta_chunk(_response("!", [2], reason=pb.FINISH_REASON_STOP, logprobs=LP[1:]))
    assert a["choices"][0]["logprobs"]["text_offset"] == [0]
    assert b["choices"][0]["logprobs"] == {
        "tokens": ["!"],
        "token_logprobs": [-1.0],
        "top_logprobs": [{"?": -0.25}],
        "text_offset": [2],
    }
    assert b["choices"][0]["finish_reason"] == "stop" and b["object"] == "text_completion"
    assert fmt.first_chunk() is None


def test_validation_errors_name_the_field_as_sent():
    from meridian.gateway.openai_app import _describe

    def describe(body):
        try:
            ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            return _describe(e.errors())
        raise AssertionError("valid")

    assert describe({**CHAT, "stream": "yes"}) == (
        "stream: Input should be a valid boolean",
        "stream",
    )
    message, param = describe({**CHAT, "stop": 5})
    assert param == "stop" and message.startswith("stop: ")
    assert describe({**CHAT, "messages": [{"role": "user"}]})[1] == "messages.0.content"
    assert describe({**CHAT, "logit_bias": {}}) == (
        "logit_bias: unknown or unsupported parameter",
        "logit_bias",
    )
