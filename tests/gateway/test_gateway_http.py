"""The OpenAI HTTP front end of a real gateway, in front of scripted workers."""

import asyncio
import json
import time

import httpx
import pytest
from scripted_workers import MODEL, ScriptedWorker, running_gateway, url

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def sse_events(text: str) -> list:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize(
    ("body", "status", "param", "fragment"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[]", 400, None, "valid dictionary"),
        (
            json.dumps({**CHAT, "max_tokens": -5}).encode(),
            400,
            "max_tokens",
            "greater than or equal to 1",
        ),
        (json.dumps({**CHAT, "temperature": "hot"}).encode(), 400, "temperature", "valid number"),
        (json.dumps({**CHAT, "messages": "hi"}).encode(), 400, "messages", "valid list"),
        (json.dumps({**CHAT, "stop": "x" * 257}).encode(), 400, "stop", "1 to 256 characters"),
        (json.dumps({**CHAT, "functions": []}).encode(), 400, "functions", "unsupported parameter"),
        (json.dumps({**CHAT, "model": "gpt-4"}).encode(), 404, "model", "not served here"),
    ],
)
def test_bad_requests_get_openai_error_bodies(run, body, status, param, fragment):
    async def main():
        async with running_gateway([ScriptedWorker()]) as gw, httpx.AsyncClient() as client:
            r = await client.post(
                url(gw, "/v1/chat/completions"),
                content=body,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param and fragment in error["message"]
            assert error["type"] == (
                "not_found_error" if status == 404 else "invalid_request_error"
            )
            # The gateway still serves afterwards.
            ok = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
            assert ok.status_code == 200

    run(main())


def test_chat_completion_and_stream_with_usage(run):
    async def main():
        async with running_gateway([ScriptedWorker(tokens=3)]) as gw, httpx.AsyncClient() as client:
            r = (await client.post(url(gw, "/v1/chat/completions"), json=CHAT)).json()
            assert r["choices"][0]["message"]["content"] == "w0 w1 w2 "
            assert r["choices"][0]["finish_reason"] == "length"
            assert r["usage"]["total_tokens"] == 7
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            s = await client.post(url(gw, "/v1/chat/completions"), json=body)
            assert s.headers["content-type"].startswith("text/event-stream")
            events = sse_events(s.text)
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(
                e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]
            )
            assert text == "w0 w1 w2 "
            assert all(e["usage"] is None for e in events[:-1])
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3

    run(main())


def test_unknown_path_and_models_and_health_and_openapi(run):
    async def main():
        async with running_gateway([ScriptedWorker()]) as gw, httpx.AsyncClient() as client:
            missing = await client.get(url(gw, "/v1/nothing"))
            assert (
                missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
            )
            models = (await client.get(url(gw, "/v1/models"))).json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            health = await client.get(url(gw, "/health"))
            assert health.status_code == 200 and health.json()["workers_serving"] == 1
            paths = (await client.get(url(gw, "/openapi.json"))).json()["paths"]
            assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(
                paths
            )

    run(main())


def test_no_serving_worker_is_503(run):
    async def main():
        starting = ScriptedWorker()
        starting.state = 1  # SERVING_STATE_STARTING
        async with running_gateway([starting], wait_serving=0) as gw, httpx.AsyncClient() as client:
            await asyncio.sleep(0.2)  # a report or two
            r = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
            assert (await client.get(url(gw, "/health"))).status_code == 503

    run(main())


def test_saturated_workers_get_429_with_retry_after(run):
    async def main():
        busy = ScriptedWorker(running=8, max_num_seqs=8)
        busy.requests_per_second = 0.5
        async with (
            running_gateway([busy], max_queue_per_worker=0) as gw,
            httpx.AsyncClient() as client,
        ):
            r = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert r.headers["retry-after"] == "2"  # 1 request over at 0.5 per second
            assert busy.calls == []

    run(main())


