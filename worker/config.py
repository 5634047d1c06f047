"""The shape of a Llama-architecture model, read from GGUF metadata or an HF `config.json`."""

from dataclasses import dataclass

from meridian.errors import UserError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_model_len: int
    tie_word_embeddings: bool
    # HF `rope_scaling` dict ({"rope_type": "linear" | "llama3", ...}) or None.
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"model has {self.num_heads} attention heads, not a multiple of its "
                f"{self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise UserError(f"head dimension {self.head_dim} must be even for rotary embeddings")

    def kv_bytes_per_token(self, element_size: int) -> int:
        """KV-cache bytes one token takes across all layers (K and V) at `element_size` bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size
