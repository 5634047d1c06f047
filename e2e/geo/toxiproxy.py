"""A real toxiproxy server that adds network latency between processes on loopback.

`tc netem` needs privileges the test machines do not have; toxiproxy is a TCP proxy whose
`latency` toxic holds each chunk for a fixed time in one direction. A proxy made here delays both
directions by half the round trip asked for, so every request/response exchange through it gains
`latency_ms` in all. The binary is built once by `build-toxiproxy` (next to this file).
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from meridian.net import free_port

BUILD_SCRIPT = Path(__file__).with_name("build-toxiproxy")
STARTUP_TIMEOUT = 20  # seconds; the server is a small Go binary


def toxiproxy_binary() -> Path:
    """The toxiproxy server, built first if it is not in the cache yet (seconds, once)."""
    out = subprocess.run(
        [str(BUILD_SCRIPT)], check=True, capture_output=True, text=True, timeout=600
    )
    return Path(out.stdout.strip())


class Toxiproxy:
    """One toxiproxy server on 127.0.0.1; its proxies listen on free loopback ports."""

    def __init__(self, log_dir: Path):
        self.log_path = log_dir / "toxiproxy.log"
        self.api = f"http://127.0.0.1:{free_port()}"
        port = self.api.rpartition(":")[2]
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [str(toxiproxy_binary()), "-host", "127.0.0.1", "-port", port],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.http = httpx.Client(base_url=self.api, timeout=5)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not self._answers():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"toxiproxy API did not come up on {self.api}\n{self.log()}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            return self.http.get("/version").status_code == 200
        except httpx.TransportError:
            return False

    def log(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "--- toxiproxy log ---\n" + "\n".join(text[-lines:])

    def proxy(self, name: str, upstream: str, latency_ms: int) -> str:
        """Listen on a free port and forward to `upstream` ("host:port") with `latency_ms` RTT added.

        Returns the listen address ("127.0.0.1:PORT"). The upstream need not listen yet.
        """
        listen = f"127.0.0.1:{free_port()}"
        r = self.http.post(
            "/proxies", json={"name": name, "listen": listen, "upstream": upstream, "enabled": True}
        )
        assert r.status_code == 201, f"creating proxy {name}: {r.status_code} {r.text}"
        for stream in ("upstream", "downstream"):
            toxic = {
                "name": f"latency_{stream}",
                "type": "latency",
                "stream": stream,
                "toxicity": 1.0,
                "attributes": {"latency": latency_ms // 2, "jitter": 0},
            }
            r = self.http.post(f"/proxies/{name}/toxics", json=toxic)
            assert r.status_code == 200, f"adding {stream} latency to {name}: {r.text}"
        return listen

    def stop(self, timeout: float = 10) -> None:
        self.http.close()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
