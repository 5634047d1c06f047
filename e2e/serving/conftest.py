"""Real workers with the real model, started once for the whole serving suite, and a gateway."""

import pytest
from serving_processes import MODEL, Gateway, Worker


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serving-logs")


@pytest.fixture(scope="session")
def workers(log_dir):
    started = [Worker(f"worker-{i}", log_dir) for i in range(2)]
    try:
        for w in started:
            w.wait_until(w.serving, "serving")
        yield started
    finally:
        for w in started:
            w.stop()


@pytest.fixture(scope="session")
def gateway(log_dir, workers):
    g = Gateway("gateway", log_dir, [w.address for w in workers])
    try:
        g.wait_until(lambda: g.serving(len(workers)), "routing to every worker", timeout=60)
        yield g
    finally:
        g.stop()


@pytest.fixture(scope="session")
def tokenizer():
    from gguf import GGUFReader

    from meridian.worker.loaders import resolve
    from meridian.worker.loaders.gguf_file import read_metadata
    from meridian.worker.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_metadata(GGUFReader(str(resolve(MODEL)))))


@pytest.fixture
def client(gateway):
    import openai

    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def async_client(gateway):
    import openai

    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
