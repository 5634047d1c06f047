"""The `meridian` command as a user runs it: output on stdout, one-line errors, exit codes."""

import json
import subprocess
import sys

import pytest
from gguf import GGUFWriter

MERIDIAN = [sys.executable, "-P", "-m", "meridian.cli"]


def meridian(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*MERIDIAN, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, fragment: str) -> None:
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0]


def test_help_lists_subcommands_and_version_works():
    help_text = meridian("--help").stdout
    for command in ("generate", "operator"):
        assert command in help_text
    assert meridian("--version").stdout.startswith("meridian ")


def test_missing_model_path(tmp_path):
    assert_one_line_error(
        meridian("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x"), "not found"
    )


def test_non_llama_gguf(tmp_path):
    path = tmp_path / "qwen.gguf"
    w = GGUFWriter(str(path), "qwen2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(
        meridian("generate", "--model", str(path), "--prompt", "x"), "Llama-architecture"
    )


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    assert_one_line_error(
        meridian("generate", "--model", str(path), "--prompt", "x"), "not a readable GGUF"
    )


def test_bad_sampling_flag_fails_before_loading():
    assert_one_line_error(
        meridian("generate", "--prompt", "x", "--temperature", "-1"), "temperature"
    )


@pytest.mark.slow
def test_prompt_longer_than_context():
    result = meridian("generate", "--prompt", "word " * 9000, "--max-tokens", "4")
    assert_one_line_error(result, "exceeds the context length")


@pytest.mark.slow
def test_chat_answer_mentions_paris():
    result = meridian(
        "generate",
        "--model",
        "smollm2-135m-instruct",
        "--chat",
        "--prompt",
        "What is the capital of France?",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_prompts_file_keeps_input_order(tmp_path):
    lines = [
        {"prompt": "The capital of France is", "max_tokens": 6},
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
        },
        {"prompt": "1, 2, 3,", "max_tokens": 3, "stop": [","]},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    result = meridian("generate", "--prompts-file", str(src), "--output", str(out))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 3
    assert set(rows[0]) == {
        "text",
        "token_ids",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
    }
    assert rows[0]["completion_tokens"] == 6 and rows[0]["finish_reason"] == "length"
    assert "Paris" in rows[1]["text"]
    assert rows[2]["finish_reason"] == "stop" and "," not in rows[2]["text"]


def test_malformed_prompts_file(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "ok"}\n{not json}\n')
    assert_one_line_error(meridian("generate", "--prompts-file", str(src)), "bad.jsonl:2")
