"""Flax models of the paper's training cases and of the demo (see :mod:`models.registry`)."""

from models.registry import MODELS, ModelSpec, count, create, describe, spec

__all__ = ["MODELS", "ModelSpec", "count", "create", "describe", "spec"]
