"""Real gateways of two or three regions (HTTP and gRPC on free ports, in this process) in front of
scripted workers: where an answer was served and how it got there, forwarding at most once, and the
result cache, API keys and `model: auto` as a client sees them."""

import asyncio

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scripted_workers import MODEL, ScriptedWorker, grpc_address, running_gateway, url

from meridian.api.v1 import pb, pb_grpc

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
STARTING = pb.SERVING_STATE_STARTING


def where(r: httpx.Response) -> tuple[str, str, str]:
    return tuple(r.headers[f"x-meridian-{name}"] for name in ("region", "replica", "route"))


async def routed(client: httpx.AsyncClient, gateway) -> dict[tuple[str, str], float]:
    """meridian_routed_requests_total by (region, route)."""
    text = (await client.get(url(gateway, "/metrics"))).text
    return {
        (s.labels["region"], s.labels["route"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "meridian_routed_requests"
        for s in family.samples
        if s.name.endswith("_total")
    }


def a_worker_that_is_starting() -> ScriptedWorker:
    w = ScriptedWorker()
    w.state = STARTING
    return w


@pytest.mark.parametrize(
    "a_workers", [list, lambda: [a_worker_that_is_starting()]], ids=["no-workers", "starting"]
)
def test_a_region_without_a_serving_worker_fails_over_to_its_peer(run, a_workers):
    async def main():
        worker = ScriptedWorker()
        async with (
            running_gateway([worker], region="b") as b,
            running_gateway(a_workers(), wait_serving=0, peer_gateways=(b,), region="a") as a,
            httpx.AsyncClient() as client,
        ):
            r = await client.post(url(a, "/v1/chat/completions"), json=CHAT)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "w0 w1 w2 "
            assert where(r) == ("b", worker.address, "failover")
            assert [call.hops for call in worker.calls] == [1]
            assert await routed(client, a) == {("b", "failover"): 1.0}

    run(main())


def test_grpc_metadata_through_a_peer_says_where_it_was_served(run):
    async def main():
        worker = ScriptedWorker(tokens=2)
        async with (
            running_gateway([worker], region="b") as b,
            running_gateway([], peer_gateways=(b,), region="a") as a,
            grpc.aio.insecure_channel(grpc_address(a)) as channel,
        ):
            call = pb_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(model=MODEL, text="hi", request_id="r1")
            )
            assert [r.text async for r in call] == ["w0 ", "w1 "]
            expected = {
                "x-meridian-region": "b",
                "x-meridian-replica": worker.address,
                "x-meridian-route": "failover",
            }
            initial, trailing = (
                dict(await call.initial_metadata()),
                dict(await call.trailing_metadata()),
            )
            assert {k: v for k, v in initial.items() if k.startswith("x-meridian-")} == expected
            # The trailers add how long the upstream call took, as this gateway timed it.
            assert float(trailing.pop("x-meridian-upstream-ms")) > 0
            assert {k: v for k, v in trailing.items() if k.startswith("x-meridian-")} == expected
            assert worker.calls[0].request_id == "r1" and worker.calls[0].hops == 1

    run(main())


def test_a_forwarded_request_is_never_forwarded_again(run):
    async def main():
        worker = ScriptedWorker()
        async with (
            running_gateway([worker], region="c") as c,
            running_gateway([], peer_gateways=(c,), region="b") as b,
            grpc.aio.insecure_channel(grpc_address(b)) as channel,
        ):
            stub = pb_grpc.InferenceStub(channel)
            forwarded = pb.GenerateRequest(model=MODEL, text="hi", hops=1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(forwarded):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert ("x-meridian-region", "b") in tuple(e.value.trailing_metadata())
            assert worker.calls == []
            # The same request straight from a client does go to c, once.
            fresh = pb.GenerateRequest(model=MODEL, text="hi")
            assert len([r async for r in stub.Generate(fresh)]) == 3
            assert [call.hops for call in worker.calls] == [1]

    run(main())


def test_a_serving_local_worker_answers_locally(run):
    async def main():
        local, remote = ScriptedWorker(), ScriptedWorker()
        async with (
            running_gateway([remote], region="b") as b,
            running_gateway([local], peer_gateways=(b,), region="a", probe_share=0.0) as a,
            httpx.AsyncClient() as client,
        ):
            for _ in range(3):
                r = await client.post(url(a, "/v1/chat/completions"), json=CHAT)
                assert where(r) == ("a", local.address, "local")
            assert [call.hops for call in local.calls] == [0, 0, 0] and remote.calls == []
            assert await routed(client, a) == {("a", "local"): 3.0}

    run(main())


def test_full_local_workers_spill_to_the_peer(run):
    async def main():
        full, remote = ScriptedWorker(running=8, max_num_seqs=8), ScriptedWorker()
        full.requests_per_second = 100.0  # its queue is short: only being full sends requests away
        async with (
            running_gateway([remote], region="b") as b,
            running_gateway(
                [full], peer_gateways=(b,), region="a", max_queue_per_worker=0, probe_share=0.0
            ) as a,
            httpx.AsyncClient() as client,
        ):
            r = await client.post(url(a, "/v1/chat/completions"), json=CHAT)
            assert where(r) == ("b", remote.address, "spill")
            assert full.calls == [] and len(remote.calls) == 1

    run(main())


def test_a_peer_that_turns_out_to_be_of_this_region_is_not_routed_to(run):
    # DNS lists every gateway, this region's own too; forwarding to them would loop.
    async def main():
        async with (
            running_gateway([ScriptedWorker()], region="a") as same,
            running_gateway([], peer_gateways=(same,), region="a") as a,
            httpx.AsyncClient() as client,
        ):
            r = await client.post(url(a, "/v1/chat/completions"), json=CHAT)
            assert r.status_code == 503, r.text

    run(main())


def test_a_repeated_greedy_request_is_answered_from_the_result_cache(run):
    async def main():
        worker = ScriptedWorker()
        async with (
            running_gateway([worker], region="b") as b,
            running_gateway([], peer_gateways=(b,), region="a") as a,
            httpx.AsyncClient() as client,
        ):
            greedy = {**CHAT, "temperature": 0}
            first = await client.post(url(a, "/v1/chat/completions"), json=greedy)
            again = await client.post(url(a, "/v1/chat/completions"), json=greedy)
            assert where(first) == ("b", worker.address, "failover")
            assert where(again)[2] == "cache" and again.headers["x-meridian-region"] == "a"
            content = [r.json()["choices"][0]["message"]["content"] for r in (first, again)]
            assert content == ["w0 w1 w2 "] * 2
            assert len(worker.calls) == 1
            # Sampled without a seed: a new answer each time.
            sampled = {**CHAT, "temperature": 1}
            for _ in range(2):
                r = await client.post(url(a, "/v1/chat/completions"), json=sampled)
                assert where(r)[2] == "failover"
            assert len(worker.calls) == 3
            assert await routed(client, a) == {("b", "failover"): 3.0, ("a", "cache"): 1.0}

    run(main())


def test_api_keys_are_checked_limited_and_passed_on_to_the_peer(run, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nslow-key rpm=1\nfree-key\n")

    async def main():
        worker = ScriptedWorker()
        async with (
            # b checks keys too: the answer comes back only if a passed the client's key on.
            running_gateway([worker], region="b", api_keys_file=str(keys)) as b,
            running_gateway([], peer_gateways=(b,), region="a", api_keys_file=str(keys)) as a,
            httpx.AsyncClient() as client,
        ):

            async def chat(key: str | None) -> httpx.Response:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                return await client.post(url(a, "/v1/chat/completions"), json=CHAT, headers=headers)

            for key in (None, "wrong-key"):
                r = await chat(key)
                assert r.status_code == 401, r.text
                assert r.json()["error"]["type"] == "authentication_error"
            assert worker.calls == []
            ok = await chat("slow-key")
            assert ok.status_code == 200 and where(ok)[0] == "b"
            assert ok.headers["x-ratelimit-limit-requests"] == "1"
            limited = await chat("slow-key")
            assert limited.status_code == 429, limited.text
            assert int(limited.headers["retry-after"]) >= 1
            assert limited.headers["x-ratelimit-limit-requests"] == "1"
            assert limited.headers["x-ratelimit-remaining-requests"] == "0"
            assert "x-ratelimit-reset-requests" in limited.headers
            assert (await chat("free-key")).status_code == 200
            assert len(worker.calls) == 2

    run(main())


def test_model_auto_sends_short_requests_to_the_small_model(run):
    async def main():
        small, large = ScriptedWorker(model="small"), ScriptedWorker(model="large")
        async with (
            running_gateway([small, large], auto_model="small,large") as gw,
            httpx.AsyncClient() as client,
        ):
            auto = {**CHAT, "model": "auto"}
            short = await client.post(
                url(gw, "/v1/chat/completions"), json={**auto, "max_tokens": 16}
            )
            assert short.status_code == 200, short.text
            assert short.json()["model"] == "small" and where(short)[1] == small.address
            unbounded = await client.post(url(gw, "/v1/chat/completions"), json=auto)
            assert unbounded.json()["model"] == "large" and where(unbounded)[1] == large.address
            assert (len(small.calls), len(large.calls)) == (1, 1)
            assert (small.calls[0].model, large.calls[0].model) == ("small", "large")

    run(main())


def test_setting_hops_does_not_skip_a_keys_limits(run, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("slow-key rpm=1\n")

    async def main():
        worker = ScriptedWorker()
        async with (
            running_gateway([worker], region="b", api_keys_file=str(keys)) as b,
            grpc.aio.insecure_channel(grpc_address(b)) as channel,
        ):
            stub = pb_grpc.InferenceStub(channel)
            metadata = (("authorization", "Bearer slow-key"),)
            for hops in (0, 1):
                request = pb.GenerateRequest(model=MODEL, text="hi", hops=hops)
                if hops == 0:
                    assert len([r async for r in stub.Generate(request, metadata=metadata)]) == 3
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(request, metadata=metadata):
                        pass
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(worker.calls) == 1

    run(main())


def test_a_peer_is_offered_only_the_models_its_own_workers_serve(run):
    async def main():
        far = ScriptedWorker(model="only-in-c")
        async with (
            running_gateway([far], region="c") as c,
            running_gateway([ScriptedWorker()], peer_gateways=(c,), region="b") as b,
            grpc.aio.insecure_channel(grpc_address(b)) as channel,
        ):
            stub = pb_grpc.InferenceStub(channel)
            every = await stub.Models(pb.ModelsRequest())
            own = await stub.Models(pb.ModelsRequest(local_only=True))
            assert {m.id for m in every.models} == {MODEL, "only-in-c"}
            assert {m.id for m in own.models} == {MODEL}

    run(main())


def test_peered_gateways_do_not_echo_load_reports(run):
    async def main():
        async with (
            running_gateway([ScriptedWorker()], region="b") as b,
            running_gateway([ScriptedWorker()], peer_gateways=(b,), region="a") as a,
        ):
            b.pool.add(grpc_address(a), peer=True)  # now each is the other's peer
            await asyncio.sleep(0.5)
            async with grpc.aio.insecure_channel(grpc_address(b)) as channel:
                stream = pb_grpc.InferenceStub(channel).LoadReport(
                    pb.LoadReportRequest(interval_seconds=0.5)
                )
                reports = []

                async def read():
                    async for report in stream:
                        reports.append(report)

                reader = asyncio.create_task(read())
                await asyncio.sleep(1.6)
                reader.cancel()
            # The first report and one per interval: b's unchanged worker and a's reports (which
            # change nothing b sums) send nothing more.
            assert 2 <= len(reports) <= 5, len(reports)
            assert reports[0].region == "b" and reports[0].serving_replicas == 1

    run(main())
