"""Hostile input and failing upstreams at the gateway: bounded fields, bounded metric labels,
accounting that always ends, first-token bounds and deadlines. A real gateway in front of scripted
workers (see scripted_workers.py)."""

import asyncio
import json
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from scripted_workers import MODEL, ScriptedWorker, running_gateway, url

from meridian.limits import MAX_REQUEST_BYTES

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def in_flight(client: httpx.AsyncClient, gw) -> float:
    text = (await client.get(url(gw, "/metrics"))).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "meridian_requests_in_flight"
        for s in family.samples
    )


async def model_labels(client: httpx.AsyncClient, gw) -> set[str]:
    text = (await client.get(url(gw, "/metrics"))).text
    return {
        s.labels["model"]
        for family in text_string_to_metric_families(text)
        if family.name == "meridian_requests"
        for s in family.samples
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 2**32),
        ("max_completion_tokens", 2**40),
        ("top_k", 2**32),
        ("seed", 2**64),
        ("priority", 2**31),
    ],
)
def test_numbers_beyond_the_wire_are_400s_and_leave_nothing_in_flight(run, field, value):
    async def main():
        async with running_gateway([ScriptedWorker()]) as gw, httpx.AsyncClient() as client:
            r = await client.post(url(gw, "/v1/chat/completions"), json={**CHAT, field: value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field
            assert await in_flight(client, gw) == 0
            assert (await client.post(url(gw, "/v1/chat/completions"), json=CHAT)).is_success

    run(main())


def test_a_body_over_the_limit_is_a_413_that_names_it(run):
    async def main():
        async with running_gateway([ScriptedWorker()]) as gw, httpx.AsyncClient() as client:
            body = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]}
            r = await client.post(url(gw, "/v1/chat/completions"), json=body)
            assert r.status_code == 413, r.text
            error = r.json()["error"]
            assert str(MAX_REQUEST_BYTES) in error["message"]
            assert error["code"] == "request_too_large"
            assert await in_flight(client, gw) == 0

    run(main())


def test_model_names_nothing_serves_add_no_series(run):
    async def main():
        async with running_gateway([ScriptedWorker()]) as gw, httpx.AsyncClient() as client:
            for i in range(30):
                r = await client.post(
                    url(gw, "/v1/chat/completions"), json={**CHAT, "model": i * "z" or "q"}
                )
                assert r.status_code == 404
            bad = {**CHAT, "model": "junk", "temperature": "hot"}
            assert (await client.post(url(gw, "/v1/chat/completions"), json=bad)).status_code == 400
            assert (await client.post(url(gw, "/v1/chat/completions"), json=CHAT)).is_success
            assert await model_labels(client, gw) == {MODEL, "unknown"}

    run(main())


def test_a_bug_in_the_gateway_is_a_500_with_an_openai_body_and_ends_its_accounting(run):
    async def main():
        async with running_gateway([ScriptedWorker()]) as gw, httpx.AsyncClient() as client:

            async def broken(*args, **kwargs):
                raise RuntimeError("a bug")

            gw.dispatcher.open = broken
            r = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "server_error"
            assert await in_flight(client, gw) == 0

    run(main())


def test_priority_is_passed_on_only_for_callers_with_a_key(run, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-good\n")

    async def main():
        worker = ScriptedWorker()
        async with running_gateway([worker]) as gw, httpx.AsyncClient() as client:
            body = {**CHAT, "priority": -5}
            assert (await client.post(url(gw, "/v1/chat/completions"), json=body)).is_success
        assert worker.calls[-1].priority == 0
        worker = ScriptedWorker()
        keyed = httpx.AsyncClient(headers={"authorization": "Bearer sk-good"})
        async with running_gateway([worker], api_keys_file=str(keys)) as gw, keyed as client:
            assert (await client.post(url(gw, "/v1/chat/completions"), json=body)).is_success
        assert worker.calls[-1].priority == -5

    run(main())


def test_a_message_name_reaches_the_worker(run):
    async def main():
        worker = ScriptedWorker()
        async with running_gateway([worker]) as gw, httpx.AsyncClient() as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "ada"}]}
            assert (await client.post(url(gw, "/v1/chat/completions"), json=body)).is_success
        assert worker.calls[-1].chat.messages[0].name == "ada"

    run(main())


def test_an_upstream_without_a_first_token_in_time_loses_the_request(run):
    async def main():
        silent, good = ScriptedWorker("silent"), ScriptedWorker()
        gateway = running_gateway([silent, good], first_token_timeout=0.3, prefix_affinity=False)
        async with gateway as gw, httpx.AsyncClient() as client:
            good.running = 8  # the silent one looks idle: requests go there first
            while gw.pool.upstreams[good.address].load.running != 8:
                await gw.pool.changed()
            r = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
            assert r.is_success and r.headers["x-meridian-replica"] == good.address
            assert silent.calls and silent.cancelled_at is not None
            assert await in_flight(client, gw) == 0

    run(main())


