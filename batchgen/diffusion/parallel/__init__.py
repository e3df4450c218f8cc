"""Collectives for sequence parallelism, over torch.distributed alone (no Dask): group-free
groups formed without communicator setup, and Ulysses token sharding around attention."""
