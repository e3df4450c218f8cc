"""Worker i of a local GPU cluster sees entry i of the devices the parent was given (indices,
UUIDs, MIG ids), never one outside that list; more workers than devices only when asked."""
from __future__ import annotations

from typing import Any

import pytest

import batchgen.cluster.client as client_mod
from batchgen.cluster.devices import assign_devices, visible_devices
from batchgen.errors import BatchgenError

UUIDS = "GPU-8f3c2a10-1111-2222-3333-444455556666,GPU-0b7d9e21-aaaa-bbbb-cccc-ddddeeeeffff"
MIG = "MIG-5c1d0e6f-1234-5678-9abc-def012345678"


@pytest.mark.parametrize(("value", "expected"), [
    ("2,3", ["2", "3"]),
    (UUIDS, UUIDS.split(",")),
    (f"{MIG}, 7", [MIG, "7"]),
    ("", []),  # CUDA hides everything
    ("1,-1,2", ["1"]),  # CUDA stops at the first entry it cannot use
])
def test_visible_devices_reads_the_parents_list(value: str, expected: list[str]) -> None:
    assert visible_devices({"CUDA_VISIBLE_DEVICES": value}, count=8) == expected


def test_unset_means_every_device_the_driver_shows() -> None:
    assert visible_devices({}, count=3) == ["0", "1", "2"]


def test_worker_i_gets_entry_i_and_never_another() -> None:
    devices = ["2", "3"]
    assert assign_devices(2, devices) == ["2", "3"]
    assert assign_devices(1, devices) == ["2"]
    with pytest.raises(BatchgenError, match="engines_per_device=2"):
        assign_devices(3, devices)
    assert assign_devices(4, devices, engines_per_device=2) == ["2", "3", "2", "3"]
    with pytest.raises(BatchgenError, match="no GPU"):
        assign_devices(1, [])


def test_spec_cluster_workers_get_the_parents_uuids(monkeypatch: pytest.MonkeyPatch) -> None:
    built: dict[str, Any] = {}

    class FakeSpecCluster:
        def __init__(self, workers: dict[str, Any], scheduler: dict[str, Any], **options: Any) -> None:
            built.update(workers=workers, scheduler=scheduler)
            self.dashboard_link = "http://host:8787/status"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUIDS)
    monkeypatch.setattr(client_mod, "gpu_count", lambda: 2)
    monkeypatch.setattr("distributed.SpecCluster", FakeSpecCluster)
    client_mod.local_cluster(dask_cuda=False)
    envs = [w["options"]["env"]["CUDA_VISIBLE_DEVICES"] for w in built["workers"].values()]
    assert envs == UUIDS.split(",")
    assert all(w["options"]["resources"] == {"GPU": 1} and w["options"]["nthreads"] == 1
               for w in built["workers"].values())
    assert built["scheduler"]["options"]["dashboard_address"] == ":8787"
    with pytest.raises(BatchgenError, match="2 GPU"):
        client_mod.local_cluster(3, dask_cuda=False)
    client_mod.local_cluster(3, engines_per_device=2, dask_cuda=False)
    envs = [w["options"]["env"]["CUDA_VISIBLE_DEVICES"] for w in built["workers"].values()]
    assert envs == [*UUIDS.split(","), UUIDS.split(",")[0]]


def test_worker_resource_config_names_the_gpu_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    import dask.config

    with dask.config.set({"batchgen.worker-resource": "A100"}):
        spec = client_mod.gpu_worker_spec(2, ["4", "5"], cpu_threads=2)
    assert [s["options"]["resources"] for s in spec.values()] == [{"A100": 1}, {"A100": 1}]
    assert [s["options"]["env"]["CUDA_VISIBLE_DEVICES"] for s in spec.values()] == ["4", "5"]
