"""Communication traffic measured from a compiled XLA program.

Reads the text of ``jax.jit(f).lower(*args).compile().as_text()`` and lists every collective
op with its operand shapes, so the cost of an all-reduce is *measured* (bytes each device
sends, rounds) rather than taken from a formula. ``collective-permute`` ops (what
``jax.lax.ppermute`` lowers to) carry their ``source_target_pairs``; the others (all-reduce,
all-gather, ...) are listed so tests can assert no dense collective hides in a program.

Example (8 devices, each sending its 4 float32 to the next):

  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8],
  ...                      axis_types=(jax.sharding.AxisType.Auto,))
  >>> ring = [(i, (i + 1) % 8) for i in range(8)]
  >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "data", ring), mesh=mesh,
  ...                           in_specs=P("data"), out_specs=P("data")))
  >>> t = parse_hlo(f.lower(jnp.zeros((8, 4))).compile().as_text())
  >>> t.rounds, t.bytes_sent(0)
  (1, 16)
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ['COLLECTIVE_PERMUTE', 'OTHER_COLLECTIVES', 'ArrayType', 'Collective', 'Traffic',
           'parse_hlo']

# Byte sizes of XLA primitive types.
_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_F8 = re.compile(r"f8e\w+|f4e\w+")

COLLECTIVE_PERMUTE = ("collective-permute", "collective-permute-start")
OTHER_COLLECTIVES = (
    "all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter",
    "all-to-all", "ragged-all-to-all", "collective-broadcast",
)

# `%name = SHAPE opcode(operands), attributes` (ROOT optional); SHAPE may be a tuple.
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+"
    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_ARRAY = re.compile(r"(?P<dtype>[a-z]\w*)\[(?P<dims>[\d,]*)\]")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>[\d,{}\s]*)\}")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")


@dataclasses.dataclass(frozen=True)
class ArrayType:
  """One array type of the HLO text, e.g. ``u32[2,18]``."""

  dtype: str
  dims: tuple[int, ...]

  @property
  def elements(self) -> int:
    return math.prod(self.dims)

  @property
  def bytes(self) -> int:
    size = _BYTES.get(self.dtype, 1 if _F8.fullmatch(self.dtype) else None)
    if size is None:
      raise ValueError(f"unknown HLO element type {self.dtype!r}")
    return self.elements * size


def _array_types(shape: str) -> list[ArrayType]:
  return [ArrayType(m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d))
          for m in _ARRAY.finditer(shape)]


@dataclasses.dataclass(frozen=True)
class Collective:
  """A collective op of the program.

  Attributes:
    name: the instruction name.
    op: the opcode (``collective-permute``, ``all-reduce``, ...).
    computation: the HLO computation holding it (branches of a conditional differ).
    operands: the array types of its operands (resolved by name).
    pairs: ``(source, target)`` device pairs of a collective-permute, else ``()``.
  """

  name: str
  op: str
  computation: str
  operands: tuple[ArrayType, ...]
  pairs: tuple[tuple[int, int], ...] = ()

  @property
  def bytes(self) -> int:
    """Bytes of the operands: what one participating device sends in this op."""
    return sum(a.bytes for a in self.operands)

  @property
  def elements(self) -> int:
    return sum(a.elements for a in self.operands)


@dataclasses.dataclass(frozen=True)
class Traffic:
  """All collectives of a compiled program, in program order.

  Attributes:
    permutes: the collective-permutes (one per ``ppermute`` round), of every branch.
    others: every other collective (all-reduce, all-gather, ...).
    switches: for each ``conditional`` (``lax.switch``/``cond``) with a collective-permute
      in a branch, its branch computation names in branch order.
  """

  permutes: tuple[Collective, ...]
  others: tuple[Collective, ...]
  switches: tuple[tuple[str, ...], ...] = ()

  def branch(self, index: int) -> "Traffic":
    """The traffic of a run that takes branch ``index`` of every switch."""
    inside = {name for switch in self.switches for name in switch}
    chosen = {switch[index] for switch in self.switches}
    return Traffic(tuple(c for c in self.permutes
                         if c.computation not in inside or c.computation in chosen),
                   self.others)

  @property
  def rounds(self) -> int:
    """Number of collective-permute rounds."""
    return len(self.permutes)

  def bytes_sent(self, device: int) -> int:
    """Bytes ``device`` sends over all collective-permutes."""
    return sum(c.bytes for c in self.permutes if any(s == device for s, _ in c.pairs))

  def bytes_received(self, device: int) -> int:
    """Bytes ``device`` receives over all collective-permutes."""
    return sum(c.bytes for c in self.permutes if any(t == device for _, t in c.pairs))

  def elements_sent(self, device: int) -> int:
    """Elements (of any type) ``device`` sends over all collective-permutes."""
    return sum(c.elements for c in self.permutes if any(s == device for s, _ in c.pairs))

  def largest_other(self) -> int:
    """Element count of the largest operand of any non-permute collective (0 if none)."""
    return max((c.elements for c in self.others), default=0)


def parse_hlo(text: str) -> Traffic:
  """Lists the collectives of an HLO module's text (``compiled.as_text()``)."""
  types: dict[str, str] = {}
  found: list[tuple[str, str, str, str, str]] = []
  conditionals: list[tuple[str, ...]] = []
  computation = ""
  for line in text.splitlines():
    instr = _INSTR.match(line)
    if instr is None:
      header = _COMPUTATION.match(line)
      if header is not None:
        computation = header["name"]
      continue
    types[instr["name"]] = instr["shape"]
    if instr["op"] == "conditional":
      branches = _BRANCHES.search(instr["attrs"])
      if branches is not None:
        conditionals.append(tuple(b.strip().lstrip("%") for b in branches["names"].split(",")))
    if instr["op"] in COLLECTIVE_PERMUTE + OTHER_COLLECTIVES:
      found.append((instr["name"], instr["op"], computation, instr["operands"], instr["attrs"]))
  permutes, others = [], []
  for name, op, comp, operands, attrs in found:
    operand_types = []
    for operand in operands.split(","):
      operand = operand.strip().split(" ")[-1].lstrip("%")
      if operand:
        if operand not in types:
          raise ValueError(f"HLO operand {operand!r} of {name!r} is not defined in the text")
        operand_types.extend(_array_types(types[operand]))
    if op in COLLECTIVE_PERMUTE:
      pairs = _PAIRS.search(attrs)
      if pairs is None:
        raise ValueError(f"collective-permute {name!r} has no source_target_pairs")
      pair_list = tuple((int(a), int(b)) for a, b in
                        re.findall(r"\{(\d+),(\d+)\}", pairs["pairs"]))
      permutes.append(Collective(name, op, comp, tuple(operand_types), pair_list))
    else:
      others.append(Collective(name, op, comp, tuple(operand_types)))
  with_permutes = {c.computation for c in permutes}
  switches = tuple(c for c in conditionals if with_permutes.intersection(c))
  return Traffic(tuple(permutes), tuple(others), switches)
