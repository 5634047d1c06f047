"""Fixtures for the operator's fast tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def spec() -> dict[str, Any]:
    """A three-region spec; tests change what they are about."""
    return {
        "model": {"name": "smollm2-135m-instruct"},
        "image": "meridian:0.1.0",
        "resources": {"gpus": 1, "cpu": "2", "memory": "8Gi"},
        "regions": [
            {"name": "us-east", "replicas": 2},
            {"name": "eu-west", "replicas": 2},
            {"name": "ap-south", "replicas": 1},
        ],
    }
