"""Elastic Ulysses sequence parallelism across Dask worker processes over group-free collectives."""
from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")

import tiny_diffusion as tiny  # noqa: E402
import tiny_mmdit  # noqa: E402
import tiny_wan  # noqa: E402

from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402
from batchgen.diffusion.jobs.video_files import can_write_mp4  # noqa: E402

pytestmark = pytest.mark.slow  # a real LocalCluster of worker processes


def _forbid_new_group() -> None:
    """After start-up no process may create a communicator: new_group raises from now on."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed.new_group called after start-up")
    dist.new_group = refuse
    c10d.new_group = refuse


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sp")
    # 4 heads so degree 2 splits them; 12x12 latent / patch 2 = 36 tokens (sharded 18 + 18)
    return {"dit": tiny.build_dit(root / "dit", heads=4, sample_size=12),
            "pixart": tiny.build_pixart(root / "pixart", heads=4, sched="dpm"),
            "wan": tiny_wan.build_wan(root / "wan"),  # 2 heads; 9 frames of 32 x 48 px: 3 x 2 x 3 tokens
            "wan22": tiny_wan.build_wan(root / "wan22", boundary_ratio=0.9),  # its 6 steps: 3 on each expert
            "sd3": tiny_mmdit.build_sd3(root / "sd3"),  # 4 heads, a dual-attention block; 24 x 16 px: 12 x 8 latent, 24 tokens
            "flux": tiny_mmdit.build_flux(root / "flux")}  # 2 heads; 24 x 16 px: 24 packed tokens


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    from batchgen.diffusion.distributed.world import start_world

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c, Client(c) as client:
        ranks = start_world(client)
        client.run(_forbid_new_group)
        yield client, ranks


def _warm(path: str, options: dict | None = None) -> bool:
    """A Dask task: this worker's engine for the pipeline, loaded."""
    from batchgen.diffusion.distributed.on_worker import on_engine

    return on_engine(path, dict(options or {}), lambda engine: engine.pipe is not None)


def _finish(engine: DiffusionEngine, state: bytes) -> np.ndarray:
    engine.resume(state)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs[0].array


@pytest.mark.parametrize("family", ["dit", "pixart", "wan", "wan22", "sd3", "flux"])
def test_degree_1_2_and_switch_mid_trajectory_equal_degree_1(pipes, cluster, family):
    from batchgen.diffusion.distributed.world import run_steps

    client, ranks = cluster
    a, b = sorted(ranks)
    path = str(pipes[family])
    if family == "dit":
        req, opts = ImageRequest(class_label=2, num_inference_steps=6, guidance_scale=3.0, seed=1), {}
    elif family in ("wan", "wan22"):
        req = ImageRequest(prompt="a small boat", height=32, width=48, num_frames=9, num_inference_steps=6,
                           guidance_scale=3.0, seed=1)
        opts = {"max_sequence_length": tiny_wan.TEXT_LENGTH}
    elif family in ("sd3", "flux"):
        req = ImageRequest(prompt="a small boat", height=24, width=16, num_inference_steps=6, guidance_scale=3.0, seed=1)
        opts = {"max_sequence_length": tiny_mmdit.T5_LENGTH}
    else:
        req = ImageRequest(prompt="a small boat", height=24, width=24, num_inference_steps=6, guidance_scale=3.0, seed=1)
        opts = {"max_sequence_length": tiny.T5_MAX_LENGTH}
    local = DiffusionEngine(path, **opts)
    whole = local.generate_outputs([req])[0].array
    start = local.suspend(local.add_request(req))

    # k = 1 on one worker, k = 2 throughout, and 1 -> 2 -> 1 moving between workers
    one = run_steps(client, path, start, [a], ranks, 6, opts)
    two = run_steps(client, path, start, [a, b], ranks, 6, opts)
    s = run_steps(client, path, start, [a], ranks, 2, opts)
    s = run_steps(client, path, s, [a, b], ranks, 2, opts)
    s = run_steps(client, path, s, [b], ranks, 2, opts)
    assert np.array_equal(_finish(local, one), whole)  # degree 1 on a worker: bit-identical
    for got in (_finish(local, two), _finish(local, s)):
        # sharded attention sums in another order: float32 rounding only
        assert np.abs(got - whole).max() <= 1e-5


