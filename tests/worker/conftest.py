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


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """transformers' greedy continuation of one prompt, alone: the oracle outputs are checked against."""

    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        return out[0, len(ids) :].tolist()

    return generate
