"""Deployment recipes on CPU: dask-cuda's options, the SLURM job script (dask-jobqueue builds it
without SLURM), the Kubernetes spec, and no CUDA-only import on a CPU machine."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import batchgen.cluster.client as client_mod
from batchgen.errors import BatchgenError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_dask_cuda_options_take_the_parents_devices() -> None:
    opts = client_mod.cuda_cluster_options(2, ["GPU-aa", "GPU-bb", "GPU-cc"], 6)
    assert opts["CUDA_VISIBLE_DEVICES"] == "GPU-aa,GPU-bb" and opts["n_workers"] == 2
    assert opts["threads_per_worker"] == 1 and opts["resources"] == {"GPU": 1}
    assert opts["env"] == {"OMP_NUM_THREADS": "6"} and opts["dashboard_address"] == ":8787"
    mine = client_mod.cuda_cluster_options(1, ["3"], 4, {"env": {"X": "1"}, "rmm_pool_size": "1GB"})
    assert mine["env"] == {"OMP_NUM_THREADS": "4", "X": "1"} and mine["rmm_pool_size"] == "1GB"
    with pytest.raises(BatchgenError):
        client_mod.cuda_cluster_options(4, ["0", "1"], 4)  # one engine per device under dask-cuda


def test_local_cluster_uses_dask_cuda_when_installed(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    seen: dict[str, Any] = {}

    class FakeCluster:
        dashboard_link = "http://host:8787/status"

    def fake_cuda(n: int, devices: list[str], cpu_threads: int, options: dict[str, Any]) -> FakeCluster:
        seen.update(client_mod.cuda_cluster_options(n, devices, cpu_threads, options))
        return FakeCluster()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(client_mod, "gpu_count", lambda: 2)
    monkeypatch.setattr(client_mod, "has_dask_cuda", lambda: True)
    monkeypatch.setattr(client_mod, "_cuda_cluster", fake_cuda)
    client_mod.local_cluster()
    assert seen["CUDA_VISIBLE_DEVICES"] == "2,3" and seen["n_workers"] == 2
    assert "http://host:8787/status" in capsys.readouterr().err


def test_cpu_machine_imports_neither_dask_cuda_nor_cupy() -> None:
    code = ("import sys, batchgen, batchgen.cluster.client as c, batchgen.cluster.devices as d, batchgen.moa.pool\n"
            "d.has_dask_cuda(); c.cuda_cluster_options(1, ['0'], 1)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dask_cuda', 'cupy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_slurm_job_script_has_the_lines_that_matter() -> None:
    slurm = _example("slurm")
    cluster = slurm.slurm_cluster(cores=6, partition="gpu", account="proj", cache="/shared/hf")
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    lines = script.splitlines()
    assert "#SBATCH --gres=gpu:1" in lines and "#SBATCH -p gpu" in lines and "#SBATCH -A proj" in lines
    assert "#SBATCH --cpus-per-task=6" in lines
    assert "export OMP_NUM_THREADS=6" in lines and "export HF_HOME=/shared/hf" in lines
    worker = next(line for line in lines if "distributed.cli.dask_worker" in line)
    assert "--resources GPU=1" in worker and "--nthreads 1" in worker
    cpu = slurm.cpu_job_script("tcp://10.0.0.1:8786", "cpu-0")
    assert "--gres" not in cpu and "--resources" not in cpu and "tcp://10.0.0.1:8786 --name cpu-0" in cpu


def test_kubernetes_spec_has_a_gpu_worker_group_with_the_resource() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "kubernetes.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"DaskCluster", "DaskWorkerGroup"}
    cluster, group = kinds["DaskCluster"], kinds["DaskWorkerGroup"]
    assert group["spec"]["cluster"] == cluster["metadata"]["name"]
    gpu = group["spec"]["worker"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = [str(a) for a in gpu["args"]]
    assert args[args.index("--resources") + 1] == "GPU=1" and args[args.index("--nthreads") + 1] == "1"
    env = {e["name"]: e["value"] for e in gpu["env"]}
    assert env["OMP_NUM_THREADS"] == gpu["resources"]["limits"]["cpu"]
    mounts = {m["name"]: m["mountPath"] for m in gpu["volumeMounts"]}
    assert env["HF_HOME"].startswith(mounts["models"])  # the model cache on the shared volume
    cpu = cluster["spec"]["worker"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"] and "--resources" not in cpu["args"]
    ports = {p["name"]: p["containerPort"] for p in cluster["spec"]["scheduler"]["spec"]["containers"][0]["ports"]}
    assert ports["http-dashboard"] == 8787
