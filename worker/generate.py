"""`meridian generate`: one prompt streamed to stdout, or a JSONL file of prompts run together."""

import argparse
import json
import sys

from meridian.errors import UserError
from meridian.worker.arguments import add_engine_arguments, engine_settings
from meridian.worker.engine.llm_engine import LLMEngine
from meridian.worker.sampling_params import SamplingParams

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument(
        "--prompts-file", help="JSONL: one {'prompt': ...} or {'messages': [...]} per line"
    )
    parser.add_argument("--output", help="with --prompts-file: write results here (default stdout)")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    s = parser.add_argument_group("sampling (defaults for every prompt)")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    defaults = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": tuple(args.stop),
    }
    SamplingParams(**defaults)  # reject bad flags before the model loads
    if args.prompts_file:
        lines = _read_prompts(args.prompts_file)
        engine = LLMEngine(engine_settings(args))
        return _run_file(engine, lines, defaults, args.output)
    engine = LLMEngine(engine_settings(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request("cli", prompt, SamplingParams(**defaults))
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _read_prompts(path: str) -> list[dict]:
    try:
        with open(path) as f:
            raw = [line for line in f if line.strip()]
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from e
    lines = []
    for n, line in enumerate(raw, 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise UserError(f"{path}:{n}: each line needs exactly one of 'prompt' or 'messages'")
        unknown = set(item) - _SAMPLING_KEYS - {"prompt", "messages"}
        if unknown:
            raise UserError(f"{path}:{n}: unknown keys {sorted(unknown)}")
        lines.append(item)
    return lines


def _run_file(engine: LLMEngine, lines: list[dict], defaults: dict, output: str | None) -> int:
    prompts, params = [], []
    for n, item in enumerate(lines, 1):
        try:
            options = {**defaults, **{k: v for k, v in item.items() if k in _SAMPLING_KEYS}}
            if isinstance(options["stop"], list):  # SamplingParams takes a str or tuple
                options["stop"] = tuple(options["stop"])
            params.append(SamplingParams(**options))
            if "messages" in item:
                prompts.append(engine.tokenizer.apply_chat_template(item["messages"]))
            else:
                prompts.append(item["prompt"])
        except (UserError, TypeError) as e:
            raise UserError(f"line {n}: {e}") from e
    results = engine.generate(prompts, params)
    out = open(output, "w") if output else sys.stdout  # noqa: SIM115 - stdout is not ours to close
    try:
        for r in results:
            record = {
                "text": r.text,
                "token_ids": r.token_ids,
                "finish_reason": r.finish_reason,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "cached_tokens": r.cached_tokens,
            }
            out.write(json.dumps(record) + "\n")
    finally:
        if output:
            out.close()
    return 0
