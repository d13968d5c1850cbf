"""Orbax checkpoints of the whole train state, per-device residuals included.

The state is saved with its shardings: the ``(P, n)`` residuals keep every device's row, so a
restore on the same devices continues bit-identically (same next loss, same next residuals).
Beside it, a JSON progress record (see :func:`train.train.train_and_evaluate`): the epoch
history, and for a checkpoint taken inside an epoch the position in it (the Grain iterator's
state and the metrics of the steps taken), so a resume mid-epoch repeats the rest exactly.

A checkpoint can also be restored onto a different number of devices ``P'``. The per-device
leaves are then rebuilt so that no gradient mass is lost, each by the rule its state type
declares (:func:`spardl_jax.checkpoint.fold_rules`):

* every ``residual`` and every momentum-correction ``velocity`` is folded to its sum over
  the ``P`` saved rows and spread evenly over ``P'`` rows (the sum is taken in float64; the
  last row absorbs the rounding, so the rows add up to the saved total within one float32
  rounding): both are per-device sums of gradient mass the next syncs still deliver;
* the sync's step ``count`` (the same on every device) is kept, so a dense warm-up or a
  density schedule goes on where it was, and so are PowerSGD's warm-start ``Q`` factors;
* the gradients an ``optax.MultiSteps`` accumulated are averaged over the saved devices
  and every new device gets that mean, so the mean the next sync sees is unchanged;
* the rest (the B-SAG ``h`` controller, Ok-Topk thresholds, sync statistics) depends on
  ``P`` and starts afresh, as in a new run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp

import spardl_jax as sj

log = logging.getLogger("train")


UNREADABLE = "unreadable"  # where restore_latest moves the checkpoints it cannot read


@contextlib.contextmanager
def _quiet_orbax():
  """Orbax, TensorStore and asyncio log a traceback per failed read (about 30 for one corrupt
  checkpoint) and four per failed save (one per background thread); the fallback's one
  warning, or the save's one error, says what happened, so they are held back."""
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio", "orbax")]
  levels = [logger.level for logger in loggers]
  for logger in loggers:
    logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


def manager(directory: str, *, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """A checkpoint manager under ``directory``: each checkpoint holds the train state and a
  JSON record of the run's progress."""
  with _quiet_orbax():  # it reads the step folders, debris included
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "progress": ocp.JsonCheckpointHandler()})


class CheckpointNotWritten(OSError):
  """A checkpoint was not written: Orbax declined (it keeps only steps above its latest), or
  the write failed (a full disk, say)."""


def save(mgr: ocp.CheckpointManager, step: int, state, progress) -> None:
  """Saves ``state`` and ``progress`` (JSON: the epoch history, where in the data the run
  is) as checkpoint ``step`` and waits until it is complete.

  Raises:
    CheckpointNotWritten: Orbax skipped the save (a checkpoint ``>= step`` is already
      there): it would otherwise return quietly and the step would be lost; or the write
      failed, in one line (Orbax's threads each log a traceback), with the partial folder
      removed and the checkpoints before it kept.
  """
  failure = None
  # Installed before the save: a late callback of a failing write can arrive while the wait
  # below still runs, before its exception reaches this frame (seen under load).
  _drop_late_tensorstore_callbacks()
  with _quiet_orbax():
    before = set(threading.enumerate())
    try:
      written = mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       progress=ocp.args.JsonSave(progress)))
      mgr.wait_until_finished()
    except Exception as error:  # Orbax and TensorStore raise several types for one failure
      failure = error
      # The first thread's failure ends the wait; Orbax's other threads of this save still
      # log theirs (about a second later): they are waited for while held back (an Orbax
      # thread's join raises its failure again).
      for thread in set(threading.enumerate()) - before:
        with contextlib.suppress(Exception):
          thread.join(timeout=30)
  if failure is not None:
    for name in os.listdir(mgr.directory):  # its temporary folder holds part of the step
      if name.startswith(f"{step}.orbax-checkpoint-tmp"):
        shutil.rmtree(os.path.join(mgr.directory, name), ignore_errors=True)
    newest = mgr.latest_step()
    raise CheckpointNotWritten(
        f"checkpoint {step} could not be written to {mgr.directory}: {_reason(failure)}; "
        + ("there is no earlier checkpoint." if newest is None else
           f"the earlier ones are kept (the newest: {newest}).")) from failure
  if not written:
    raise CheckpointNotWritten(
        f"checkpoint {step} was not written to {mgr.directory}: it already holds checkpoints "
        f"up to {mgr.latest_step()}. Resume with the flags that wrote them, or use a fresh "
        f"checkpoint directory.")


