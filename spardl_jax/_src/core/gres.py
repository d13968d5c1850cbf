"""Global residual collection (GRES, the paper's Algorithm 1).

The new residual of worker ``w`` is ``g_w = x_w + r_w`` everywhere except at the indices of
the final global result, where it is what ``w`` discarded there (its in-procedure residual
``xi``). In SRS, ``xi`` of a block is its content at the time it was sparsified minus what
was selected, so at a result index ``i``: ``xi_w[i] = 0`` if ``w`` selected ``i``, else the
buffer value (``g_w[i]`` plus what ``w`` received there). Hence
``sum_w residual_w + P * result = sum_w g_w``: no gradient mass is lost or duplicated.

The residual is built in place from the SRS buffer: receipts at non-result indices are
undone by writing back the values logged before each receipt (newest first), and selected
result indices are zeroed (or, in a wire format that rounds values, set to the rounding error
of the value sent: the part that did not leave). Only sparse writes touch the dense buffer.

The same pass gives local residual collection (LRES, the paper's ablation baseline) when no
result mask is given: every receipt is undone and every selection zeroed, so a worker keeps
only what it discarded of its own gradient; everything discarded after a receipt is lost.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from spardl_jax._src.core.srs import Receipt

__all__ = ['collect_residuals']


def collect_residuals(buf: jax.Array, in_result: jax.Array | None, receipts: Sequence[Receipt],
                      selected: jax.Array, *, sent_errors: jax.Array | None = None
                      ) -> jax.Array:
  """The worker's new residual, in the flat layout of its block buffer.

  Args:
    buf: ``(size,)`` flat block buffer after SRS (``g`` plus everything received).
    in_result: ``(size,)`` bool, True at indices of the final global result (GRES); or
      ``None`` for local residual collection (LRES).
    receipts: the SRS receipts in step order.
    selected: ``(s,)`` int32 flat positions this worker selected (sent or kept); ``size``
      marks an empty slot.
    sent_errors: ``(s,)`` the part of each selected value that did not travel
      (``Wire.rounding_error`` at the time it was sent, in ``selected``'s order); None when
      values travel unchanged.

  Returns:
    ``(size,)`` the residual, same dtype as ``buf``.
  """
  size = buf.shape[0]
  if in_result is None:
    zero = selected
  else:
    zero = jnp.where(in_result.at[selected].get(mode="fill", fill_value=False), selected, size)
  kept = 0 if sent_errors is None else sent_errors
  res = buf
  if in_result is not None:
    # Under GRES no receipt is undone at a result index, so what stays of the selected
    # result entries is written first, read and written in place: reading `buf` after the
    # undo writes would make XLA copy the whole buffer.
    res = res.at[zero].set(kept, mode="drop")
  for receipt in reversed(receipts):
    # Indices of the result keep the received mass (it is this worker's xi there).
    drop = (receipt.positions if in_result is None else
            jnp.where(in_result[receipt.positions], size, receipt.positions))
    res = res.at[drop].set(receipt.before, mode="drop")
  if in_result is None:
    res = res.at[zero].set(kept, mode="drop")
  return res
