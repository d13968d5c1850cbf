"""The competitors of the paper, each registered as an all-reduce on import.

``dense`` (``pmean``), ``dense_bf16`` (``pmean`` in bfloat16), ``topka`` (all-gather of local
top-k), ``topkdsa`` (SparCML's split-reduce-gather), ``gtopk`` (tree merge), ``oktopk``
(Ok-Topk), ``powersgd`` (low-rank) and ``sparseloco`` (chunked top-k, 2-bit values,
all-gathered); the last two work per leaf and bind the leaf shapes with ``for_leaves``. They share the sparse
maths of :mod:`spardl_jax._src.core.sparse` and the helpers of :mod:`.common`; SparDL's core
knows nothing of them.
"""

import importlib
import pkgutil

# Every module here but the shared helpers registers one method when imported: a new file is
# picked up with no list to edit (docs/new-method.md).
__all__ = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "common")
for _module in __all__:
  importlib.import_module(f"{__name__}.{_module}")
del _module
