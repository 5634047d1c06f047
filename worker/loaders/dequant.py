"""GGML block formats unpacked into torch tensors, whole tensors at a time (no per-block loops).

Each quantized format stores blocks of 32 weights: a float16 scale `d` (and for Q4_1 a float16
minimum `m`) followed by the packed values. The formulas are GGML's:
  Q8_0: w = d * q             q: int8
  Q4_0: w = d * (q - 8)       q: uint4, low nibbles are weights 0..15, high nibbles 16..31
  Q4_1: w = d * q + m         q: uint4, same packing
"""

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from meridian.errors import UserError

BLOCK = 32
# bytes per block of 32 weights
_BLOCK_BYTES = {QT.Q8_0: 2 + 32, QT.Q4_0: 2 + 16, QT.Q4_1: 2 + 2 + 16}
_PLAIN = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
SUPPORTED = (*_PLAIN, *_BLOCK_BYTES)


def dequantize(data: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """Unpack GGUF tensor bytes into a float32 tensor of `shape` (torch order, outermost first)."""
    if qtype in _PLAIN:
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())
        return raw.view(_PLAIN[qtype]).float().reshape(shape)
    if qtype not in _BLOCK_BYTES:
        names = ", ".join(t.name for t in SUPPORTED)
        raise UserError(f"GGUF quantization {qtype.name} is not supported (supported: {names})")
    blocks = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())
    blocks = blocks.reshape(-1, _BLOCK_BYTES[qtype])  # [n_blocks, bytes]
    return _UNPACK[qtype](blocks).reshape(shape)


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 stored at byte `offset` of every block, as float32: [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 16] bytes -> [n_blocks, 32] values: low nibbles first, then high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return _half(blocks, 0) * q


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]) + _half(blocks, 2)


_UNPACK = {QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1}
