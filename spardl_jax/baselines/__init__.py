"""The competitors of the paper, each registered as an all-reduce on import.

``dense`` (``pmean``), ``dense_bf16`` (``pmean`` in bfloat16), ``topka`` (all-gather of local top-k), ``topkdsa`` (SparCML's
split-reduce-gather), ``gtopk`` (tree merge), ``oktopk`` (Ok-Topk) and ``powersgd`` (low-rank, per
leaf; it binds the leaf shapes with ``for_leaves``). They share the sparse
maths of :mod:`spardl_jax.core.sparse` and the helpers of :mod:`.common`; SparDL's core
knows nothing of them.
"""

from spardl_jax.baselines import dense, gtopk, oktopk, powersgd, topka, topkdsa

__all__ = ["dense", "gtopk", "oktopk", "powersgd", "topka", "topkdsa"]
