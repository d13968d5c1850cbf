"""A Flax NNX program made data-parallel with a gradient sync by changing two lines: its
optimizer (:class:`Optimizer`, an ``nnx.Optimizer`` whose state is laid out on the mesh,
the sync's rows one per device) and its step's decorator (:func:`data_parallel` in place of
``nnx.jit``). Flax is imported here only: ``import spardl_jax`` does not need it.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spardl_jax._src.parallel.dispatch import bounded_dispatch
from spardl_jax._src.sync.data_parallel import sync_state_filter
from spardl_jax._src.sync.specs import check_axis

__all__ = ['Optimizer', 'data_parallel']


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer(model, tx, wrt=...)`` whose state is built on ``mesh``: a gradient sync
  in ``tx`` (anywhere in a chain) keeps one row per device, sharded over the data axis, and
  the rest is replicated, as :func:`data_parallel`'s step takes them.

  Args:
    model: the NNX model.
    tx: the optax transformation, with a sync over ``axis_name`` (``sj.spardl(...)``,
      ``sj.synced_adamw(...)``, ...).
    mesh: the mesh the step runs on.
    wrt: the filter of the variables to train, as ``nnx.Optimizer``'s.
  """

  def __init__(self, model, tx, mesh: jax.sharding.Mesh, *, wrt, **kwargs):
    with jax.set_mesh(mesh):  # the sync's init builds its rows on the mesh's devices
      super().__init__(model, tx, wrt=wrt, **kwargs)


def _spec(node, axis_name: str):
  """The ``in_specs`` entry of one argument of the step: an optimizer's sync rows over the
  data axis and the rest replicated; other graph nodes (the model, metrics) replicated; an
  array with a leading axis split over the data axis; anything else replicated."""
  if isinstance(node, nnx.Optimizer):
    return nnx.StateSharding({sync_state_filter(node.opt_state): PartitionSpec(axis_name),
                              ...: PartitionSpec()})
  if isinstance(node, nnx.Pytree):
    return PartitionSpec()
  if isinstance(node, jax.Array | np.ndarray) and np.ndim(node) >= 1:
    return PartitionSpec(axis_name)
  return PartitionSpec()


def _place(node, spec, mesh: jax.sharding.Mesh) -> None:
  """Puts a graph node's arrays that are not yet on ``mesh`` where the step leaves them
  (replicated, or the sync's rows over the data axis), so the step's first call and every
  later one take the same shardings and it compiles once (a model built on one device
  would otherwise compile the step a second time, for its own outputs)."""
  def on_mesh(x) -> bool:  # a model sharded over other axes keeps its layout
    return isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh

  def put(state, partition):
    return jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(
        x, NamedSharding(mesh, partition)), state)

  if isinstance(spec, nnx.StateSharding):
    rows_filter, rows, rest = spec.filters[0], *spec.shardings  # as _spec builds it
    row_state, rest_state = nnx.state(node, rows_filter, ...)
    nnx.update(node, put(row_state, rows), put(rest_state, rest))
  else:
    nnx.update(node, put(nnx.state(node), spec))


def _reduced(out, axis_name: str):
  """The step's outputs over the data axis: float arrays averaged (each device's loss of its
  shard), the rest as device 0 has them."""
  return jax.tree.map(lambda x: jax.lax.pmean(x, axis_name) if jnp.issubdtype(
      jnp.result_type(x), jnp.floating) else x, out)


def _metrics_summed(metrics, before, axis_name: str) -> None:
  """Each metric's update on every device, summed into the one metric state: ``old +
  psum(new - old)`` (an ``Average`` then counts every device's values); ``before`` holds
  each metric's state leaves (arrays) from before the step."""
  for metric, old in zip(metrics, before):
    new, treedef = jax.tree.flatten(nnx.state(metric))
    nnx.update(metric, jax.tree.unflatten(treedef, [
        o + jax.lax.psum(n - o, axis_name) for n, o in zip(new, old)]))


def data_parallel(mesh: jax.sharding.Mesh, *, axis_name: str = "data"):
  """A decorator for an NNX train step in place of ``nnx.jit``: the step runs on each data
  shard of its array arguments (a partial-auto ``shard_map`` over ``axis_name``), so the
  gradient it takes is that shard's own, and ``optimizer.update`` syncs it with the sync in
  the optimizer's transformation (:class:`Optimizer`), updating the model in place on every
  device alike. The model stays replicated over the data axis (and sharded over the mesh's
  other axes as its variables are); float outputs are the mean over the data axis;
  ``nnx.Metric`` arguments updated inside count every device's values. On several CPU
  devices of one process the step bounds its own dispatch
  (:func:`spardl_jax.bounded_dispatch`).

  Example (Flax's data-parallel MLP; the dense program is the same with
  ``nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)`` and ``@nnx.jit``):

    >>> import jax, jax.numpy as jnp, numpy as np, optax, spardl_jax as sj
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    >>> optimizer = sj.nnx.Optimizer(model, sj.synced_adamw(1e-2, warmup_steps=2), mesh,
    ...                              wrt=nnx.Param)
    >>> @sj.nnx.data_parallel(mesh)
    ... def train_step(model, optimizer, x, y):
    ...   loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> x = np.ones((16, 4), np.float32)
    >>> first = float(train_step(model, optimizer, x, x[:, :1] * 3))
    >>> for _ in range(50):
    ...   loss = train_step(model, optimizer, x, x[:, :1] * 3)
    >>> bool(float(loss) < first)
    True

  Args:
    mesh: the mesh; array arguments are split over ``axis_name`` along their first axis.
    axis_name: the data axis (the sync's).

  Returns:
    ``decorator(step)``: the step, compiled once per kind of arguments.
  """
  check_axis(mesh, axis_name, "sj.nnx.data_parallel")

  def decorator(fn):
    compiled: dict = {}

    def traced(specs):
      def local(*args):
        metrics = [a for a in args if isinstance(a, nnx.Metric)]
        before = [jax.tree.leaves(nnx.state(m)) for m in metrics]  # the values
        out = fn(*args)
        _metrics_summed(metrics, before, axis_name)
        return _reduced(out, axis_name)

      return nnx.jit(nnx.shard_map(local, mesh=mesh, in_specs=specs,
                                   out_specs=PartitionSpec(), axis_names={axis_name},
                                   check_vma=False))

    placed = weakref.WeakSet()

    @functools.wraps(fn)
    def step(*args):
      specs = tuple(_spec(a, axis_name) for a in args)
      key = tuple(type(a) for a in args)
      if key not in compiled:
        compiled[key] = traced(specs)
      for node, spec in zip(args, specs):
        if isinstance(node, nnx.Pytree) and node not in placed:
          _place(node, spec, mesh)
          placed.add(node)
      split = PartitionSpec(axis_name)
      args = tuple(jax.device_put(a, NamedSharding(mesh, split))
                   if isinstance(s, PartitionSpec) and s == split else a
                   for a, s in zip(args, specs))
      with jax.set_mesh(mesh):
        return compiled[key](*args)

    return bounded_dispatch(step)

  return decorator