def test_refusal_before_the_first_token_is_retried_on_another_worker(run):
    async def main():
        refusing, good = ScriptedWorker(mode="refuse"), ScriptedWorker(running=5)
        async with running_gateway([refusing, good]) as gw, httpx.AsyncClient() as client:
            r = await client.post(url(gw, "/v1/chat/completions"), json={**CHAT, "stream": True})
            assert r.status_code == 200
            assert (
                "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r.text))
                == "w0 w1 w2 "
            )
            assert len(refusing.calls) == 1 and len(good.calls) == 1
            assert refusing.calls[0].request_id == good.calls[0].request_id
            # Ejected for a while (its load reports still say SERVING).
            assert gw.pool.workers[refusing.address].outlier.ejected(time.monotonic())
            metrics = (await client.get(url(gw, "/metrics"))).text
            assert (
                'meridian_request_retries_total{component="gateway",model="scripted"} 1.0'
                in metrics
            )

    run(main())


def test_a_stream_that_fails_after_its_first_token_is_not_retried(run):
    async def main():
        breaking, good = ScriptedWorker(mode="break"), ScriptedWorker(running=5)
        async with running_gateway([breaking, good]) as gw, httpx.AsyncClient() as client:
            r = await client.post(url(gw, "/v1/chat/completions"), json={**CHAT, "stream": True})
            events = sse_events(r.text)
            assert events[1]["choices"][0]["delta"] == {"content": "w0 "}
            assert events[-1]["error"]["message"].endswith("failed: worker went away")
            assert good.calls == []

    run(main())


def test_an_answer_sent_whole_is_retried_when_its_worker_fails_midway(run):
    async def main():
        breaking, good = ScriptedWorker(mode="break"), ScriptedWorker(running=5)
        async with running_gateway([breaking, good]) as gw, httpx.AsyncClient() as client:
            r = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "w0 w1 w2 "
            assert r.headers["x-meridian-route"] == "retry"
            assert r.headers["x-meridian-replica"] == good.address
            assert len(breaking.calls) == 1 and len(good.calls) == 1
            assert gw.pool.workers[breaking.address].outlier.ejected(time.monotonic())

    run(main())


def test_worker_errors_keep_their_openai_code(run):
    async def main():
        async with (
            running_gateway([ScriptedWorker(mode="too_long")]) as gw,
            httpx.AsyncClient() as c,
        ):
            r = await c.post(url(gw, "/v1/completions"), json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 400
            assert r.json()["error"] == {
                "message": "the prompt has 9000 tokens",
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "context_length_exceeded",
            }

    run(main())


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_worker_call(run, stream):
    async def main():
        hanging = ScriptedWorker(mode="hang")
        async with running_gateway([hanging]) as gw:
            async with httpx.AsyncClient() as client:
                body = {**CHAT, "stream": stream}
                if stream:
                    async with client.stream(
                        "POST", url(gw, "/v1/chat/completions"), json=body
                    ) as r:
                        async for line in r.aiter_lines():
                            if "w0" in line:
                                break  # leaving the block closes the connection
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        await client.post(url(gw, "/v1/chat/completions"), json=body, timeout=0.5)
                gone = time.monotonic()
            while hanging.cancelled_at is None and time.monotonic() - gone < 2:
                await asyncio.sleep(0.01)
            assert hanging.cancelled_at is not None and hanging.cancelled_at - gone < 1.0
            assert gw.pool.workers[hanging.address].in_flight == 0
            metrics = (await httpx.AsyncClient().get(url(gw, "/metrics"))).text
            assert 'status="cancelled"' in metrics

    run(main())


def test_the_http_socket_is_made_so_that_asyncio_turns_nagle_off():
    # asyncio sets TCP_NODELAY only on sockets created with IPPROTO_TCP; with Nagle on, a kept-alive
    # connection waited 44 ms (the client's delayed ACK) for every response.
    import socket

    from meridian.gateway.server import _listen

    sock = _listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