def test_groups_form_without_communicators(cluster):
    """Group.of talks to nobody and a group of one member never touches the world; a forbidden
    new_group on the workers proves none was created."""
    from batchgen.diffusion.parallel.groups import Group

    g = Group.of([1, 0])
    assert g.ranks == (1, 0) and g.gid == Group.of((1, 0)).gid != Group.of((0, 1)).gid
    with pytest.raises(ValueError):
        Group.of([0, 0])
    client, _ = cluster
    with pytest.raises(AssertionError, match="new_group called after start-up"):
        client.run(lambda: __import__("torch.distributed").distributed.new_group([0]))


def test_diffuse_on_local_cluster(pipes, cluster, tmp_path):
    import dask.dataframe as dd
    import pandas as pd

    import batchgen

    pdf = pd.DataFrame({"class_label": [1, 2, 99, 3], "num_inference_steps": [3, 4, 3, 0],
                        "seed": [0, 1, 2, 3], "tag": list("abcd")})
    out_dir = tmp_path / "png"
    dit_dir = pipes["dit"]
    ddf = dd.from_pandas(pdf, npartitions=2)
    got = ddf.map_partitions(batchgen.diffuse, model=str(dit_dir), output_dir=str(out_dir),
                             guidance_scale=3.0).compute()  # on the cluster fixture's default client
    assert list(got["tag"]) == list("abcd") and list(got.index) == [0, 1, 2, 3]
    assert got["error"].isna().tolist() == [True, True, False, False]
    assert "class_label 99" in got["error"][2] and "num_inference_steps" in got["error"][3]
    engine = DiffusionEngine(dit_dir)
    for i in (0, 1):
        png = np.asarray(__import__("PIL.Image").Image.open(got["image_path"][i]))
        ref = engine.generate([ImageRequest(class_label=int(pdf.class_label[i]), num_inference_steps=int(pdf.num_inference_steps[i]),
                                            seed=int(pdf.seed[i]), guidance_scale=3.0)])[0]
        # rows 0 and 1 ran in one packed forward on the cluster, alone here: equal to 1e-5 in
        # the latents, so to within one level of uint8
        assert np.abs(png.astype(int) - np.asarray(ref).astype(int)).max() <= 1


def test_diffuse_videos_on_local_cluster(pipes, cluster, tmp_path):
    """Wan rows through the cluster runtime: the frames come back from the workers' engines and
    are written as PNGs (and an MP4 where PyAV is installed); a bad frame count fails its row."""
    import dask.dataframe as dd
    import pandas as pd
    from PIL import Image

    import batchgen

    opts = {"max_sequence_length": tiny_wan.TEXT_LENGTH}
    pdf = pd.DataFrame({"prompt": ["a red fox", "a cat", "a dog"], "num_frames": [5, 9, 7],
                        "height": [16, 32, 16], "width": [16, 16, 16], "seed": [0, 1, 2]})
    got = dd.from_pandas(pdf, npartitions=2).map_partitions(
        batchgen.diffuse, model=str(pipes["wan"]), output_dir=str(tmp_path / "videos"), engine_options=opts,
        num_inference_steps=2).compute()
    assert got["error"].isna().tolist() == [True, True, False] and "num_frames 7" in got["error"][2]
    assert got["image_path"].isna().all()
    engine = DiffusionEngine(pipes["wan"], **opts)
    for i in (0, 1):
        frames = sorted(Path(got["frames_dir"][i]).glob("*.png"))
        ref = engine.generate([ImageRequest(prompt=pdf.prompt[i], num_frames=int(pdf.num_frames[i]), seed=i,
                                            height=int(pdf.height[i]), width=16, num_inference_steps=2)])[0]
        assert len(frames) == len(ref) == pdf.num_frames[i]
        for path, want in zip(frames, ref):
            assert np.abs(np.asarray(Image.open(path)).astype(int) - np.asarray(want).astype(int)).max() <= 1
        if can_write_mp4():
            import av

            with av.open(got["video_path"][i]) as mp4:
                assert sum(1 for _ in mp4.decode(video=0)) == pdf.num_frames[i]
        else:
            assert pd.isna(got["video_path"][i])


