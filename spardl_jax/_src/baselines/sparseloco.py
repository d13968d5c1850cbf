"""SparseLoCo's compressed aggregation: chunked top-k, 2-bit values, every selection gathered.

Each gradient leaf (plus this device's error feedback) is cut into chunks of at most
``chunk`` entries (a leaf of ``s`` entries into ``ceil(s / chunk)`` chunks of nearly equal
length ``c``); each chunk keeps its ``k_c = ceil(density c)`` largest ``|value|`` s (ties to
the lower index), so an index is a position inside its chunk (16 bits) and the selection
of every chunk is independent. The values kept from one leaf are quantized together to
``bits`` bits: centred on their mean, cut into ``2^bits`` bins of width
``sigmas * std / 2^bits`` around it (the outer bins take everything beyond), and each bin
decodes to the mean of the values that fell in it (the leaf's mean and those ``2^bits`` bin
means travel with the codes, ``1 + 2^bits`` float32 a leaf). Every device all-gathers every
device's message (Bruck, ``ceil(log2 P)`` rounds) and adds the ``P`` decoded sparse vectors
in worker order: every entry any device chose survives (their union), where SparDL's result
keeps about ``k`` entries in all.

Each device keeps what it did not send as its error, ``g - decoded`` at the chosen entries
(the quantization error included) and ``g`` elsewhere, so
``sum(errors) + P * y == sum(g)`` up to float rounding, as for every method here. SparseLoCo
decays that error before adding the new pseudo-gradient (``e <- beta e + delta``); here that
is the sync's ``residual_decay`` option, which any method with error feedback takes.

Chunks follow the leaves, so the method binds the leaf shapes with :meth:`for_leaves` (a
flat vector unbound is one leaf), as PowerSGD does.

References:
  Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
  SparseLoCo", arXiv 2508.15706 (chunk-wise top-k of the error-feedback accumulator, 2-bit
  values, aggregation by gathering every replica's selection); the quantizer (mean shift,
  a range in standard deviations, bins decoded to their mean) is their code's statistical
  quantization, its defaults (4,096-entry chunks, 6 standard deviations) ours.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.baselines.common import (PerLeaf, ResidualState, allgather, check_local,
                                         densify, init_residual)
from spardl_jax._src.core import messages, protocol, topk
from spardl_jax._src.core.config import DensityConfig, check_number

__all__ = ['SparseLoCoConfig', 'Piece', 'plan', 'quantize', 'Layout', 'layout', 'formula',
           'SparseLoCo']

BITS = (2, 4, 8, None)  # None: the values as they are, in the gradient's dtype
_MAX_CHUNK = 1 << 16  # a position inside a chunk fits 16 bits


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseLoCoConfig(DensityConfig):
  """Options of SparseLoCo's aggregation.

  Attributes:
    density: fraction of each chunk kept, in (0, 1].
    chunk: most entries of a chunk (an int in [1, 65536]).
    bits: bits per value sent, one of 2, 4, 8, or None (the values unquantized).
    sigmas: the quantizer's range in standard deviations of a leaf's values (> 0).
  """

  chunk: int = 4096
  bits: int | None = 2
  sigmas: float = 6.0

  def __post_init__(self):
    super().__post_init__()
    who = "SparseLoCoConfig"
    check_number(who, "chunk", self.chunk, f"an int in [1, {_MAX_CHUNK}]", integral=True,
                 accept=lambda c: 1 <= c <= _MAX_CHUNK)
    if self.bits not in BITS or isinstance(self.bits, bool):
      raise ValueError(f"{who}: bits must be one of {BITS}, got {self.bits!r}.")
    check_number(who, "sigmas", self.sigmas, "a finite number > 0",
                 accept=lambda s: 0 < s < math.inf)


class Piece(NamedTuple):
  """One leaf of the flat gradient: where it starts, its entries, its chunks' length and
  count, and the entries each chunk keeps."""

  start: int
  size: int
  chunk: int
  chunks: int
  k: int


def plan(shapes, config: SparseLoCoConfig) -> list[Piece]:
  """The leaves of a flat gradient made of ``shapes`` (in order), each cut into chunks of
  nearly equal length (``ceil(size / chunks)``, so the last is short by fewer entries than
  there are chunks)."""
  pieces, start = [], 0
  for shape in shapes:
    size = math.prod(shape)
    if size:
      chunks = -(-size // config.chunk)
      c = -(-size // chunks)
      pieces.append(Piece(start, size, c, chunks, min(c, max(1, math.ceil(config.density * c)))))
    start += size
  return pieces


def quantize(values: jax.Array, segment: jax.Array, segments: int, bits: int,
             sigmas: float) -> tuple[jax.Array, jax.Array]:
  """``values`` ``(m,)``, each in segment ``segment[i]`` (a leaf), to ``bits``-bit codes and
  one table per segment that decodes them.

  Returns:
    ``(codes, tables)``: ``(m,)`` uint32 codes in ``[0, 2^bits)`` and ``(segments, 1 +
    2^bits)`` float32, each segment's mean then each of its bins' mean offset from it (0
    for an empty bin); value ``i`` decodes to ``tables[s, 0] + tables[s, 1 + codes[i]]``
    with ``s = segment[i]``. A NaN or inf among a segment's values makes its mean, and so
    all its decoded values, non-finite.
  """
  bins = 1 << bits
  of = jnp.asarray(segment)
  v = values.astype(jnp.float32)
  count = jnp.zeros((segments,), jnp.float32).at[of].add(1.0)
  shift = jnp.zeros((segments,), jnp.float32).at[of].add(v) / jnp.maximum(count, 1.0)
  centred = v - shift[of]
  var = jnp.zeros((segments,), jnp.float32).at[of].add(centred * centred)
  scale = sigmas * jnp.sqrt(var / jnp.maximum(count - 1.0, 1.0)) / bins
  scale = jnp.where((scale > 0) & jnp.isfinite(scale), scale, 1.0)
  codes = jnp.clip(jnp.round(centred / scale[of]) + bins // 2, 0, bins - 1)
  codes = jnp.where(jnp.isfinite(codes), codes, 0).astype(jnp.uint32)
  sums = jnp.zeros((segments, bins), jnp.float32).at[of, codes].add(centred)
  counts = jnp.zeros((segments, bins), jnp.float32).at[of, codes].add(1.0)
  table = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
  return codes, jnp.concatenate([shift[:, None], table], axis=1)


def _words_of_16(a: jax.Array) -> jax.Array:
  """uint32 words holding a 16-bit unsigned array two to a word (zero-padded)."""
  a = jnp.pad(a.astype(jnp.uint32), (0, a.shape[0] % 2)).reshape(-1, 2)
  return a[:, 0] | (a[:, 1] << 16)


def _from_words_of_16(w: jax.Array, m: int) -> jax.Array:
  return jnp.stack([w & 0xFFFF, w >> 16], axis=1).reshape(-1)[:m]


def _value_words(values: jax.Array) -> jax.Array:
  """The values' bits as uint32 words (16-bit floats two to a word)."""
  if values.dtype.itemsize == 2:
    return _words_of_16(jax.lax.bitcast_convert_type(values, jnp.uint16))
  return jax.lax.bitcast_convert_type(values, jnp.uint32).reshape(-1)


