"""Where a device takes its gradient: the parameters, moved by whatever in the optimizer says
so. An outer loop takes each replica's gradient at its own parameters (the global ones plus
its offset); a look-ahead one step ahead of them. Each registers how it moves the point, in
its order, so the generic step (:func:`~spardl_jax.data_parallel_step`) and a user's own step
ask :func:`gradient_point` and know neither."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ['gradient_point', 'moves_the_point']

Move = Callable  # (tx, opt_state, params) -> params
_MOVES: list[tuple[int, Move]] = []


def moves_the_point(order: int) -> Callable[[Move], Move]:
  """Registers ``move(tx, opt_state, params) -> params`` (``params`` unchanged where ``tx``
  or ``opt_state`` holds nothing of it); :func:`gradient_point` applies the moves by
  ``order``, lowest first."""
  def register(move: Move) -> Move:
    _MOVES.append((order, move))
    _MOVES.sort(key=lambda m: m[0])
    return move
  return register


def gradient_point(tx, opt_state, params):
  """The point this device takes its gradient at, inside the data-parallel ``shard_map``:
  ``params`` moved by every registered move in order — an outer loop's replica
  (:func:`~spardl_jax.points.replica_params`), then a look-ahead from there
  (:func:`~spardl_jax.points.predicted_params`); ``params`` itself for a plain ``tx``.

  ``tx`` is the transformation as built (not one wrapped since, e.g. by
  ``optax.with_extra_args_support``), ``opt_state`` its state.

  Example (the step of the README, with any of them)::

    def train_step(params, opt_state, batch):
      point = sj.gradient_point(tx, opt_state, params)
      grads = jax.grad(loss_fn)(jax.lax.pcast(point, "data", to="varying"), batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
  """
  for _, move in _MOVES:
    params = move(tx, opt_state, params)
  return params
