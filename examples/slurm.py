"""batchgen on a SLURM cluster through dask-jobqueue: one GPU per job, one Dask worker per job.

    pip install "batchgen[slurm]"
    python examples/slurm.py --model /shared/models/Qwen2.5-7B-Instruct \
        --input /shared/data/prompts.parquet --out /shared/out/ --jobs 4 [--cpu-jobs 8] \
        [--partition gpu] [--account myproj] [--cache /shared/hf-cache]

Each GPU job asks SLURM for one GPU (`--gres=gpu:1`; SLURM sets CUDA_VISIBLE_DEVICES to it, so
the worker's engine sees exactly its own device), `--cpus-per-task` cores for torch's threads
(`OMP_NUM_THREADS`) and starts one worker with one task thread (batchgen's tasks secede while
they wait, so one slot carries any number of partitions) and the Dask resource `GPU=1`.
`batchgen.cluster.connect(..., worker_resource="GPU")` then starts engines only there; the optional CPU
jobs (`--cpu-jobs`) run the rest of the ETL graph and hand their rows to the GPU workers.
The model directory and Hugging Face cache sit on shared storage every node mounts; Dask's
spill directory on node-local scratch. See docs/guides/gpu-clusters.md.
"""
from __future__ import annotations

import argparse
import subprocess
from typing import Any

RESOURCE = "GPU"


def gpu_job_options(*, cores: int = 8, memory: str = "64GB", walltime: str = "04:00:00",
                    partition: str | None = None, account: str | None = None,
                    cache: str = "/shared/hf-cache", scratch: str = "$TMPDIR") -> dict[str, Any]:
    """SLURMCluster keyword arguments for GPU jobs: one GPU, one worker, one task thread."""
    return {
        "queue": partition, "account": account, "walltime": walltime,
        "cores": 1, "processes": 1,  # the worker's task threads: one (tasks secede while they wait)
        "job_cpu": cores,  # --cpus-per-task: torch's compute threads
        "memory": memory,  # host memory: engine, pinned KV/expert spill, the worker's partitions
        "job_extra_directives": ["--gres=gpu:1"],
        "worker_extra_args": ["--resources", f"{RESOURCE}=1"],
        "local_directory": scratch,  # Dask spill on node-local disk, not the shared file system
        "job_script_prologue": [
            f"export OMP_NUM_THREADS={cores}",
            f"export HF_HOME={cache}",  # tokenizers / models fetched once, read by every node
            "export HF_HUB_OFFLINE=1",  # no node downloads in the middle of a job
            "export TOKENIZERS_PARALLELISM=false",
        ],
    }


def cpu_job_options(*, cores: int = 16, memory: str = "64GB", walltime: str = "04:00:00",
                    partition: str | None = None, account: str | None = None) -> dict[str, Any]:
    """CPU-only jobs for the rest of the graph (read, clean, write): no GPU, no resource."""
    return {"queue": partition, "account": account, "walltime": walltime, "cores": cores,
            "processes": 1, "memory": memory,
            "job_script_prologue": ["export OMP_NUM_THREADS=1"]}


def slurm_cluster(**options: Any) -> Any:
    """A SLURMCluster of GPU jobs (`gpu_job_options(**options)`); nothing is submitted until
    `scale`. The scheduler runs here, its dashboard on Dask's default port."""
    from dask_jobqueue import SLURMCluster

    return SLURMCluster(**gpu_job_options(**options), scheduler_options={"dashboard_address": ":8787"})


def cpu_job_script(scheduler_address: str, name: str, **options: Any) -> str:
    """An sbatch script for one CPU worker of `scheduler_address` (`cpu_job_options(**options)`):
    SLURMCluster runs one job class, so the CPU side is submitted as plain jobs."""
    from dask_jobqueue.slurm import SLURMJob

    return SLURMJob(scheduler=scheduler_address, name=name, **cpu_job_options(**options)).job_script()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True, help="Parquet with a `prompt` column")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=2, help="GPU jobs (one GPU each)")
    ap.add_argument("--cpu-jobs", type=int, default=0, help="CPU jobs for the ETL around the model")
    ap.add_argument("--partition")
    ap.add_argument("--account")
    ap.add_argument("--cache", default="/shared/hf-cache")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)

    import dask.dataframe as dd
    from distributed import Client

    import batchgen

    gpu = slurm_cluster(partition=args.partition, account=args.account, cache=args.cache)
    gpu.scale(jobs=args.jobs)
    client = Client(gpu)
    for i in range(args.cpu_jobs):  # plain CPU workers joining the same scheduler
        script = cpu_job_script(gpu.scheduler_address, f"cpu-{i}", partition=args.partition, account=args.account)
        subprocess.run(["sbatch"], input=script, text=True, check=True)
    client.wait_for_workers(1)
    batchgen.cluster.connect(client=client, worker_resource=RESOURCE)
    ddf = dd.read_parquet(args.input)
    ddf = ddf[ddf["prompt"].str.len() > 0]
    out = ddf.map_partitions(batchgen.generate, model=args.model, temperature=0.0, max_tokens=args.max_tokens)
    out.to_parquet(args.out)
    client.close()
    gpu.close()  # cancels the GPU jobs; CPU workers exit when the scheduler goes (--death-timeout)


if __name__ == "__main__":
    main()
