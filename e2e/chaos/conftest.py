"""One `meridian serve` (two workers, short context and timeouts) shared by the chaos suite. Each
test waits until both workers serve and nothing is in flight before it starts, and leaves no
worker stopped; the serve process and its workers are always stopped at the end."""

import pytest
from chaos_serve import Serve, resume_all


@pytest.fixture(scope="session")
def chaos_log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("chaos-logs")


@pytest.fixture(scope="session")
def serve(chaos_log_dir):
    s = Serve("serve", chaos_log_dir)
    try:
        s.wait_until(s.ready, "ready")
        yield s
    finally:
        resume_all(s)  # a stopped worker cannot drain
        s.stop(timeout=30)
