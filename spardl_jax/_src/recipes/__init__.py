"""What is built over the engine (:mod:`spardl_jax._src.sync`), which knows none of it: Adam
around the sync (:mod:`.synced_adam`), DeMo (:mod:`.demo`), the outer loops
(:mod:`.outer`) and the weight prediction of a delayed sync (:mod:`.prediction`)."""
