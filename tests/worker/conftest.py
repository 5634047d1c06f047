"""Fixtures for tests that need the bundled model (loaded once per session)."""

import pytest
import torch

from meridian.worker.loaders import DEFAULT_MODEL, load_checkpoint, resolve


@pytest.fixture(scope="session")
def checkpoint():
    return load_checkpoint(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    return checkpoint.tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = resolve(DEFAULT_MODEL)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = resolve(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
