"""Engine flags shared by every command that runs an engine (`generate`, `worker`, `serve`)."""

import argparse
import re
from dataclasses import fields

from meridian.worker.engine.llm_engine import DTYPES, EngineSettings
from meridian.worker.loaders import DEFAULT_MODEL

# EngineSettings field -> its flag below (booleans: the flag that turns the default off). Kept
# beside the flags so that a new one is added to both; `engine_flags` round-trips through them.
ENGINE_FLAGS = {
    "model": "--model",
    "dtype": "--dtype",
    "device": "--device",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_waiting": "--max-waiting",
    "max_model_len": "--max-model-len",
    "kv_cache_memory": "--kv-cache-memory",
    "enable_prefix_caching": "--no-prefix-caching",
    "enable_chunked_prefill": "--no-chunked-prefill",
}

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_memory(text: str) -> float:
    """'2GiB', '512MiB', '1e9' (bytes) or '0.8' (a fraction of free memory)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 2GiB or 0.8)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value <= 0:
        raise argparse.ArgumentTypeError("memory size must be positive")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    d = EngineSettings()
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"bundled model name, .gguf file or HF folder (default {DEFAULT_MODEL})",
    )
    g.add_argument("--dtype", choices=list(DTYPES), default=d.dtype)
    g.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N (default cpu)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of one step (prefill chunks + decodes)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help="serving: most requests queued beyond what the running batch has room for; more are "
        f"refused with RESOURCE_EXHAUSTED, retry after 1 s (default {d.max_waiting})",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length limit (default: the model's)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_memory,
        default=None,
        help="KV cache size: bytes (2GiB) or fraction of free memory (0.8); "
        "default 0.9 on CUDA, 1GiB on CPU",
    )
    g.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse cached KV blocks of shared prompt prefixes",
    )
    g.add_argument(
        "--no-chunked-prefill",
        dest="enable_chunked_prefill",
        action="store_false",
        help="run each prompt's prefill in one step",
    )


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )


def engine_flags(engine: EngineSettings) -> list[str]:
    """The flags that `engine_settings` turns back into `engine` (to start a worker with)."""
    flags = []
    for f in fields(engine):
        value = getattr(engine, f.name)
        if isinstance(value, bool):
            if not value:
                flags.append(ENGINE_FLAGS[f.name])
        elif value is not None:
            flags += [ENGINE_FLAGS[f.name], str(value)]
    return flags
