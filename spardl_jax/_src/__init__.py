"""The implementation behind :mod:`spardl_jax`'s doors: nothing here is public, and its
modules may move or change. ``core`` is the SparDL algorithm and the all-reduce protocol,
``baselines`` the competitors, ``sync`` the engine (the optax sync, its state and where it
lives on the mesh), ``recipes`` what is built over the engine (Adam around the sync, DeMo,
the outer loops, the weight prediction of a delayed sync), ``parallel`` many processes."""
