"""meridian.v1: generated from `api/meridian/v1/*.proto` by `python -P -m meridian.api.generate`."""

from meridian.api.v1 import inference_pb2 as pb
from meridian.api.v1 import inference_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
