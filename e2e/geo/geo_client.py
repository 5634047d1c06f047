"""A client of the gateway's OpenAI API that records where each answer came from and when.

httpx rather than the openai SDK: the tests need the response headers (x-meridian-*, Retry-After,
x-ratelimit-*) of streamed answers and the time the first content arrived.
"""

import json
import math
import time
from dataclasses import dataclass, field

import httpx
from serving_processes import MODEL

CLIENT_TIMEOUT = 90  # seconds: no request of the suite may hang longer


@dataclass
class Answer:
    status: int  # HTTP status; 0 when no response came (connection refused, timeout)
    sent: float  # monotonic seconds
    done: float
    headers: dict[str, str] = field(default_factory=dict)
    text: str = ""
    ttft: float | None = None  # streams: seconds from sending to the first chunk with content
    error: str | None = None  # the transport error, or the error event that cut a stream
    body: dict | None = None  # a non-streamed answer's JSON, or an error's

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def region(self) -> str | None:
        return self.headers.get("x-meridian-region")

    @property
    def route(self) -> str | None:
        return self.headers.get("x-meridian-route")

    @property
    def replica(self) -> str | None:
        return self.headers.get("x-meridian-replica")

    def __repr__(self) -> str:
        where = f"{self.region}/{self.route}/{self.replica}"
        error = self.error or (self.body or {}).get("error")
        return (
            f"<{self.status} {where} sent={self.sent:.2f} done={self.done:.2f} "
            f"ttft={self.ttft} error={error}>"
        )


async def chat(
    client: httpx.AsyncClient,
    url: str,
    content: str,
    *,
    stream: bool,
    max_tokens: int = 16,
    system: str | None = None,
    api_key: str | None = None,
    **fields,
) -> Answer:
    """One chat completion through the gateway at `url`; never raises for a failed request."""
    messages = [{"role": "system", "content": system}] if system else []
    body = {
        "model": MODEL,
        "messages": [*messages, {"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **fields,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sent = time.monotonic()
    answer = Answer(0, sent, sent)
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            answer.status, answer.headers = r.status_code, dict(r.headers)
            if r.status_code != 200 or not stream:
                answer.body = json.loads(await r.aread())
                if r.status_code == 200:
                    answer.text = answer.body["choices"][0]["message"]["content"]
            else:
                await _read_events(r, answer)
    except (httpx.TransportError, json.JSONDecodeError) as e:
        answer.error = f"{type(e).__name__}: {e}"
    answer.done = time.monotonic()
    return answer


async def _read_events(r: httpx.Response, answer: Answer) -> None:
    text, finished = [], False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            answer.error = f"error event: {event['error']}"
            return
        for choice in event.get("choices", []):
            piece = choice["delta"].get("content") or ""
            if piece and answer.ttft is None:
                answer.ttft = time.monotonic() - answer.sent
            text.append(piece)
            finished = finished or choice.get("finish_reason") is not None
    answer.text = "".join(text)
    if not finished:
        answer.error = "the stream ended without a finish reason"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in (0, 100]."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]
