"""Image engines across Dask workers: the engine spec the cluster runtime keeps per worker,
the gloo world each worker joins, the elastic loop (degree changed at runtime) and calibration."""