def test_runtime_switches_a_trajectorys_degree_when_the_queue_drains(pipes, cluster):
    """run_on_cluster's elastic loop: a large image runs at degree 1 while the other worker has
    small ones queued, then spreads over both workers once they are done; images equal degree 1.
    The cost model is taken as given (adapt=False): measured times would replace it."""
    from batchgen.diffusion.distributed.elastic import run_on_cluster
    from batchgen.policy.diffusion_cost import CostModel
    from batchgen.policy.diffusion_plan import ElasticOptions

    client, _ = cluster
    path = str(pipes["dit"])
    # 1 ms per image token / degree, 20 ms per degree-2 forward: the 64-token image takes 64 ms
    # alone, 52 ms spread; spreading it over a worker busy with a 16-token image would make 68 ms
    cost = CostModel(fixed=0.0, per_token=1e-3, per_attn=0.0, per_comm_token=0.0, comm_fixed=0.02)
    # the loops run free until the other worker is idle: the large one has steps enough to outlast
    # the small ones (4 steps and 2 decodes on the other worker) many times over, even on a machine
    # busy with other tests; engines warm
    client.gather([client.submit(_warm, path, workers=[w], pure=False) for w in client.scheduler_info()["workers"]])
    steps = 192
    large = ImageRequest(class_label=3, height=32, width=32, num_inference_steps=steps, guidance_scale=1.0, seed=7)
    small = [ImageRequest(class_label=i, height=16, width=16, num_inference_steps=2, guidance_scale=1.0 + i, seed=i)
             for i in range(2)]
    reqs = [large, *small, ImageRequest(class_label=99, height=16, width=16, num_inference_steps=3)]
    fixed = ElasticOptions(max_running=1, adapt=False)
    stats: list = []
    res = run_on_cluster(client, path, reqs, policy="fcfs", cost=cost, elastic=fixed, keep_arrays=True, stats=stats)
    assert "class_label 99" in res[-1].error and res[-1].png is None
    degrees = res[0].degrees
    assert len(degrees) == steps and degrees[0] == 1 and 2 in degrees, degrees
    first_two = degrees.index(2)
    assert set(degrees[first_two:-1]) == {2}, degrees  # spread once, to the end
    # the first degree-2 step came after the small ones were done (the loops run free until then)
    spread_at = min(s["first_sp_at"] for s in stats if s["first_sp_at"] is not None)
    assert spread_at > max(r.finished_at for r in res[1:3]), (spread_at, [r.finished_at for r in res[1:3]])
    assert sum(s["sync_phases"] for s in stats) == 2  # one phase, entered by both workers
    assert all(r.degrees == (1, 1) for r in res[1:3])
    engine = DiffusionEngine(path)
    for r, req in zip(res[:3], reqs[:3]):
        alone = engine.generate_outputs([req])[0].array
        assert r.error is None and np.abs(r.array - alone).max() <= 1e-5
    # a cost model where the all-to-all costs more than it saves: degree 1 throughout
    slow = CostModel(fixed=0.0, per_token=1e-3, per_attn=0.0, per_comm_token=2e-3, comm_fixed=0.0)
    # (the small one arrives later: admitted once it has)
    t0 = time.time()
    stats = []
    again = run_on_cluster(client, path, reqs[:2], policy="srwf", cost=slow, elastic=fixed, arrivals=[0.0, 0.5],
                           stats=stats)
    assert again[0].degrees == (1,) * steps and again[1].degrees == (1,) * 2
    assert sum(s["sync_phases"] for s in stats) == 0  # no lockstep bought anything
    assert again[1].finished_at - t0 >= 0.5


