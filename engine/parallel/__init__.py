"""Tensor parallelism: one model cut over several ranks (`shards.py`: how each weight is cut; `layers.py`: a rank's
model and the weights whose outputs cross ranks; `comm.py`: the collectives), and the engine over them (`leader.py`
on rank 0, `worker.py` on the others; `support.py`: what it runs with). docs/architecture.md describes the whole."""