class HungHealth(health_pb2_grpc.HealthServicer):
    """A process whose event loop still accepts calls but never answers (like a stopped one)."""

    async def Check(self, request, context):
        await asyncio.sleep(3600)


@pytest.mark.parametrize("mode", ["silent", "hang"])
def test_a_worker_that_stops_answering_probes_loses_its_whole_answers_to_another(run, mode):
    # silent: no first token yet; hang: one token, then nothing (a whole answer can still move).
    async def main():
        stuck, good = ScriptedWorker(mode), ScriptedWorker()
        await stuck.start()
        health_pb2_grpc.add_HealthServicer_to_server(HungHealth(), stuck.server)
        stuck.start = _noop  # already started, with its health service
        async with running_gateway([stuck, good], prefix_affinity=False) as gw:
            good.running = 8  # the stuck one looks idle: requests go there first
            while gw.pool.upstreams[good.address].load.running != 8:
                await gw.pool.changed()
            async with httpx.AsyncClient(timeout=20) as client:
                start = time.monotonic()
                r = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
                assert r.is_success and r.headers["x-meridian-replica"] == good.address
                assert r.json()["choices"][0]["message"]["content"] == "w0 w1 w2 "
                assert stuck.calls, "the request went to the stuck worker first"
                assert time.monotonic() - start < 5  # a failed probe, not the 60 s bound
                assert gw.pool.upstreams[stuck.address].state == "down"
                assert stuck.cancelled_at is not None
                assert await in_flight(client, gw) == 0

    run(main())


async def _noop() -> None:
    pass


def test_overloaded_is_retried_elsewhere_but_a_message_too_large_is_not(run):
    async def main():
        full, good = ScriptedWorker("overloaded"), ScriptedWorker()
        async with running_gateway([full, good]) as gw, httpx.AsyncClient() as client:
            for _ in range(4):
                r = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
                assert r.is_success and r.headers["x-meridian-replica"] == good.address
        big, other = ScriptedWorker("too_big"), ScriptedWorker("too_big")
        async with running_gateway([big, other]) as gw, httpx.AsyncClient() as client:
            r = await client.post(url(gw, "/v1/chat/completions"), json=CHAT)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            assert len(big.calls) + len(other.calls) == 1
            assert all(u.outlier.failures == 0 for u in gw.pool.upstreams.values())

    run(main())


def test_the_clients_read_timeout_is_the_deadline_of_a_whole_answer(run):
    async def main():
        async with running_gateway([ScriptedWorker("silent")]) as gw, httpx.AsyncClient() as client:
            start = time.monotonic()
            r = await client.post(
                url(gw, "/v1/chat/completions"),
                json=CHAT,
                headers={"x-stainless-read-timeout": "0.5"},
            )
            assert r.status_code == 504, r.text
            assert 0.4 < time.monotonic() - start < 3
            assert await in_flight(client, gw) == 0

    run(main())


def test_the_grpc_front_end_ends_its_accounting_on_every_path(run):
    from meridian.api.v1 import pb, pb_grpc

    async def main():
        async with (
            running_gateway([ScriptedWorker("too_long")]) as gw,
            httpx.AsyncClient() as client,
        ):
            address = f"127.0.0.1:{gw.settings.grpc_port}"
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.InferenceStub(channel)
                request = pb.GenerateRequest(model=MODEL, text="hi")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(request):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                junk = pb.GenerateRequest(model="junk" * 10, text="hi")
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in stub.Generate(junk):
                        pass
            assert await in_flight(client, gw) == 0
            assert await model_labels(client, gw) <= {MODEL, "unknown"}
            assert json.loads((await client.get(url(gw, "/health"))).text)["workers_serving"] == 1

    run(main())


class TokenizingWorker(ScriptedWorker):
    """Serves a byte-level tokenizer (one token per byte), so the gateway tokenizes prompts."""

    async def Tokenizer(self, request, context):
        from tokenizers import Tokenizer as FastTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        from meridian.worker.tokenizer import Tokenizer

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        fast = FastTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        fast.decoder = decoders.ByteLevel()
        template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        return Tokenizer(fast, [0], None, False, template).to_pb(self.model)


def test_a_prompt_longer_than_any_context_window_is_refused_by_the_gateway_untokenized(run):
    async def main():
        workers = [TokenizingWorker(), TokenizingWorker()]
        async with running_gateway(workers) as gw, httpx.AsyncClient() as client:
            while gw.pool.tokenizer(MODEL) is None:
                await asyncio.sleep(0.05)
            # The workers' window is 2048 tokens; a token here is at most 3 bytes of text.
            long = {**CHAT, "messages": [{"role": "user", "content": "x" * 7_000}]}
            r = await client.post(url(gw, "/v1/chat/completions"), json=long)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
            assert "2048" in error["message"]
            assert not any(w.calls for w in workers)
            short = {**CHAT, "messages": [{"role": "user", "content": "x" * 1_000}]}
            assert (await client.post(url(gw, "/v1/chat/completions"), json=short)).is_success

    run(main())
