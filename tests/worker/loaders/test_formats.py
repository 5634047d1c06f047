"""A small random Llama saved as an HF safetensors folder and as GGUF (F32, Q8_0, Q4_1) loads into
the same model: logits match the unquantized original within what each format allows."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, quants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

from meridian.errors import UserError
from meridian.worker.layers.attention import AttentionBatch
from meridian.worker.loaders import load_checkpoint
from meridian.worker.models import build_model

VOCAB = 256
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
BYTE_TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 single-character tokens
PROMPT = list(range(3, 40, 2))

# Relative RMS error each format's logits may have against the float32 original (measured on this
# random model: 0 for lossless formats, about 0.012 for Q8_0 and 0.17 for Q4_1), and the share of
# positions whose most likely token must still agree.
TOLERANCE = {"safetensors": 1e-6, "sharded": 1e-6, QT.F32: 1e-6, QT.Q8_0: 0.03, QT.Q4_1: 0.3}
AGREEMENT = {"safetensors": 1.0, "sharded": 1.0, QT.F32: 1.0, QT.Q8_0: 0.9, QT.Q4_1: 0.5}


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    with torch.no_grad():  # the default init is so small that every logit is near zero
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        logits = model(torch.tensor([PROMPT])).logits[0]
    return model, logits


def write_hf_folder(model, folder, shard: bool) -> None:
    model.save_pretrained(folder, max_shard_size="100KB" if shard else "1GB")
    fast = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(BYTE_TOKENS)}, merges=[]))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    fast.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": BYTE_TOKENS[0]}))


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (adjacent rotary pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(model, path, qtype: QT) -> None:
    c = CONFIG
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(BYTE_TOKENS)
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([])
    w.add_eos_token_id(0)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if name in names:
            gguf_name = names[name]
        else:
            _, _, i, *rest = name.split(".")
            gguf_name = f"blk.{i}.{layer['.'.join(rest[:-1])]}.weight"
        if "q_proj" in name:
            data = llama_cpp_permute(data, c["num_attention_heads"])
        if "k_proj" in name:
            data = llama_cpp_permute(data, c["num_key_value_heads"])
        if data.ndim == 2 and qtype != QT.F32:
            w.add_tensor(gguf_name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def our_logits(path) -> torch.Tensor:
    model = build_model(load_checkpoint(str(path)), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        ids = torch.tensor(PROMPT)
        hidden = model(ids, torch.arange(len(PROMPT)), AttentionBatch.uncached_prompt(len(PROMPT)))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", QT.F32, QT.Q8_0, QT.Q4_1])
def test_logits_match_unquantized_model(tmp_path, reference, fmt):
    model, ref = reference
    if isinstance(fmt, str):
        path = tmp_path / "hf"
        write_hf_folder(model, path, shard=fmt == "sharded")
        if fmt == "sharded":
            assert (path / "model.safetensors.index.json").exists()
    else:
        path = tmp_path / f"model-{fmt.name}.gguf"
        write_gguf(model, path, fmt)
    ours = our_logits(path)
    error = ((ours - ref).norm() / ref.norm()).item()  # relative RMS error
    assert error <= TOLERANCE[fmt], f"{fmt}: relative error {error:.2e}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= AGREEMENT[fmt]


def test_non_llama_gguf_is_rejected(tmp_path):
    path = tmp_path / "other.gguf"
    w = GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        UserError, match="'qwen2' model; Meridian loads Llama-architecture models only"
    ):
        load_checkpoint(str(path))


def test_unsupported_quantization_in_a_file_is_rejected(tmp_path, reference):
    path = tmp_path / "q5.gguf"
    write_gguf(reference[0], path, QT.Q5_0)
    with pytest.raises(UserError, match="Q5_0 is not supported"):
        load_checkpoint(str(path))


def test_missing_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_checkpoint(str(tmp_path / "nope.gguf"))
