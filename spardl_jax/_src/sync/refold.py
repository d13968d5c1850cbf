"""A saved state restored onto another number of devices: :func:`refold`.

An optimizer state of this library holds per-device leaves (SparDL's ``(P, n)`` residuals,
momentum-correction velocities, an outer loop's per-replica offsets, an accumulator's
per-device gradients). Saved on ``P`` devices and restored onto ``P'``, their leading axis no
longer fits; cutting or padding it (what ``strict=False`` restores do) loses the mass the
rows hold. :func:`refold` rebuilds each such leaf by the rule its state type declares
(:func:`spardl_jax.checkpoint.fold_rules`):

* ``SUM`` (residuals, velocities: per-device sums of gradient mass the next syncs still
  deliver): the ``P`` rows' total, taken in float64, spread evenly over ``P'`` rows, the last
  row absorbing the rounding, so the rows add up to the saved total within one rounding;
* ``SAME`` (the sync's step count, PowerSGD's warm-start factors): every new row gets it, so
  a warm-up or a density schedule goes on where it was;
* ``MEAN`` (what ``optax.MultiSteps`` accumulated, an outer loop's offsets): every new row
  gets the saved rows' mean, so the mean the next sync sees is unchanged;
* ``FRESH`` (the B-SAG controller, Ok-Topk's thresholds, the statistics: they depend on
  ``P``): the freshly initialized value of ``like``.

On a mesh of several axes each column of the data axis (the devices at one position on the
other axes) is folded on its own; only the data axis may change size.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.core import protocol
from spardl_jax._src.sync.placement import fold_rules
from spardl_jax._src.sync.specs import axes_of

__all__ = ['RefoldError', 'as_saved', 'fold_sum', 'paths', 'refold']


class RefoldError(ValueError):
  """A saved state that does not fit ``like`` (another model, method or optimizer)."""


def fold_sum(saved: np.ndarray, devices: int) -> np.ndarray:
  """``(P, ...)`` rows -> ``(devices, ...)`` rows with the same total (in float64), evenly
  spread, the last row absorbing the rounding."""
  total = saved.astype(np.float64).sum(axis=0)
  rows = np.repeat((total / devices).astype(saved.dtype)[None], devices, axis=0)
  rows[-1] = (total - rows[:-1].astype(np.float64).sum(axis=0)).astype(saved.dtype)
  return rows


def _name(key) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  raise TypeError(f"unexpected pytree key {key!r}")


def paths(tree) -> list[str]:
  """Each leaf's path as ``a/b/0``: a NamedTuple's field and a dict's key read alike, so a
  tree read back by a checkpointer as dicts and lists matches the state it was saved from."""
  return ["/".join(_name(k) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _layout(like: jax.Array) -> tuple[int, int, int]:
  """``(data devices, columns, rows per device)`` of a per-device leaf's leading axis: its
  rows are data-major, one block per device of the data axis times the mesh's other axes
  (:mod:`spardl_jax._src.sync.placement`)."""
  sharding = like.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding) or not _per_device(like):
    return 1, 1, like.shape[0]
  axes = axes_of(sharding.spec[0])
  shape = dict(sharding.mesh.shape)
  data, columns = shape[axes[0]], math.prod(shape[a] for a in axes[1:])
  return data, columns, like.shape[0] // (data * columns)


def _per_device(like) -> bool:
  spec = getattr(like.sharding, "spec", None)
  return spec is not None and len(spec) > 0 and spec[0] is not None


def _saved_columns(sharding) -> int | None:
  """The devices on the axes besides the data axis of a leaf's saved sharding: a
  ``NamedSharding``, or a checkpointer's record of one (Orbax's metadata: ``axis_names``,
  ``shape``, ``partition_spec``); None where it does not say."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    names, sizes, spec = sharding.mesh.axis_names, sharding.mesh.axis_sizes, sharding.spec
  elif all(hasattr(sharding, a) for a in ("axis_names", "shape", "partition_spec")):
    names, sizes, spec = sharding.axis_names, sharding.shape, sharding.partition_spec
  else:
    return None
  if not spec or spec[0] is None:
    return None
  shape = dict(zip(names, (int(n) for n in sizes)))
  return math.prod(shape[a] for a in axes_of(spec[0])[1:])


