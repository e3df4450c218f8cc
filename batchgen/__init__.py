"""batchgen: batch (offline) inference of Mixture-of-Experts LLMs, built on Dask."""
from __future__ import annotations

__version__ = "0.1.0"
