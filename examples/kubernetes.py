"""batchgen on Kubernetes: connect to the cluster that examples/kubernetes.yaml describes.

    kubectl apply -f examples/kubernetes.yaml
    kubectl port-forward svc/batchgen-scheduler 8786:8786 8787:8787   # when running outside the cluster
    python examples/kubernetes.py --scheduler tcp://localhost:8786 \
        --model /models/Qwen2.5-7B-Instruct --input s3://bucket/prompts.parquet --out s3://bucket/out/

The model path is the one the GPU workers mount (the shared `models` volume); the client only
sends it. Engines start only on the GPU worker group (the Dask resource GPU=1 in the spec);
the CPU workers run the rest of the graph. See docs/guides/gpu-clusters.md.
"""
from __future__ import annotations

import argparse

RESOURCE = "GPU"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheduler", default="tcp://batchgen-scheduler:8786")
    ap.add_argument("--model", required=True, help="model directory as the GPU workers see it")
    ap.add_argument("--input", required=True, help="Parquet with a `prompt` column")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)

    import dask.dataframe as dd

    import batchgen

    client = batchgen.cluster.connect(args.scheduler, worker_resource=RESOURCE)
    try:
        ddf = dd.read_parquet(args.input)
        ddf = ddf[ddf["prompt"].str.len() > 0]
        out = ddf.map_partitions(batchgen.generate, model=args.model, temperature=0.0,
                                 max_tokens=args.max_tokens)
        out.to_parquet(args.out)
    finally:
        client.close()


if __name__ == "__main__":
    main()
