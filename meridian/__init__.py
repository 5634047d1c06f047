"""Meridian: serve large language models to many users across regions."""

__version__ = "0.1.0"
