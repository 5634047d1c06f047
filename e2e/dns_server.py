"""A real DNS server for e2e tests: dnsmasq on 127.0.0.1, answering only from the records given.

Names under `domain` without a record get NXDOMAIN (a headless Service with no ready pods); names
elsewhere get REFUSED. Every answer carries `ttl` seconds, so lookups expire quickly. dnsmasq does not
re-read srv-host records on SIGHUP, so set_records() restarts it on the same port.

    with Dnsmasq(srv={"_grpc._tcp.w.meridian.test": [("w0.meridian.test", 50051)]},
                 hosts={"w0.meridian.test": ["127.0.0.11", "::11"]}) as dns:
        ...  # dns.nameserver == "127.0.0.1:PORT"
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping

import dns.exception
import dns.resolver

from meridian.net import free_port

SrvRecords = Mapping[str, Iterable[tuple[str, int]]]  # name -> (target, port) per record
HostRecords = Mapping[str, Iterable[str]]  # name -> its IPv4 and IPv6 addresses


def dnsmasq_binary() -> str | None:
    """Where dnsmasq is installed (`e2e/tools` installs it), or None."""
    return shutil.which("dnsmasq", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


class Dnsmasq:
    def __init__(
        self,
        srv: SrvRecords | None = None,
        hosts: HostRecords | None = None,
        domain: str = "meridian.test",
        ttl: int = 1,
    ) -> None:
        binary = dnsmasq_binary()
        if binary is None:
            raise RuntimeError("dnsmasq is not installed: run e2e/tools")
        self.binary, self.domain, self.ttl = binary, domain, ttl
        self.port = free_port()
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="meridian-dnsmasq-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.set_records(srv or {}, hosts or {})

    @property
    def nameserver(self) -> str:
        """IP:PORT, as discovery's `nameserver` takes it."""
        return f"127.0.0.1:{self.port}"

    def set_records(self, srv: SrvRecords, hosts: HostRecords) -> None:
        """Serve exactly these records from now on (restarts dnsmasq; returns once it answers)."""
        lines = [f"local=/{self.domain}/"]
        lines += [f"srv-host={name},{t},{p}" for name, records in srv.items() for t, p in records]
        lines += [f"host-record={name},{ip}" for name, ips in hosts.items() for ip in ips]
        self.directory.mkdir(exist_ok=True)  # stop() removed it
        config = self.directory / "dnsmasq.conf"
        config.write_text("\n".join(lines) + "\n")
        self._kill()
        with (self.directory / "dnsmasq.log").open("ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--no-daemon",
                    "--no-resolv",
                    "--no-hosts",
                    f"--port={self.port}",
                    "--listen-address=127.0.0.1",
                    "--bind-interfaces",
                    f"--conf-file={config}",
                    "--pid-file=",
                    f"--local-ttl={self.ttl}",
                    f"--auth-ttl={self.ttl}",
                    "--log-facility=-",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_answering()

    def stop(self) -> None:
        """Stop answering (set_records() starts it again, on the same port)."""
        self._kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Dnsmasq:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None

    def _wait_answering(self, timeout: float = 10) -> None:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port = ["127.0.0.1"], self.port
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                break
            try:
                resolver.resolve(self.domain, "SOA", lifetime=0.5)
                return
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                return  # an answer, even a negative one: it is serving
            except dns.exception.DNSException:
                time.sleep(0.05)
        log = (self.directory / "dnsmasq.log").read_text(errors="replace")[-2000:]
        self._kill()
        raise RuntimeError(f"dnsmasq on port {self.port} did not start answering:\n{log}")
