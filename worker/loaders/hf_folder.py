"""Llama-architecture models from a Hugging Face folder: `config.json` + `*.safetensors`
(single file or sharded with `model.safetensors.index.json`)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from meridian.errors import UserError
from meridian.worker.config import ModelConfig

_ARCHITECTURES = {"LlamaForCausalLM"}


def load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(config, float32 weights under HF names, raw config.json) of an HF Llama folder."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise UserError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    raw = json.loads(config_path.read_text())
    archs = set(raw.get("architectures") or [])
    if not archs & _ARCHITECTURES:
        raise UserError(
            f"{folder} holds a {sorted(archs) or raw.get('model_type')} model; "
            "Meridian loads Llama-architecture models only"
        )
    files = _weight_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update({k: v.float() for k, v in load_file(str(f)).items()})
    tie = bool(raw.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensors
    heads = int(raw["num_attention_heads"])
    # transformers >= 5 writes `rope_parameters`; older configs write `rope_theta`/`rope_scaling`.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = raw.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = rope if rope.get("rope_type", rope.get("type")) in ("linear", "llama3") else None
    config = ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_model_len=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tie,
        rope_scaling=scaling,
    )
    return config, tensors, raw


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no *.safetensors weights")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise UserError(f"{folder} is missing weight shards: {', '.join(missing)}")
    return files
