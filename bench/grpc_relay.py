"""The peer bench/gateway_overhead.py compares a gateway's cost with: the least any Python gRPC
proxy can do. It relays Generate to one upstream with grpc.aio (the gateway's own stack), with no
routing, metrics or bookkeeping, and reports the upstream call's time in the same
x-meridian-upstream-ms trailer, so that its cost is measured exactly as a gateway's is.

    python -P bench/grpc_relay.py PORT UPSTREAM_HOST:PORT
"""

import asyncio
import sys
import time

import grpc

from meridian.api.v1 import pb_grpc


class Relay(pb_grpc.InferenceServicer):
    def __init__(self, upstream: str):
        self.stub = pb_grpc.InferenceStub(grpc.aio.insecure_channel(upstream))

    async def Generate(self, request, context):
        sent = time.monotonic()
        async for response in self.stub.Generate(request):
            yield response
        upstream_ms = (time.monotonic() - sent) * 1000
        context.set_trailing_metadata((("x-meridian-upstream-ms", f"{upstream_ms:.3f}"),))


async def serve(port: int, upstream: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(Relay(upstream), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2]))
