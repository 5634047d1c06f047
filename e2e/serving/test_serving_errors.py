"""Bad requests get the right 4xx and OpenAI's error body; overload is 429 with Retry-After; no
worker is 503. The gateway and the workers stay healthy throughout."""

import asyncio
import json

import httpx
import openai
import pytest
from serving_processes import MAX_MODEL_LEN, MODEL, Gateway, free_port

pytestmark = pytest.mark.timeout(420)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TOO_LONG = "hello " * (MAX_MODEL_LEN + 10)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None, None),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": 1}]}, 400, "messages.0.role", None),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "ten"}, 400, "max_tokens", None),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream", None),
        ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400, "max_tokens", None),
        ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": TOO_LONG}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": TOO_LONG},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "Hi", "max_tokens": MAX_MODEL_LEN},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": [10**6]}, 400, None, None),  # not in vocab
    ],
)
def test_bad_request_gets_4xx_and_openai_error_body(
    gateway, workers, path, body, status, param, code
):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        gateway.url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert gateway.serving(len(workers)) and all(w.serving() for w in workers)


def test_the_sdk_raises_its_own_error_types(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=TOO_LONG, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    ok = client.chat.completions.create(**CHAT)  # and still serves
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_every_worker_saturated_is_429_with_retry_after(workers, log_dir):
    # A second gateway that lets no request wait behind a worker's 32 running ones.
    g = Gateway("gateway-strict", log_dir, [workers[0].address], ["--max-queue-per-worker", "0"])
    try:
        g.wait_until(lambda: g.serving(1), "routing", timeout=60)

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {**CHAT, "max_tokens": 8, "ignore_eos": True}
                return await asyncio.gather(
                    *(c.post(f"{g.url}/v1/chat/completions", json=body) for _ in range(40))
                )

        replies = asyncio.run(main())
        rejected = [r for r in replies if r.status_code == 429]
        assert rejected and len(rejected) <= 8, [r.status_code for r in replies]
        assert all(r.status_code == 200 for r in replies if r.status_code != 429)
        for r in rejected:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert g.stop() == 0


def test_no_worker_is_503(log_dir):
    g = Gateway("gateway-alone", log_dir, [f"127.0.0.1:{free_port()}"])
    try:
        g.wait_until(lambda: _answers(g.url), "listening", timeout=60)
        r = httpx.post(f"{g.url}/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        assert httpx.get(f"{g.url}/health").status_code == 503
    finally:
        assert g.stop() == 0


def _answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.TransportError:
        return False
    return True
