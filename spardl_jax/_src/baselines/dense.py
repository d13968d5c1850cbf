"""Dense all-reduces: ``pmean``, the reference every sparse all-reduce is measured against,
and ``dense_bf16``, what users pick instead of sparsity (half the bytes, no bookkeeping)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from spardl_jax._src.core import protocol

__all__ = ['formula', 'Dense', 'ring_formula', 'ring_allreduce', 'DenseBF16']


def formula(p: int, n: int, itemsize: int = 4) -> protocol.Cost:
  """A ring all-reduce: ``2 (P - 1)`` rounds, ``2 (P - 1) / P * n`` elements per device."""
  return protocol.Cost(2 * (p - 1), 2 * (p - 1) * n * itemsize // p)


@dataclasses.dataclass(frozen=True)
class _Stateless(protocol.FlatVector):
  """What the dense all-reduces share: no options, no state, the same bytes on every
  device (their ``formula``), and every NaN or inf reaching the sum."""

  Config: ClassVar[None] = None
  # Each subclass's cost (declared here for the type checker).
  formula: ClassVar[Callable[..., protocol.Cost]]
  nonfinite_reaches_result: ClassVar[bool] = True  # a sum with a NaN or inf is not finite
  sparse: ClassVar[bool] = False
  config: None = None

  def init(self, *, n: int, dtype, p: int) -> tuple:
    del n, dtype, p
    return ()

  def stats(self, *, n: int, p: int, itemsize: int, state, rank):
    del state, rank
    return self.formula(p=p, n=n, itemsize=itemsize).bytes, 0

  def paper_cost(self, *, p: int, n: int, k: int) -> protocol.PaperCost:
    """Not in Table 1: the ring all-reduce's ``2 (P - 1)`` rounds and ``2 (P - 1) / P n``
    elements (bfloat16 halves their bytes, not their count)."""
    del k
    return protocol.PaperCost(2 * (p - 1), (2 * (p - 1) / p * n,) * 2)


@protocol.register
@dataclasses.dataclass(frozen=True)
class Dense(_Stateless):
  """``jax.lax.pmean`` (an XLA all-reduce), with no state and no options."""

  name: ClassVar[str] = "dense"
  summary: ClassVar[str] = "pmean (ring all-reduce)"

  def apply(self, x, state, *, axis_name):
    return jax.lax.pmean(x, axis_name), state

  def formula(self, *, p: int, n: int, itemsize: int) -> protocol.Cost:
    return formula(p, n, itemsize)


def ring_formula(p: int, n: int, value_bytes: int = 2) -> protocol.Cost:
  """A ring all-reduce in ``ppermute``s: ``2 (P - 1)`` rounds of one ``ceil(n / P)`` chunk."""
  return protocol.Cost(2 * (p - 1), 2 * (p - 1) * -(-n // p) * value_bytes)


def ring_allreduce(chunks: jax.Array, axis_name) -> jax.Array:
  """The sum over the axis of every device's ``(P, c)`` chunks, in their dtype, by a ring:
  ``P - 1`` reduce-scatter steps (each device adds what its left neighbour sends to its own
  copy of that chunk) then ``P - 1`` all-gather steps. Chunk ``j`` is summed once, in ring
  order from device ``j``, and copied to everyone, so the result is bit-identical on every
  device."""
  p = chunks.shape[0]
  rank = jax.lax.axis_index(axis_name)
  right = [(i, (i + 1) % p) for i in range(p)]
  word = jnp.dtype(f"uint{8 * chunks.dtype.itemsize}")

  def pass_right(chunk):
    # As unsigned words: XLA:CPU widens a bfloat16 collective to float32 (twice the bytes).
    sent = jax.lax.bitcast_convert_type(chunk, word)
    return jax.lax.bitcast_convert_type(jax.lax.ppermute(sent, axis_name, right), chunk.dtype)

  for step in range(p - 1):  # reduce-scatter
    chunks = chunks.at[(rank - step - 1) % p].add(pass_right(chunks[(rank - step) % p]))
  for step in range(p - 1):  # all-gather: device r finished chunk r + 1
    chunks = chunks.at[(rank - step) % p].set(pass_right(chunks[(rank + 1 - step) % p]))
  return chunks


@protocol.register
@dataclasses.dataclass(frozen=True)
class DenseBF16(_Stateless):
  """A dense all-reduce in bfloat16, as PyTorch DDP's ``bf16_compress_hook`` and Horovod's
  compression do: each device divides its gradient by ``P``, casts it to bfloat16, the
  devices sum it in bfloat16, and the sum is cast back to the gradient's dtype. The cast
  error is not fed back (those hooks keep no residual): it is lost, up to 2^-9 of each value.

  The sum is a ring of ``ppermute``s of bfloat16 bit patterns (:func:`ring_allreduce`), not
  ``psum``: XLA:CPU widens a bfloat16 all-reduce, and a bfloat16 collective-permute, to
  float32 before it communicates (measured in the compiled program), which would send
  dense's bytes and measure nothing.

  References:
    PyTorch, ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook``.
  """

  name: ClassVar[str] = "dense_bf16"
  summary: ClassVar[str] = "pmean in bfloat16, cast error not fed back"

  def apply(self, x, state, *, axis_name):
    p, n = jax.lax.axis_size(axis_name), x.shape[0]
    c = -(-n // p)
    chunks = jnp.pad(x / p, (0, p * c - n)).astype(jnp.bfloat16).reshape(p, c)
    return ring_allreduce(chunks, axis_name).reshape(-1)[:n].astype(x.dtype), state

  def formula(self, *, p: int, n: int, itemsize: int) -> protocol.Cost:
    del itemsize  # bfloat16 on the wire, whatever the gradient's dtype
    return ring_formula(p, n)
