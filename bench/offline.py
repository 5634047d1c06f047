"""Offline throughput: Meridian's engine against Hugging Face `transformers` generate(), same run.

N seeded synthetic prompts of fixed length; each request generates exactly `--new-tokens` tokens
(EOS ignored on both sides, greedy) so both sides do the same work. transformers runs static
batches of `--hf-batch-size`. With `--rounds R` the two sides take turns R times, so a machine
whose speed drifts during the run slows both alike; each side's median time counts. Prints each
side's output tokens/s; the last line is the ratio.

    python -P bench/offline.py [--requests 64] [--prompt-tokens 128] [--new-tokens 128] [--rounds 1]
"""

import argparse
import random
import statistics
import sys
import time

import torch

from meridian.worker.engine.llm_engine import EngineSettings, LLMEngine
from meridian.worker.loaders import DEFAULT_MODEL, load_checkpoint, resolve
from meridian.worker.sampling_params import SamplingParams


def synthetic_prompts(
    n: int, length: int, vocab: int, special: set[int], seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab) if t not in special]
    return [[rng.choice(ordinary) for _ in range(length)] for _ in range(n)]


def run_meridian(checkpoint, prompts, new_tokens: int, args):
    """A function that runs every prompt through the engine: (seconds, outputs)."""
    engine = LLMEngine(
        EngineSettings(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            # Every round repeats the same prompts; a cache hit would skip prefill work that
            # transformers does, so the comparison is of batching alone.
            enable_prefix_caching=False,
        ),
        checkpoint,
    )
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm up

    def run() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return time.perf_counter() - start, [o.token_ids for o in outs]

    return run


def run_transformers(prompts, new_tokens: int, args):
    """A function that runs every prompt through transformers in static batches."""
    from transformers import AutoModelForCausalLM

    path = resolve(args.model)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype
    ).eval()

    def generate(batch):
        ids = torch.tensor(batch)  # equal lengths: no padding needed
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # never stop at EOS, like ignore_eos
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist()

    generate(prompts[:2])  # warm up

    def run() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = []
        for i in range(0, len(prompts), args.hf_batch_size):
            outputs += generate(prompts[i : i + args.hf_batch_size])
        return time.perf_counter() - start, outputs

    return run


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers static batch size")
    p.add_argument("--max-num-seqs", type=int, default=128, help="Meridian's running-sequence cap")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="turns each side takes, alternating")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")

    checkpoint = load_checkpoint(args.model)
    tok = checkpoint.tokenizer
    prompts = synthetic_prompts(
        args.requests,
        args.prompt_tokens,
        checkpoint.config.vocab_size,
        tok.special_token_ids,
        args.seed,
    )
    total = args.requests * args.new_tokens
    print(
        f"{args.requests} requests x {args.prompt_tokens} prompt tokens -> {args.new_tokens} new tokens, "
        f"{args.dtype}, {torch.get_num_threads()} threads",
        file=sys.stderr,
    )

    meridian = run_meridian(checkpoint, prompts, args.new_tokens, args)
    transformers = run_transformers(prompts, args.new_tokens, args)
    m_times, h_times = [], []
    for r in range(args.rounds):
        m_time, m_out = meridian()
        h_time, h_out = transformers()
        m_times.append(m_time)
        h_times.append(h_time)
        if args.rounds > 1:
            print(
                f"round {r + 1}: meridian {total / m_time:.1f}, transformers {total / h_time:.1f}"
                f" output tokens/s, ratio {h_time / m_time:.2f}"
            )
    m_tps = total / statistics.median(m_times)
    h_tps = total / statistics.median(h_times)
    print(f"meridian:     {total / m_tps:7.2f} s  {m_tps:8.1f} output tokens/s")
    print(
        f"transformers: {total / h_tps:7.2f} s  {h_tps:8.1f} output tokens/s"
        f" (static batches of {args.hf_batch_size})"
    )
    same = sum(a == b for a, b in zip(m_out, h_out, strict=True))
    print(f"identical greedy outputs: {same}/{len(prompts)}")
    print(f"meridian/transformers output throughput ratio: {m_tps / h_tps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
