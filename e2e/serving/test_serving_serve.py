"""`meridian serve` (what `make serve` runs) brings up a deployment that curl and the OpenAI SDK can
use, and Ctrl-C shuts all of it down cleanly."""

import json
import os
import shutil
import signal
import subprocess

import httpx
import openai
import pytest
from serving_processes import MODEL, Process, free_port, grpc_serving

pytestmark = pytest.mark.timeout(420)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_serve_answers_curl_and_the_sdk_then_stops_on_ctrl_c(log_dir):
    port, grpc_port = free_port(), free_port()
    argv = ["serve", "--port", str(port), "--grpc-port", str(grpc_port)]
    argv += ["--kv-cache-memory", "256MiB", "--max-model-len", "2048"]
    serve = Process("serve", argv, log_dir, threads=2)
    try:
        serve.wait_until(lambda: "meridian serve: ready" in serve.log(), "ready")
        base = f"http://127.0.0.1:{port}"
        assert f"{base}/v1" in serve.log() and f"127.0.0.1:{grpc_port}" in serve.log()
        workers = children(serve.pid)
        assert len(workers) == 1

        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
            "temperature": 0,
        }
        if shutil.which("curl"):  # the README's example, as a user would run it
            curl = ["curl", "-s", f"{base}/v1/chat/completions"]
            curl += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
            out = subprocess.run(
                curl, capture_output=True, text=True, timeout=120, check=True
            ).stdout
        else:
            out = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).text
        assert "Paris" in json.loads(out)["choices"][0]["message"]["content"]

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        answer = client.chat.completions.create(**body).choices[0].message.content
        assert "Paris" in answer
        assert grpc_serving(f"127.0.0.1:{grpc_port}")

        assert serve.stop(signal.SIGINT, timeout=90) == 0  # Ctrl-C
        for pid in workers:  # its worker went with it
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        serve.stop()


def test_serve_regions_runs_a_peered_gateway_per_region(log_dir):
    # The second region's gateway takes the ports after these (free ports are spread out).
    port, grpc_port = free_port(), free_port()
    argv = ["serve", "--regions", "east,west", "--port", str(port), "--grpc-port", str(grpc_port)]
    argv += ["--kv-cache-memory", "256MiB", "--max-model-len", "2048"]
    serve = Process("serve-regions", argv, log_dir, threads=2)
    try:
        serve.wait_until(lambda: "meridian serve: ready" in serve.log(), "ready")
        assert len(children(serve.pid)) == 2  # one worker per region
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
        for region, http_port in (("east", port), ("west", port + 1)):
            assert f"region {region}: http://127.0.0.1:{http_port}/v1" in serve.log()
            # 1% of requests probe the peer region (route spill); the rest are served at home.
            routes = []
            while len(routes) < 3 and ("local", region) not in routes:
                url = f"http://127.0.0.1:{http_port}/v1/completions"
                r = httpx.post(url, json=body, timeout=120)
                assert r.status_code == 200, r.text
                routes.append((r.headers["x-meridian-route"], r.headers["x-meridian-region"]))
            assert routes[-1] == ("local", region), routes
            assert all(route == "spill" for route, _ in routes[:-1]), routes
        # Each gateway sees the other region as a serving peer.
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'meridian_peer_serving_replicas{component="gateway",region="west"} 1.0' in metrics
        assert serve.stop(signal.SIGINT, timeout=90) == 0
    finally:
        serve.stop()
