"""Batched sampling: every row of the batch has its own temperature, top-p, top-k and RNG.

Greedy rows take the exact argmax. Other rows sample with the exponential race: argmax(p / E) with
E ~ Exp(1) picks token i with probability p_i, so one vectorised argmax serves the whole batch and
only the noise is drawn per row (from the row's own seeded generator when it has one).
"""

from dataclasses import dataclass

import torch

from meridian.worker.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]  # [N]
    # per row: (sampled token's logprob, [(token id, logprob)] top-N), or None if not requested
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def sample(
    logits: torch.Tensor,  # [N, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],  # per row; None draws from the global RNG
) -> SampleResult:
    greedy = torch.tensor([p.greedy for p in params])
    chosen = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        chosen = torch.where(greedy, chosen, _sample_random(logits, params, generators))
    token_ids = chosen.tolist()
    return SampleResult(token_ids, _logprobs(logits, params, token_ids))


def _sample_random(logits, params, generators) -> torch.Tensor:
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
    scaled = logits / temperature.unsqueeze(1)
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[-1]
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k])
        kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params])
    if bool((top_p < 1).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the more likely ones already reach top_p (the first is always kept)
        drop = probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    noise = torch.ones_like(probs)
    for row, gen in enumerate(generators):
        if not params[row].greedy:
            noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def _logprobs(logits, params, token_ids):
    wanted = [p.logprobs is not None for p in params]
    if not any(wanted):
        return [None] * len(params)
    logp = logits.log_softmax(dim=-1)
    n = max(p.logprobs or 0 for p in params)
    top = logp.topk(n, dim=-1) if n else None
    chosen = logp.gather(1, torch.tensor(token_ids).unsqueeze(1)).squeeze(1).tolist()
    out = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        pairs = []
        if p.logprobs:
            ids = top.indices[row, : p.logprobs].tolist()
            values = top.values[row, : p.logprobs].tolist()
            pairs = list(zip(ids, values, strict=True))
        out.append((chosen[row], pairs))
    return out
