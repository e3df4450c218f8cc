"""The diffusion models: pipeline loading, text encoders, the transformer forward (staged,
packed, MMDiT), schedulers and their batched steps, VAE decode. Knows nothing of requests."""
