"""Requests as the chaos tests send them (httpx, streaming or not) and what came back: status,
where it was answered (x-meridian-replica / -route), every SSE event, and when each part came.

Load requests are sampled (no temperature, no seed), so none is answered from the result cache,
and ignore the end-of-sequence token, so each runs for its whole `max_tokens`.
"""

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
from chaos_serve import MODEL

PROMPT = "Once upon a time, in a small village by the sea,"
CHAT = [{"role": "user", "content": "Tell me a story about the sea."}]
# Tokens each prompt leaves of the 64-token context (13 prompt tokens; 38 with the chat template).
ROOM = {False: 51, True: 26}


def request_body(chat: bool, stream: bool, max_tokens: int, logprobs: bool = False) -> dict:
    max_tokens = min(max_tokens, ROOM[chat])
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if chat:
        body["messages"] = CHAT
        if logprobs:
            body |= {"logprobs": True, "top_logprobs": 2}
    else:
        body["prompt"] = PROMPT
        if logprobs:
            body["logprobs"] = 2
    return body


def path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


@dataclass
class Answer:
    stream: bool
    sent: float  # monotonic seconds
    status: int = 0  # 0: no response came
    headers_at: float | None = None  # for a stream: its first token had reached the gateway
    ended: float | None = None
    replica: str | None = None
    route: str | None = None
    events: list = field(default_factory=list)  # a stream's data payloads: dicts, or "[DONE]"
    body: dict | None = None  # a whole answer's JSON
    failure: str | None = None  # what went wrong on the client's side (timeout, reset)

    @property
    def done(self) -> bool:
        """A stream that ended as it should: its last event is [DONE]."""
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def error_events(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]

    def ended_with_error(self) -> bool:
        """An error event, then [DONE], and nothing else after the error."""
        return (
            len(self.events) >= 2
            and self.done
            and isinstance(self.events[-2], dict)
            and "error" in self.events[-2]
            and len(self.error_events) == 1
        )

    def tokens(self) -> int:
        if self.body is not None:
            return self.body.get("usage", {}).get("completion_tokens", 0)
        return sum(1 for e in self.events if isinstance(e, dict) and e.get("choices"))

    def describe(self) -> str:
        took = f"{self.ended - self.sent:.1f} s" if self.ended else "never ended"
        what = "stream" if self.stream else "whole"
        tail = self.events[-2:] if self.stream else self.body
        return (
            f"{what} answer {self.status} from {self.replica} (route {self.route}) after {took}"
            f"{', ' + self.failure if self.failure else ''}: {str(tail)[:300]}"
        )


def mixed(rng: random.Random) -> dict:
    """Chat or completion, streamed or not, 16 to 51 tokens long."""
    chat = rng.random() < 0.5
    return request_body(chat, stream=rng.random() < 0.5, max_tokens=rng.randint(16, ROOM[chat]))


async def send(
    client: httpx.AsyncClient, body: dict, timeout: float, answers: list | None = None
) -> Answer:
    """Send one request and read all of its answer (giving up after `timeout` seconds). The
    answer is in `answers` from the start, filled in as it comes."""
    answer = Answer(stream=body.get("stream", False), sent=time.monotonic())
    if answers is not None:
        answers.append(answer)
    try:
        await asyncio.wait_for(_read(client, body, answer), timeout)
    except TimeoutError:
        answer.failure = f"no end after {timeout:g} s"
    except httpx.HTTPError as e:
        answer.failure = f"{type(e).__name__}: {e}"
    return answer


async def _read(client: httpx.AsyncClient, body: dict, answer: Answer) -> None:
    url = path("messages" in body)
    async with client.stream("POST", url, json=body) as response:
        answer.status = response.status_code
        answer.headers_at = time.monotonic()
        answer.replica = response.headers.get("x-meridian-replica")
        answer.route = response.headers.get("x-meridian-route")
        if answer.stream and response.status_code == 200:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    answer.events.append(data if data == "[DONE]" else json.loads(data))
        else:
            answer.body = json.loads(await response.aread())
    answer.ended = time.monotonic()


def client(url: str, connections: int = 200) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, timeout=None, limits=limits)


class Load:
    """`clients` loops, each sending its next request (from `bodies`) when its last one has ended,
    until stopped. Every answer, finished or not, is in `answers`."""

    def __init__(self, http: httpx.AsyncClient, clients: int, timeout: float, bodies=mixed):
        self.http, self.clients, self.timeout, self.bodies = http, clients, timeout, bodies
        self.answers: list[Answer] = []
        self._stopping = False
        self._tasks: list[asyncio.Task] = []

    def start(self) -> "Load":
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def stop(self) -> list[Answer]:
        """Let every client finish the request it is on; return all answers."""
        self._stopping = True
        await asyncio.gather(*self._tasks)
        return self.answers

    async def _client(self, i: int) -> None:
        rng = random.Random(i)
        while not self._stopping:
            await send(self.http, self.bodies(rng), self.timeout, self.answers)


async def until(check, timeout: float, what: str, interval: float = 0.1):
    """Poll `check()` (run in a thread: it may block on a scrape) until it returns something
    true; return that. Fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = await asyncio.to_thread(check)
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout:g} s")
        await asyncio.sleep(interval)
