"""Flax models of the training cases, by command-line name."""

from models.registry import MODELS, create

__all__ = ["MODELS", "create"]
