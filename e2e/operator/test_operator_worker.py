"""The command the operator gives worker pods is one `meridian worker` accepts.

kwok runs no containers, so this reads the pod template and engine ConfigMap as the API server
stored them, expands $(VAR) references the way the kubelet does, and parses the result with the
worker's own argument parser.
"""

from __future__ import annotations

import argparse
import re

from operator_e2e import is_ready, model_deployment, wait_until

from meridian.worker.server import add_arguments

OWNER = "serving.meridian.dev/deployment"


def expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def test_worker_pods_get_a_command_the_worker_accepts(installed, operator, namespace):
    body = model_deployment(
        "flags",
        {"us-east": 1},
        engine={"maxModelLen": 2048, "kvCacheMemory": "1Gi", "prefixCaching": False},
        resources={"gpus": 1, "cpu": "2", "memory": "4Gi"},
    )
    body["spec"]["model"]["dtype"] = "bfloat16"
    installed.apply(body, namespace)
    wait_until(
        "flags to be Ready", lambda: is_ready(installed.json("get", "md", "flags", "-n", namespace))
    )
    (deployment,) = installed.items("deployments", namespace, f"{OWNER}=flags")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (source,) = container["envFrom"]
    env = installed.json("get", "configmap", source["configMapRef"]["name"], "-n", namespace)[
        "data"
    ]
    command = [expand(arg, env) for arg in container["command"] + container["args"]]
    assert command[:2] == ["meridian", "worker"]

    parser = argparse.ArgumentParser(prog="meridian worker")
    add_arguments(parser)
    # Parsing is the contract; building the engine's settings would also ask for a real GPU.
    args = parser.parse_args(command[2:])
    assert (args.host, args.port) == ("0.0.0.0", 50051)
    assert (args.model, args.served_model_name) == ("smollm2-135m-instruct",) * 2
    assert (args.device, args.dtype, args.max_model_len) == ("cuda", "bfloat16", 2048)
    assert args.kv_cache_memory == 2**30
    assert args.enable_prefix_caching is False
    assert container["readinessProbe"]["grpc"]["port"] == args.port
