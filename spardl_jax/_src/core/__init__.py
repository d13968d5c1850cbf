"""The SparDL algorithm (the paper's Sections III–V), one module per concept.

``config`` (options, block layout), ``schedule`` (pure-Python round schedules), ``topk``
(exact block selection), ``messages`` (packed static-shape messages), ``sparse`` (sparse
sums), ``srs`` (Spar-Reduce-Scatter), ``bruck`` (Bruck all-gather), ``sag`` (Spar-All-Gather,
with ``h_controller``, Algorithm 2), ``gres`` (global residual collection), ``cost`` (the
cost table and the alpha-beta model), ``allreduce`` (the stages put together) and
``protocol`` (what every all-reduce implements, and the registry). Nothing here imports the
baselines, the optax side or the tools.
"""