def _fold(rule: str, saved: np.ndarray, like: jax.Array, path: str,
          saved_columns: int | None) -> np.ndarray:
  """A per-device leaf saved on another data-axis size, rebuilt for ``like``."""
  data, columns, per = _layout(like)
  if saved_columns is not None and saved_columns != columns:
    raise RefoldError(
        f"refold: leaf {path} was saved with {saved_columns} devices on the mesh axes "
        f"besides the data axis and is restored onto {columns}; only the data axis may "
        f"change size.")
  old, rest = divmod(saved.shape[0], columns * per)
  if rest or old == 0:
    raise RefoldError(
        f"refold: leaf {path} has {saved.shape[0]} rows saved, which is no whole number of "
        f"devices of {columns} column(s) and {per} row(s) each as here ({like.shape[0]} rows "
        f"on {data} devices of the data axis); only the data axis may change size.")
  if rule == protocol.FRESH:
    return np.asarray(like)
  rows = saved.reshape(old, columns, per, *saved.shape[1:])
  if rule == protocol.SUM:
    flat = rows.reshape(old, columns, -1)
    out = np.stack([fold_sum(flat[:, c], data) for c in range(columns)], axis=1)
  elif rule == protocol.SAME:
    out = np.repeat(rows[:1], data, axis=0)
  elif rule == protocol.MEAN:
    out = np.repeat(rows.mean(axis=0, keepdims=True), data, axis=0)
  else:
    raise ValueError(f"refold: unknown fold rule {rule!r} for leaf {path}.")
  return out.reshape(-1, *saved.shape[1:]).astype(saved.dtype)


@jax.jit
def _non_finite(leaf: jax.Array) -> jax.Array:
  return jnp.sum(~jnp.isfinite(leaf))


def _check_rows(plan, like_leaves, like_paths, rules) -> None:
  """Before anything is built: every per-device leaf agrees on the device count it was
  saved on (a leaf cut to 7 rows beside others of 8 is no state of 7 devices), and none that
  is kept or folded holds a non-finite entry (a residual with a NaN would make every sync
  after the restore skip)."""
  counts = {}
  for (leaf, _), like_leaf, path in zip(plan, like_leaves, like_paths):
    if _per_device(like_leaf):
      _, columns, per = _layout(like_leaf)
      counts[path] = np.shape(leaf)[0] / (columns * per)
  if len(set(counts.values())) > 1:
    shown = ", ".join(f"{path}: {int(c) if c == int(c) else c}" for path, c in counts.items())
    raise RefoldError(f"refold: the saved per-device leaves disagree on the devices they were "
                      f"saved on ({shown}); a whole state saves one count in every leaf "
                      f"(a hand-made or damaged restore?).")
  for (leaf, _), like_leaf, path, rule in zip(plan, like_leaves, like_paths, rules):
    if not _per_device(like_leaf) or rule == protocol.FRESH:
      continue
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      continue
    # A global array of a multi-process job is counted by every process together (each
    # holds only its own rows), so all reach the same verdict.
    bad = int(_non_finite(leaf) if isinstance(leaf, jax.Array) else
              np.size(leaf) - np.isfinite(leaf).sum())
    if bad:
      raise RefoldError(f"refold: leaf {path} holds {bad} non-finite entries (NaN or inf); "
                        f"folded, they would reach every device's rows and every sync after "
                        f"the restore would skip. Restore an earlier checkpoint.")