def _reason(error: Exception) -> str:
  """The operating system's words for an I/O failure TensorStore reports with its code in
  a long message; the message's last line otherwise."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  code = re.search(r"os_error_code='(\d+)'", str(error))
  return os.strerror(int(code.group(1))) if code else str(error).strip().splitlines()[-1]


class CheckpointMismatch(ValueError):
  """A checkpoint of another train state (model, size, method or optimizer)."""


_paths = sj.checkpoint.paths


def _check_fits(step: int, directory, saved: dict, paths: list, leaves: list,
                fresh: set[str]) -> set[int]:
  """The indices of the per-device leaves whose device count differs; raises
  :class:`CheckpointMismatch` naming the leaf and both shapes for any other difference. A
  leaf of ``like`` the checkpoint lacks is taken fresh where its fold rule restarts it
  anyway (``fresh``: a field a state type gained since, as SyncState's ``placed``)."""
  if set(saved) - set(paths) or set(paths) - set(saved) - fresh:
    differ = sorted((set(paths) - fresh) ^ set(saved))[:3]
    raise CheckpointMismatch(
        f"checkpoint {step} in {directory} holds another train state (another model, method "
        f"or optimizer?): leaves {differ} are only on one side. Use a fresh checkpoint "
        f"directory.")
  changed = set()
  for i, (path, like) in enumerate(zip(paths, leaves)):
    if path not in saved:
      continue
    shape = tuple(saved[path].shape)
    if shape == like.shape:
      continue
    spec = like.sharding.spec if hasattr(like.sharding, "spec") else ()
    per_device = bool(spec) and spec[0] is not None
    if not per_device or shape[1:] != like.shape[1:]:
      raise CheckpointMismatch(
          f"checkpoint {step} in {directory} does not fit this train state: leaf "
          f"{path} has shape {shape} there and {like.shape} here (another model "
          f"size?). Use a fresh checkpoint directory.")
    changed.add(i)
  return changed


def check_same_run(progress: dict, run: dict, step: int, directory) -> None:
  """Raises :class:`CheckpointMismatch` naming each flag whose value differs between the
  run that wrote checkpoint ``step`` (its progress record's ``run``) and ``run`` (see
  :func:`train.train.run_record`); records written before they held a ``run`` pass."""
  saved = progress.get("run") if isinstance(progress, dict) else None
  if saved is None:
    return
  changed = [f"{key} {saved.get(key)!r} there, {run.get(key)!r} here"
             for key in sorted(set(saved) | set(run)) if saved.get(key) != run.get(key)]
  if changed:
    raise CheckpointMismatch(
        f"checkpoint {step} in {directory} was written by another run: {'; '.join(changed)}. "
        f"Resume with the flags that wrote it, or use a fresh --out.")


def check_newest(directory: str, run: dict) -> None:
  """:func:`check_same_run` against the newest checkpoint under ``directory``, reading only
  its progress record (a record that cannot be read is left to :func:`restore_latest`)."""
  if not os.path.isdir(directory):
    return
  mgr = manager(directory)
  try:
    step = mgr.latest_step()
    if step is None:
      return
    try:
      with _quiet_orbax():
        progress = mgr.restore(step, args=ocp.args.Composite(
            progress=ocp.args.JsonRestore()))["progress"]
    except Exception:  # unreadable: restore_latest sets it aside and tries older ones
      return
    check_same_run(progress, run, step, directory)
  finally:
    mgr.close()


class Unreadable(ValueError):
  """A step folder that is not a finished checkpoint of any train state."""


def _read(mgr: ocp.CheckpointManager, step: int, like):
  """Checkpoint ``step`` read for ``like``'s structure: ``(leaves, progress, changed)``, the
  leaves whose device count differs (``changed``: path -> the saved metadata) read whole
  onto the host. Every failure here means the checkpoint cannot be read."""
  # Orbax writes its metadata file last, inside the folder it renames into place: without
  # it (or without any saved leaf) the folder is debris, not another train state.
  if not (mgr.directory / str(step) / "_CHECKPOINT_METADATA").exists():
    raise Unreadable("not a finished Orbax checkpoint (no _CHECKPOINT_METADATA)")
  metadata = mgr.item_metadata(step).get("state")
  saved = dict(zip(_paths(metadata), jax.tree.leaves(metadata))) if metadata else {}
  if not saved:
    raise Unreadable("its train state lists no arrays")
  leaves = jax.tree.leaves(like)
  paths = _paths(like)
  # Only a state type's own declaration counts (a leaf no declaration covers is no field
  # gained since).
  declared = jax.tree.leaves(sj.checkpoint.fold_rules(like, rule="undeclared"))
  fresh = {p for p, rule in zip(paths, declared) if rule == "fresh"}
  changed = _check_fits(step, mgr.directory, saved, paths, leaves, fresh)
  # Leaves to rebuild are read whole onto one local device, the rest with their shardings.
  host = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = {p: jax.ShapeDtypeStruct(tuple(saved[p].shape), a.dtype,
                                      sharding=host if i in changed else a.sharding)
              for i, (p, a) in enumerate(zip(paths, leaves)) if p in saved}
  # Read in the saved tree's own structure and matched by path: a state type that gained a
  # field without arrays (SyncState's leaf shapes), or one its fold rule restarts
  # (SyncState's placed), reads the checkpoints written before.
  disk = _paths(metadata)
  restored = mgr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(jax.tree.unflatten(
          jax.tree.structure(metadata), [abstract[p] for p in disk])),
      progress=ocp.args.JsonRestore()))
  by_path = dict(zip(disk, jax.tree.leaves(restored["state"])))
  out = [np.asarray(by_path[p]) if i in changed else by_path.get(p, a)
         for i, (p, a) in enumerate(zip(paths, leaves))]
  return out, restored["progress"], {paths[i]: saved[paths[i]] for i in changed}


