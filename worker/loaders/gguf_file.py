"""Llama-architecture models from a GGUF file: config from `llama.*` metadata, weights unpacked to
float32 under Hugging Face names, and the tokenizer the file carries."""

from pathlib import Path

import torch
from gguf import GGUFReader

from meridian.errors import UserError
from meridian.worker.config import ModelConfig
from meridian.worker.loaders.dequant import dequantize

# GGUF tensor name (per block) -> Hugging Face Llama name
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def read_metadata(reader: GGUFReader) -> dict:
    """Every key/value field of the file as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items() if field.types}


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(config, float32 weights under HF names, metadata) of a Llama-architecture GGUF file."""
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise UserError(f"{path} is not a readable GGUF file: {e}") from e
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UserError(
            f"{path} holds a {arch!r} model; Meridian loads Llama-architecture models only"
        )
    config = _config(meta, has_output="output.weight" in {t.name for t in reader.tensors})
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        weight = dequantize(t.data, t.tensor_type, shape)
        tensors[_hf_name(t.name)] = weight
    _undo_rope_permutation(tensors, config)
    return config, tensors, meta


def _config(meta: dict, has_output: bool) -> ModelConfig:
    def need(key: str):
        if key not in meta:
            raise UserError(f"GGUF metadata lacks {key!r}; the file is incomplete")
        return meta[key]

    hidden = int(need("llama.embedding_length"))
    heads = int(need("llama.attention.head_count"))
    vocab = meta.get("llama.vocab_size") or len(need("tokenizer.ggml.tokens"))
    scaling = None
    if meta.get("llama.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("llama.feed_forward_length")),
        num_layers=int(need("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(need("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_model_len=int(need("llama.context_length")),
        tie_word_embeddings=not has_output,
        rope_scaling=scaling,
    )


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise UserError(f"unexpected tensor {name!r} in a Llama GGUF file")


def _undo_rope_permutation(tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """llama.cpp's converter reorders Q and K rows so rotary pairs sit side by side (GGML's rope
    rotates adjacent elements); put them back in HF order, where pairs are half a head apart."""
    for i in range(config.num_layers):
        for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            w = tensors[name]  # [heads * head_dim, hidden]
            half = config.head_dim // 2
            tensors[name] = (
                w.reshape(heads, half, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape).contiguous()
            )
