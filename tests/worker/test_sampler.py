import pytest
import torch

from meridian.errors import UserError
from meridian.worker.engine.sequence import Sequence
from meridian.worker.layers.sampler import sample
from meridian.worker.model_runner import ModelRunner
from meridian.worker.sampling_params import MAX_STOP, MAX_STOP_CHARS, SamplingParams

V = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_exact_argmax_per_row():
    x = logits(4)
    out = sample(x, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert out.token_ids == x.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    x = logits(3)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample(x[1:2], [p], [gen(7)]).token_ids
    mixed = sample(
        x, [SamplingParams(temperature=0.5), p, SamplingParams(temperature=0)], [None, gen(7), None]
    ).token_ids
    assert mixed[1] == alone[0]


def test_top_k_1_equals_greedy():
    x = logits(6, seed=3)
    out = sample(x, [SamplingParams(temperature=1.5, top_k=1)] * 6, [gen(i) for i in range(6)])
    assert out.token_ids == x.argmax(-1).tolist()


def test_top_k_only_samples_among_k_best():
    x = logits(1, seed=5).repeat(200, 1)
    out = sample(x, [SamplingParams(temperature=2.0, top_k=3)] * 200, [gen(i) for i in range(200)])
    allowed = set(x[0].topk(3).indices.tolist())
    assert set(out.token_ids) <= allowed and len(set(out.token_ids)) > 1


def test_top_p_keeps_smallest_set_reaching_p():
    x = torch.full((300, V), -20.0)
    x[:, 0], x[:, 1], x[:, 2] = 2.0, 1.5, 0.0  # probs about .56, .34, .08
    out = sample(x, [SamplingParams(top_p=0.8)] * 300, [gen(i) for i in range(300)])
    assert set(out.token_ids) == {0, 1}


def test_sampling_follows_the_distribution():
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    out = sample(x, [SamplingParams()] * 4000, [gen(i) for i in range(4000)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_logprobs_of_chosen_and_top_n():
    x = logits(2)
    out = sample(
        x, [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)], [None, None]
    )
    chosen, top = out.logprobs[0]
    ref = x[0].log_softmax(-1)
    assert chosen == pytest.approx(ref.max().item())
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()
    assert out.logprobs[1] is None


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -1},
        {"temperature": 2.01},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0},
        {"top_p": float("nan")},
        {"top_k": -2},
        {"seed": 2**64},
        {"stop": ("",)},
        {"stop": ("x" * (MAX_STOP_CHARS + 1),)},
        {"stop": tuple(str(i) for i in range(MAX_STOP + 1))},
        {"logprobs": 50},
    ],
)
def test_invalid_params_are_rejected(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)


def test_a_temperature_too_small_to_divide_by_is_greedy():
    x = logits(4)
    p = SamplingParams(temperature=1e-300)
    assert p.greedy
    assert sample(x, [p] * 4, [gen(i) for i in range(4)]).token_ids == x.argmax(-1).tolist()


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    x = logits(2)
    wide = sample(x, [SamplingParams(top_k=2**32 - 1, seed=1)] * 2, [gen(1), gen(2)])
    all_ = sample(x, [SamplingParams(seed=1)] * 2, [gen(1), gen(2)])
    assert wide.token_ids == all_.token_ids


def test_any_int64_seed_seeds_the_requests_generator():
    for seed in (-(2**63), -1, 0, 2**63 - 1):  # what the wire's int64 carries
        seq = Sequence("r", [1], SamplingParams(seed=seed), arrival=0)
        assert ModelRunner._generator(seq).initial_seed() == seed % 2**64