def test_elastic_driver_spreads_a_video_and_returns_its_frames(pipes, cluster):
    """Wan on the elastic driver: a 9-frame video (3 x 4 x 5 = 60 tokens) spreads over both
    workers once the small 5-frame one is done, as an image does; every video comes back as
    one PNG per frame, equal to the single engine's within the sharding tolerance; a bad frame
    count fails alone."""
    from PIL import Image

    from batchgen.diffusion.distributed.elastic import run_on_cluster
    from batchgen.policy.diffusion_cost import CostModel
    from batchgen.policy.diffusion_plan import ElasticOptions

    client, _ = cluster
    path = str(pipes["wan"])
    opts = {"max_sequence_length": tiny_wan.TEXT_LENGTH}
    cost = CostModel(fixed=0.0, per_token=1e-3, per_attn=0.0, per_comm_token=0.0, comm_fixed=0.02)
    client.gather([client.submit(_warm, path, opts, workers=[w], pure=False) for w in client.scheduler_info()["workers"]])
    # 64 steps: the large one outlasts the small one's steps and its VAE decode (slow on a CPU)
    large = ImageRequest(prompt="a boat", height=64, width=80, num_frames=9, num_inference_steps=64, seed=7)
    small = [ImageRequest(prompt="a cat", height=16, width=16, num_frames=5, num_inference_steps=2, seed=1)]
    reqs = [large, *small, ImageRequest(prompt="a dog", height=16, width=16, num_frames=6, num_inference_steps=2)]
    stats: list = []
    res = run_on_cluster(client, path, reqs, policy="fcfs", cost=cost, engine_options=opts,
                         elastic=ElasticOptions(max_running=1, adapt=False), keep_arrays=True, stats=stats)
    assert "num_frames 6" in res[-1].error and res[-1].frames is None
    assert 2 in res[0].degrees, (res[0].degrees, [(r.worker, r.finished_at) for r in res], stats)
    engine = DiffusionEngine(path, **opts)
    for r, req in zip(res[:2], reqs[:2]):
        alone = engine.generate_outputs([req])[0]
        assert r.error is None and r.png is None and len(r.frames) == req.num_frames
        assert np.abs(r.array - alone.array).max() <= 1e-5
        first = np.asarray(Image.open(io.BytesIO(r.frames[0]))).astype(int)
        # within the arrays' 1e-5, a pixel can round to the next level (degree 2 sums in another order)
        assert np.abs(first - np.asarray(alone.frames[0]).astype(int)).max() <= 1


def test_calibrate_cluster_fits_degree_terms_on_the_workers(pipes, cluster):
    from batchgen.diffusion.distributed.calibrate import calibrate_cluster

    client, _ = cluster
    cost = calibrate_cluster(client, str(pipes["dit"]), rows=(1, 2), latents=(8, 12), repeats=1)
    # the values are this machine's (noisy under load); what they come from is not
    assert cost.fixed + cost.per_token + cost.per_attn > 0  # (every term is >= 0 by construction: nnls)
    # rows x (latent / patch 2)^2 tokens at degree 2, all four points timed
    for sample in ("16x16@2", "32x16@2", "36x36@2", "72x36@2"):
        assert sample in cost.source, cost.source


def test_idle_worker_is_handed_a_trajectory_and_its_image_is_unchanged(pipes, cluster):
    """A worker whose only request fails at admission goes idle at once; the other holds two
    trajectories and hands it one at a step boundary (degree 1, no gloo): the migrated image
    equals the single engine's."""
    from batchgen.diffusion.distributed.elastic import run_on_cluster
    from batchgen.policy.diffusion_cost import CostModel

    client, _ = cluster
    path = str(pipes["dit"])
    client.gather([client.submit(_warm, path, workers=[w], pure=False) for w in client.scheduler_info()["workers"]])
    cost = CostModel(fixed=0.0, per_token=1e-3, per_attn=0.0, per_comm_token=0.0, comm_fixed=0.0)
    # dealt longest first: the 40-step bad one to one worker, both 30-step ones to the other
    reqs = [ImageRequest(class_label=1, height=16, width=16, num_inference_steps=30, guidance_scale=2.0, seed=3),
            ImageRequest(class_label=99, height=16, width=16, num_inference_steps=40),
            ImageRequest(class_label=2, height=16, width=16, num_inference_steps=30, guidance_scale=1.0, seed=4)]
    stats: list = []
    res = run_on_cluster(client, path, reqs, policy="fcfs", cost=cost, elastic=False, keep_arrays=True, stats=stats)
    assert "class_label 99" in res[1].error
    assert [r.migrated for r in (res[0], res[2])] == [True, False], stats
    assert res[0].worker != res[2].worker and res[0].degrees == (1,) * 30
    assert sum(s["migrated_out"] for s in stats) == 1 and sum(s["sync_phases"] for s in stats) == 0
    engine = DiffusionEngine(path)
    for i in (0, 2):
        alone = engine.generate_outputs([reqs[i]])[0].array
        # both were batched together for some steps (GEMM blocking: test_diffusion's TOL); the
        # move itself is exact (suspend / resume is bit-identical, test_diffusion)
        assert np.abs(res[i].array - alone).max() <= 1e-4