def refold(saved, like, *, metadata=None):
  """``saved`` (a state restored as saved, on any number of devices) rebuilt onto ``like``'s.

  Leaves are matched by path (``sync/method_state/residual``), so ``saved`` may be the
  state's own structure or what a checkpointer reads back (dicts and lists). A leaf whose
  shape is ``like``'s is taken as it is, put onto ``like``'s sharding; a per-device leaf
  whose leading (device) axis differs is folded by its declared rule (the module docstring):
  residual mass is conserved within one float rounding. Everything is checked before any
  array is built, so a state that cannot be folded is refused in one line and nothing is
  half-restored.

  Example (a user's own loop, Orbax, saved on 8 devices, restored onto 4)::

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, opt_state)                         # on 8 devices
    ...
    like = sj.init_opt_state(tx, params, mesh4)         # on 4 devices
    saved = ckptr.restore(path, sj.checkpoint.as_saved(ckptr.metadata(path), like))
    opt_state = sj.checkpoint.refold(saved, like)

  Args:
    saved: the saved state: jax or NumPy arrays, any shardings (a leaf to fold is read
      whole to the host).
    like: a freshly initialized state on the current devices (``sj.init_opt_state``, or
      a whole train state holding one): its shapes, dtypes and shardings are the result's,
      and its values fill the leaves whose rule is ``FRESH``.
    metadata: optional, what the checkpointer recorded of each leaf (Orbax's
      ``metadata(path)``, matched by path): with each leaf's saved sharding, a state saved on
      another size of an axis besides the data axis is refused (without it, the rows are
      taken as laid out over ``like``'s other axes).

  Returns:
    A state of ``like``'s structure on ``like``'s shardings.

  Raises:
    RefoldError: a leaf is on one side only, or differs in more than its device axis, or
      in dtype, or was saved on another size of an axis besides the data axis; the leaves
      to fold disagree on the device count they were saved on; one of them holds a
      non-finite entry.
  """
  like_leaves, treedef = jax.tree.flatten(like)
  like_paths = paths(like)
  by_path = dict(zip(paths(saved), jax.tree.leaves(saved)))
  if set(by_path) != set(like_paths):
    differ = sorted(set(by_path) ^ set(like_paths))[:3]
    raise RefoldError(f"refold: the saved state is not a state of this structure (another "
                      f"model, method or optimizer?): leaves {differ} are only on one side.")
  rules = jax.tree.leaves(fold_rules(like))
  metadata = getattr(metadata, "item_metadata", metadata)
  recorded = {} if metadata is None else dict(zip(paths(metadata), jax.tree.leaves(metadata)))
  plan = []
  for path, like_leaf, rule in zip(like_paths, like_leaves, rules):
    leaf = by_path[path]
    shape, dtype = tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", np.float32))
    if dtype != like_leaf.dtype:
      raise RefoldError(f"refold: leaf {path} was saved as {dtype} and is {like_leaf.dtype} "
                        f"here; build like with the same dtypes.")
    if shape == like_leaf.shape:
      plan.append((leaf, None))
    elif _per_device(like_leaf) and shape[1:] == like_leaf.shape[1:]:
      plan.append((leaf, rule))
    else:
      raise RefoldError(
          f"refold: leaf {path} has shape {shape} saved and {like_leaf.shape} here; only a "
          f"per-device leaf's leading (device) axis may differ: another model size, or "
          f"another size of the groups whose devices each hold a slice of it (the devices of "
          f"an island; only the island count may change).")
  _check_rows(plan, like_leaves, like_paths, rules)
  folded = [None if rule is None else _fold(
      rule, np.asarray(leaf), like_leaf, path,
      _saved_columns(getattr(recorded.get(path, leaf), "sharding", None)))
            for (leaf, rule), like_leaf, path in zip(plan, like_leaves, like_paths)]
  out = []
  for (leaf, rule), rows, like_leaf in zip(plan, folded, like_leaves):
    if rule is None and isinstance(leaf, jax.Array) and leaf.sharding == like_leaf.sharding:
      out.append(leaf)
      continue
    rows = np.asarray(leaf) if rows is None else rows
    out.append(jax.make_array_from_callback(rows.shape, like_leaf.sharding,
                                            lambda index, a=rows: a[index]))
  return jax.tree.unflatten(treedef, out)


def as_saved(metadata, like, device=None):
  """The target to restore a checkpoint with before :func:`refold`: for every leaf of
  ``like``, a ``jax.ShapeDtypeStruct`` of its saved shape (read from ``metadata``, what
  ``orbax.checkpoint.StandardCheckpointer().metadata(path)`` returns, or any tree of objects
  with ``shape`` and ``dtype`` matched by path) on one local device, in ``like``'s
  structure."""
  metadata = getattr(metadata, "item_metadata", metadata)
  saved = dict(zip(paths(metadata), jax.tree.leaves(metadata)))
  missing = [p for p in paths(like) if p not in saved]
  if missing:
    raise RefoldError(f"refold: the checkpoint holds no leaves {missing[:3]} of this state "
                      f"(another model, method or optimizer?).")
  host = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
  return jax.tree.unflatten(jax.tree.structure(like), [
      jax.ShapeDtypeStruct(tuple(saved[p].shape), saved[p].dtype, sharding=host)
      for p in paths(like)])
