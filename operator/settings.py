"""The operator process's settings: built once from the command line, then passed down."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from meridian.operator.children import MANAGER


@dataclass(frozen=True)
class Settings:
    namespaces: tuple[str, ...] = ()  # watched namespaces; empty with all_namespaces=True
    all_namespaces: bool = False
    liveness: str | None = None  # e.g. http://0.0.0.0:8080/healthz
    # Every ModelDeployment is compared with its children (in memory) this often, besides on events.
    resync_seconds: float = 300.0
    # A pass started by a child's event waits this long, so a burst of events makes one pass.
    settle_seconds: float = 0.5
    # A reconcile that failed on a transient API error is tried again after this long.
    retry_seconds: float = 5.0
    leader_election: bool = True
    lease_name: str = MANAGER
    lease_namespace: str = "default"
    lease_seconds: float = 15.0  # a standby takes over this long after the leader stops renewing
    identity: str = f"{socket.gethostname()}-{os.getpid()}"
    field_manager: str = MANAGER
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.all_namespaces == bool(self.namespaces):
            raise ValueError(
                "choose either namespaces to watch or all_namespaces, not both or neither"
            )
        if self.resync_seconds <= 0 or self.retry_seconds <= 0 or self.settle_seconds < 0:
            raise ValueError(
                "resync_seconds and retry_seconds must be positive, settle_seconds >= 0"
            )
        if self.lease_seconds < 3:
            raise ValueError(
                "lease_seconds must be at least 3 (the leader renews every third of it)"
            )
