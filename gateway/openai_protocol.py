"""The OpenAI API's request and response shapes, and their translation to and from meridian.v1.

Requests are validated strictly (wrong types and unknown fields are 400s, as OpenAI answers them):
a field this server cannot honour is refused rather than ignored. Extensions follow vLLM's names:
`top_k`, `ignore_eos`, `priority`.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meridian.api.v1 import pb
from meridian.gateway.streams import FINISH_REASONS
from meridian.worker.sampling_params import MAX_LOGPROBS, MAX_STOP, MAX_STOP_CHARS, MAX_TEMPERATURE

MAX_SEED = 2**63 - 1
UINT32 = 2**32  # the wire's bound for token counts and ids
TokenId = Annotated[int, Field(ge=0, lt=UINT32)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Sampling(_Strict):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, lt=UINT32)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=UINT32)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    ignore_eos: bool = False
    priority: int = Field(0, ge=-(2**31), lt=2**31)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop takes up to {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters"
            )
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported; send separate requests for more choices")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("presence and frequency penalties are not supported; leave them at 0")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None, logprobs: int | None):
        p = pb.SamplingParams(top_k=self.top_k or 0, ignore_eos=self.ignore_eos)
        for name, value in (
            ("max_tokens", max_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("seed", self.seed),
            ("logprobs", logprobs),
        ):
            if value is not None:
                setattr(p, name, value)
        p.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop or [])
        return p


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=UINT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def to_pb(self, request_id: str):
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        messages = [
            pb.ChatMessage(role=_role(m.role), content=m.text(), name=m.name or "")
            for m in self.messages
        ]
        return pb.GenerateRequest(
            model=self.model,
            chat=pb.Chat(messages=messages),
            sampling=self.sampling(max_tokens, logprobs),
            request_id=request_id,
            priority=self.priority,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError(
                    "send one prompt per request (batches of prompts are not supported)"
                )
            return v[0]
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def to_pb(self, request_id: str):
        request = pb.GenerateRequest(
            model=self.model,
            sampling=self.sampling(self.max_tokens, self.logprobs),
            request_id=request_id,
            priority=self.priority,
        )
        if isinstance(self.prompt, str):
            request.text = self.prompt
        else:
            request.token_ids.ids.extend(self.prompt)
        return request


def _role(role: str) -> str:
    # OpenAI's newer name for the system prompt; chat templates know only "system".
    return "system" if role == "developer" else role


# ---- responses -----------------------------------------------------------------------------------


def usage(u) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def finish_reason(reason: int) -> str | None:
    return FINISH_REASONS.get(reason)


def chat_logprobs(entries) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **one(e.token, e.logprob),
                "top_logprobs": [one(t.token, t.logprob) for t in e.top],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries, text_offset: int) -> dict:
    """The legacy completions shape; `text_offset` is where the first token starts in the text."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


class ChatFormat:
    """Chat completion bodies and stream chunks for one request."""

    def __init__(self, request_id: str, created: int, model: str, logprobs: bool):
        self.base = {"id": request_id, "created": created, "model": model}
        self.logprobs = logprobs

    def response(self, text: str, logprobs, u, reason: int) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(logprobs) if self.logprobs else None,
            "finish_reason": finish_reason(reason),
        }
        return {**self.base, "object": "chat.completion", "choices": [choice], "usage": usage(u)}

    def first_chunk(self) -> dict:
        return self.chunk({"role": "assistant", "content": ""}, None, None)

    def delta_chunk(self, r) -> dict:
        lp = chat_logprobs(r.logprobs) if self.logprobs else None
        return self.chunk({"content": r.text} if r.text else {}, lp, finish_reason(r.finish_reason))

    def chunk(self, delta: dict, logprobs, reason: str | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {**self.base, "object": "chat.completion.chunk", "choices": [choice]}

    def usage_chunk(self, u) -> dict:
        return {**self.base, "object": "chat.completion.chunk", "choices": [], "usage": usage(u)}


class CompletionFormat:
    """Text completion bodies and stream chunks for one request."""

    def __init__(self, request_id: str, created: int, model: str, logprobs: bool):
        self.base = {"id": request_id, "created": created, "model": model}
        self.logprobs = logprobs
        self.offset = 0  # characters streamed so far, for the logprobs' text_offset

    def response(self, text: str, logprobs, u, reason: int) -> dict:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": completion_logprobs(logprobs, 0) if self.logprobs else None,
            "finish_reason": finish_reason(reason),
        }
        return {**self.base, "object": "text_completion", "choices": [choice], "usage": usage(u)}

    def first_chunk(self) -> None:
        return None  # completions streams start with the first text

    def delta_chunk(self, r) -> dict:
        lp = completion_logprobs(r.logprobs, self.offset) if self.logprobs else None
        self.offset += len(r.text)
        choice = {
            "index": 0,
            "text": r.text,
            "logprobs": lp,
            "finish_reason": finish_reason(r.finish_reason),
        }
        return {**self.base, "object": "text_completion", "choices": [choice]}

    def usage_chunk(self, u) -> dict:
        return {**self.base, "object": "text_completion", "choices": [], "usage": usage(u)}