def _rebuild(step: int, like, out: list, changed: dict):
  """The leaves of :func:`_read` rebuilt onto ``like``'s devices (per-device leaves folded
  by their rules, :func:`spardl_jax.checkpoint.refold`). A failure here is not the
  checkpoint's: it propagates, and the checkpoint stays where it is."""
  state = sj.checkpoint.refold(jax.tree.unflatten(jax.tree.structure(like), out), like,
                               metadata=changed)
  if changed:
    log.info("checkpoint %d was written on another device count: residuals folded and "
             "spread, %d per-device leaves rebuilt", step, len(changed))
  return state


def _drop_late_tensorstore_callbacks() -> None:
  """After a failed read or write, TensorStore finishes the checkpoint's other operations
  once Orbax has closed the event loop they report to, and each prints ``RuntimeError:
  Event loop is closed`` through ``sys.unraisablehook`` (10 tracebacks for one truncated
  checkpoint), or through a thread's hook or ``sys.excepthook`` (TensorStore's
  ``PyErr_Print``) when it arrives late. This drops exactly those, from the first save or
  restore on, and passes everything else to the hooks before."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_late_tensorstore_callbacks", False):
    return

  def late(error) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"

  def hook(unraisable):
    if not late(unraisable.exc_value):
      previous(unraisable)

  # The same error raised in one of TensorStore's threads (a callback that arrives after the
  # loop closed, seen under load) reaches the thread hook, or the interpreter's, instead.
  previous_thread, previous_except = threading.excepthook, sys.excepthook

  def thread_hook(args):
    if not late(args.exc_value):
      previous_thread(args)

  def except_hook(kind, error, trace):
    if not late(error):
      previous_except(kind, error, trace)

  for new in (hook, thread_hook, except_hook):
    new.drops_late_tensorstore_callbacks = True  # type: ignore[attr-defined]
  sys.unraisablehook, threading.excepthook, sys.excepthook = hook, thread_hook, except_hook


def _set_aside(mgr: ocp.CheckpointManager, step: int) -> str:
  """Moves step folder ``step`` into ``UNREADABLE/`` beside the checkpoints (kept for a
  post-mortem, never deleted): the manager then neither counts it as the latest step, which
  would make it refuse to write that step again, nor lets ``max_to_keep`` delete a good
  checkpoint in its favour. Returns the new path."""
  aside = os.path.join(os.fspath(mgr.directory), UNREADABLE)
  if jax.process_index() == 0:  # one process moves it; the others wait at the barrier
    os.makedirs(aside, exist_ok=True)
    target, copy = os.path.join(aside, str(step)), 1
    while os.path.exists(target):
      target, copy = os.path.join(aside, f"{step}.{copy}"), copy + 1
    os.rename(os.path.join(os.fspath(mgr.directory), str(step)), target)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(f"spardl_jax set aside checkpoint {step}")
  return aside


def restore_latest(mgr: ocp.CheckpointManager, like) -> tuple[int, object, object] | None:
  """``(step, state, progress)`` of the newest checkpoint that reads cleanly, or None.

  A checkpoint that cannot be read (a folder left by a crash outside Orbax's atomic
  rename, a corrupted or truncated file, a junk folder) is moved into the ``unreadable/``
  folder beside the checkpoints with a one-line warning naming it and the reason, and the
  next older one is tried. Moved aside, it never blocks a later save of its step and never
  counts towards ``max_to_keep``, so no good checkpoint is deleted in its favour. Orbax
  writes into a temporary folder and renames it when complete, so a writer killed mid-save
  leaves no half checkpoint behind.

  Args:
    mgr: the manager.
    like: a freshly initialized state of the same structure on the current devices; its
      shapes, dtypes and shardings are restored, and its values fill the per-device leaves
      that cannot carry over to another device count (see the module docstring).

  Raises:
    CheckpointMismatch: the newest readable checkpoint is of another train state: which
      leaf differs and both shapes are named.
  """
  _drop_late_tensorstore_callbacks()
  with _quiet_orbax():
    mgr.reload()
    for step in sorted(mgr.all_steps(), reverse=True):
      try:
        out, progress, changed = _read(mgr, step, like)
      except CheckpointMismatch:
        raise
      except Exception as error:  # any reader failure (Orbax, TensorStore, JSON): try older
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        aside = _set_aside(mgr, step)
        log.warning("checkpoint %d in %s cannot be read (%s: %s); moved to %s, trying the "
                    "next older one", step, mgr.directory, type(error).__name__, reason, aside)
        mgr.reload()
        continue
      return step, _rebuild(step, like, out, changed), progress
  return None
