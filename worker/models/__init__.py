"""Build a runnable model from a loaded checkpoint."""

import torch

from meridian.errors import UserError
from meridian.worker.layers.rotary import RotaryEmbedding, inverse_frequencies
from meridian.worker.loaders import Checkpoint
from meridian.worker.models.llama import LlamaForCausalLM


def build_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    cfg = ckpt.config
    tensors = dict(ckpt.tensors)
    inv_freq = inverse_frequencies(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, tensors.pop("rope_freqs", None)
    )
    rotary = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, inv_freq).to(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, rotary)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = {
        k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    missing, unexpected = expected - tensors.keys(), tensors.keys() - expected
    if missing or unexpected:
        raise UserError(
            f"{ckpt.path}: weights do not fit the Llama layout "
            f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})"
        )
    for name, t in tensors.items():
        want = model.get_parameter(name).shape
        if t.shape != want:
            raise UserError(
                f"{ckpt.path}: {name} has shape {tuple(t.shape)}, expected {tuple(want)}"
            )
    model.load_state_dict(
        {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, strict=False, assign=True
    )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