def _values_from_words(w: jax.Array, m: int, dtype) -> jax.Array:
  itemsize = np.dtype(dtype).itemsize
  if itemsize == 2:
    return jax.lax.bitcast_convert_type(_from_words_of_16(w, m).astype(jnp.uint16), dtype)
  words = w[:m * itemsize // 4]
  return jax.lax.bitcast_convert_type(words if itemsize == 4 else words.reshape(m, -1), dtype)


class Layout(NamedTuple):
  """Where one bound method's chunks sit: ``pieces`` grouped by (chunk length, k), each
  group one batched selection, and per chunk its first position, the end of its leaf and
  its leaf. Every table is per chunk (``n / chunk`` entries), so nothing the size of the
  gradient is built into the program."""

  groups: tuple[tuple[int, int, tuple[int, ...]], ...]  # (c, k, indices into pieces)
  pieces: tuple[Piece, ...]
  chunk_start: np.ndarray  # (chunks,) flat position of each chunk's first entry
  chunk_end: np.ndarray  # (chunks,) where its leaf ends: positions past it are padding
  chunk_leaf: np.ndarray  # (chunks,) its leaf

  @property
  def kept(self) -> int:
    """K, the entries each device sends."""
    return sum(self.pieces[i].chunks * k for _, k, members in self.groups for i in members)

  def words(self, bits: int | None, itemsize: int) -> int:
    """uint32 words of one device's message: 16-bit positions, then the values (codes, or
    the values themselves), then one decoding table per leaf."""
    k = self.kept
    if bits is None:
      return -(-k // 2) + -(-k * itemsize // 4)
    return -(-k // 2) + -(-k * bits // 32) + len(self.pieces) * (1 + (1 << bits))

  def slots(self) -> jax.Array:
    """The chunk of each entry sent, ``(K,)`` int32 in message order (group by group, chunk
    by chunk, the tables' order), from an iota: no table of K entries in the program."""
    chunks, first = [], 0
    for _, k, members in self.groups:
      count = sum(self.pieces[i].chunks for i in members)
      chunks.append(first + jnp.arange(count * k, dtype=jnp.int32) // k)
      first += count
    return jnp.concatenate(chunks)


def layout(pieces: list[Piece]) -> Layout:
  """The :class:`Layout` of a flat vector cut into ``pieces``; its per-chunk tables list the
  chunks group by group."""
  by_size: dict[tuple[int, int], list[int]] = {}
  for i, piece in enumerate(pieces):
    by_size.setdefault((piece.chunk, piece.k), []).append(i)
  groups = tuple((c, k, tuple(members)) for (c, k), members in by_size.items())
  order = [i for _, _, members in groups for i in members]
  table = lambda per_piece: np.asarray(  # noqa: E731
      [v for i in order for v in per_piece(i, pieces[i])], np.int32)
  return Layout(groups, tuple(pieces),
                table(lambda i, p: [p.start + j * p.chunk for j in range(p.chunks)]),
                table(lambda i, p: [p.start + p.size] * p.chunks),
                table(lambda i, p: [i] * p.chunks))


def formula(p: int, n: int, config: SparseLoCoConfig, itemsize: int = 4, *,
            shapes=None) -> protocol.Cost:
  """Per-device ``rounds`` and ``bytes`` sent: ``ceil(log2 P)`` rounds and ``P - 1``
  messages (:meth:`Layout.words`) for leaves of ``shapes`` (None: one leaf of ``n``)."""
  lay = layout(plan(shapes if shapes is not None else ((n,),), config))
  return protocol.Cost((p - 1).bit_length(), (p - 1) * 4 * lay.words(config.bits, itemsize))


@protocol.register
@dataclasses.dataclass(frozen=True)
class SparseLoCo(PerLeaf):
  """SparseLoCo's chunked top-k with low-bit values, all-gathered, as a registered
  all-reduce (options: :class:`SparseLoCoConfig`)."""

  name: ClassVar[str] = "sparseloco"
  summary: ClassVar[str] = "chunked top-k, 2-bit values, all-gather (SparseLoCo)"
  Config: ClassVar[type] = SparseLoCoConfig
  # A NaN or inf ranks first in its chunk, so it is sent: as itself, or as its leaf's mean,
  # which it makes non-finite, and with it every value of the leaf.
  nonfinite_reaches_result: ClassVar[bool] = True
  sparse: ClassVar[bool] = True
  config: SparseLoCoConfig
  shapes: tuple | None = None

  def paper_cost(self, *, p: int, n: int, k: int) -> None:
    """Not in the paper."""
    del p, n, k

  def init(self, *, n: int, dtype, p: int) -> ResidualState:
    self.leaf_shapes(n)
    return init_residual(n, p, self.config, dtype)

  def apply(self, x, state, *, axis_name):
    check_local("sparseloco", x, state.residual)
    n, dtype, bits = x.shape[0], x.dtype, self.config.bits
    lay = layout(plan(self.leaf_shapes(n), self.config))
    g = x + state.residual
    at, values = [], []
    for c, k, members in lay.groups:
      # The group's chunks as rows: each leaf's slice, zero-padded to whole chunks (padding
      # never wins over a real entry: it sits after them and ties go to the lower index).
      rows = jnp.concatenate([
          jnp.pad(g[lay.pieces[i].start:lay.pieces[i].start + lay.pieces[i].size],
                  (0, lay.pieces[i].chunks * c - lay.pieces[i].size)).reshape(-1, c)
          for i in members])
      chosen, kept = topk.block_topk(rows, jnp.arange(rows.shape[0], dtype=jnp.int32), k,
                                     topk.chunk_size(c, k))
      at.append(chosen.reshape(-1))
      values.append(kept.reshape(-1))
    at, values = jnp.concatenate(at), jnp.concatenate(values)  # in Layout.slots' order
    words = [_words_of_16(at)]
    if bits is None:
      words.append(_value_words(values))
    else:
      leaf = jnp.asarray(lay.chunk_leaf)[lay.slots()]
      codes, tables = quantize(values, leaf, len(lay.pieces), bits, self.config.sigmas)
      words += [messages.pack_fields(codes[None], bits, jnp.uint32)[0],
                jax.lax.bitcast_convert_type(tables, jnp.uint32).reshape(-1)]
    message = jnp.concatenate(words)
    # What this device sent, as every receiver decodes it: its error keeps the rest.
    pos, sent = self._read(message, lay, n, dtype)
    received = allgather(message[None], axis_name)
    got = jax.vmap(lambda row: self._read(row, lay, n, dtype))(received)
    y = densify(n, *got, dtype) / jax.lax.axis_size(axis_name)
    return y, ResidualState(g.at[pos].add(-sent, mode="drop"))

  def _read(self, row, lay: Layout, n: int, dtype) -> tuple[jax.Array, jax.Array]:
    """``(positions, values)`` ``(K,)`` of one message; a padding slot's position is ``n``
    (dropped where it is added)."""
    k, bits = lay.kept, self.config.bits
    chunk = lay.slots()
    split = -(-k // 2)
    pos = jnp.asarray(lay.chunk_start)[chunk] + _from_words_of_16(row[:split], k).astype(
        jnp.int32)
    pos = jnp.where(pos < jnp.asarray(lay.chunk_end)[chunk], pos, n)
    rest = row[split:]
    if bits is None:
      return pos, _values_from_words(rest, k, dtype)
    split = -(-k * bits // 32)
    codes = messages.unpack_fields(rest[None, :split], bits, k)[0]
    tables = jax.lax.bitcast_convert_type(rest[split:], jnp.float32).reshape(len(lay.pieces), -1)
    leaf = jnp.asarray(lay.chunk_leaf)[chunk]
    return pos, (tables[leaf, 0] + tables[leaf, 1 + codes]).astype(dtype)

  def formula(self, *, p: int, n: int, itemsize: int) -> protocol.Cost:
    return formula(p, n, self.config, itemsize, shapes=self.leaf_shapes(n))

  def stats(self, *, n: int, p: int, itemsize: int, state, rank):
    del state, rank
    return self.formula(p=p, n=n, itemsize=itemsize).bytes, 0
