import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from meridian.errors import UserError
from meridian.worker.loaders.dequant import dequantize

# odd row counts and several blocks per row
SHAPES = [(1, 32), (3, 64), (7, 96), (5, 1024)]


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
@pytest.mark.parametrize("shape", SHAPES)
def test_block_formats_match_gguf_reference_exactly(qtype, shape):
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32)
    packed = quants.quantize(weights, qtype)
    ours = dequantize(packed, qtype, shape)
    ref = torch.from_numpy(quants.dequantize(packed, qtype).astype(np.float32))
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16])
def test_plain_formats_round_trip(qtype):
    weights = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    packed = quants.quantize(weights, qtype)
    ours = dequantize(packed, qtype, (3, 5))
    ref = torch.from_numpy(quants.dequantize(packed, qtype).astype(np.float32))
    assert torch.equal(ours, ref)


def test_unsupported_quantization_names_the_type():
    packed = np.zeros((1, 210), dtype=np.uint8)
    with pytest.raises(UserError, match="Q6_K is not supported"):
        dequantize(packed, QT.Q6_K, (1, 256))