def _engine_keys(dask_worker) -> list[str]:  # noqa: ANN001 - Client.run passes the worker
    side = dask_worker.extensions.get("batchgen")
    return sorted(s.key for s in side.host.engines.specs()) if side is not None else []


def _queue_names(dask_scheduler) -> list[str]:  # noqa: ANN001
    ext = dask_scheduler.extensions.get("queues")
    return sorted(getattr(ext, "queues", {}))


def test_elastic_driver_runs_on_the_runtime_engines_and_messages(pipes, cluster, tmp_path):
    """The elastic loops step the engine each worker's host keeps for the pipeline (the one
    batchgen.diffuse joins: still one engine per worker after both ran) and talk worker to
    worker: no distributed.Queue is made on the scheduler."""
    import pandas as pd

    import batchgen
    from batchgen.diffusion.distributed.elastic import run_on_cluster

    client, _ = cluster
    path = str(pipes["dit"])
    reqs = [ImageRequest(class_label=i, height=16, width=16, num_inference_steps=3 + i, seed=i) for i in range(4)]
    res = run_on_cluster(client, path, reqs, elastic=False)
    assert all(r.error is None and r.png for r in res)
    pdf = pd.DataFrame({"class_label": [1, 2], "num_inference_steps": [2, 2], "seed": [0, 1]})
    futs = [client.submit(batchgen.diffuse, pdf, model=path, output_dir=str(tmp_path / w.split(":")[-1]), workers=[w],
                          pure=False) for w in client.scheduler_info()["workers"]]
    assert all(out["error"].isna().all() for out in client.gather(futs))
    keys = client.run(_engine_keys)  # (the module's other tests also load the pixart pipeline)
    assert all(sum(k.startswith(path + "|") for k in ks) == 1 for ks in keys.values()), keys
    assert not [q for q in client.run_on_scheduler(_queue_names) if q.startswith("bg-diff")]


def _break_stepping(fail: bool) -> None:
    from batchgen.diffusion.distributed import elastic_loop

    if fail:
        elastic_loop.Loop._step_free_ok = elastic_loop.Loop.step_free

        def broken(self) -> None:  # noqa: ANN001
            raise RuntimeError("this worker's steps fail")
        elastic_loop.Loop.step_free = broken
    elif hasattr(elastic_loop.Loop, "_step_free_ok"):
        elastic_loop.Loop.step_free = elastic_loop.Loop._step_free_ok


def test_a_failed_part_aborts_the_others_and_the_call_raises(pipes, cluster):
    """One worker's loop raises: the driver tells the other part (which would otherwise wait for
    results that never come), raises that error, and both engines serve the next job."""
    from batchgen.diffusion.distributed.elastic import run_on_cluster

    client, _ = cluster
    path = str(pipes["dit"])
    workers = sorted(client.scheduler_info()["workers"])
    reqs = [ImageRequest(class_label=i, height=16, width=16, num_inference_steps=20, seed=i) for i in range(4)]
    client.run(_break_stepping, True, workers=workers[:1])
    try:
        t0 = time.time()
        with pytest.raises(RuntimeError, match="this worker's steps fail"):
            run_on_cluster(client, path, reqs, elastic=False)
        assert time.time() - t0 < 60
    finally:
        client.run(_break_stepping, False, workers=workers[:1])
    again = run_on_cluster(client, path, reqs[:2], elastic=False)
    assert all(r.error is None for r in again)
