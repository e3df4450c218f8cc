"""Smaller pieces of the simulator: the clock-free speed meter, --png, bench --calibrate."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from batchgen.cli import main
from batchgen.policy.speed import SPEED_DECAY, SpeedMeter
from batchgen.sim.chart import utilization_grid
from batchgen.sim.profiles import FittedProfile, load_profile


def test_speed_counts_only_saturated_windows() -> None:
    m = SpeedMeter(0.0)
    m.observe(0.5, 100, waiting=3)  # inside the window: nothing measured yet
    assert m.speed == 0 and m.tokens_per_s == 0
    m.observe(1.0, 200, waiting=3)  # the first window had no sample saying "saturated" throughout
    assert m.tokens_per_s == 200 and m.speed == 0
    m.observe(2.0, 700, waiting=1)  # rows waited at every sample of this window: capacity
    assert m.speed == 500
    m.observe(3.0, 800, waiting=0)  # idle tail: rate falls, speed stays
    m.observe(4.0, 820, waiting=0)
    assert m.speed == 500 and m.tokens_per_s < 200
    m.observe(5.0, 900, waiting=2)
    m.observe(6.0, 1000, waiting=2)
    assert m.speed == pytest.approx(500 * SPEED_DECAY)


def test_utilization_grid() -> None:
    grid = utilization_grid(((0.0, 5.0, 1), (7.5, 10.0, 1)), end=10.0, bins=4)
    np.testing.assert_allclose(grid, [1.0, 1.0, 0.0, 1.0])


def test_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "u.png"
    assert main(["plan", "--rows", "100", "--workers", "3", "--profile", "L4", "--expert-memory", "10GiB",
                 "--workload", "classification", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_writes_a_profile_plan_can_use(tmp_path: Path, checkpoint_factory: Callable[..., Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = checkpoint_factory("mixtral")
    out = tmp_path / "cpu.json"
    assert main(["bench", "--calibrate", str(model), "-o", str(out), "--quick", "--threads", "1",
                 "--kv-cache-bytes", "16MiB"]) == 0
    profile = load_profile(out)
    assert isinstance(profile, FittedProfile) and "measured by batchgen bench --calibrate" in profile.source
    assert profile.fit["median_rel_error"] < 0.5 and sum(profile.coefficients.values()) > 0
    assert profile.expert_traffic == {}  # every expert resident: nothing measured, the estimate stands
    capsys.readouterr()
    assert main(["plan", "--rows", "50", "--workers", "2", "--profile", str(out), "--workload", "classification",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["batchgen"]["bct_s"] > 0
    assert main(["bench", "--calibrate", str(tmp_path), "-o", str(out)]) == 2  # not a model directory


def test_calibrate_offloaded_records_measured_expert_bytes(tmp_path: Path, checkpoint_factory: Callable[..., Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """An offloaded calibration records the engine's own expert_bytes_from_host/_from_disk and the
    bytes per forward; the cost model then prices each forward's fetch with those measured bytes."""
    from batchgen import Engine
    from batchgen.sim.cost import FittedCost, build_cost

    model = checkpoint_factory("mixtral")
    probe = Engine(model, kv_cache_bytes=16 << 20)
    ffn = next(layer.ffn for layer in probe.model.weights.layers if getattr(layer.ffn, "w13", None) is not None)
    one_layer = (ffn.w13[0].numel() + ffn.w2[0].numel()) * ffn.w13.element_size() * ffn.w13.shape[0]
    out = tmp_path / "offloaded.json"
    assert main(["bench", "--calibrate", str(model), "-o", str(out), "--quick", "--threads", "1",
                 "--kv-cache-bytes", "16MiB", "--expert-memory", str(one_layer)]) == 0
    assert "MiB per generated token" in capsys.readouterr().err
    profile = load_profile(out)
    traffic = profile.expert_traffic
    assert traffic["expert_memory_bytes"] == one_layer
    assert traffic["expert_bytes_from_host"] > 0  # a pool of one layer: every other layer is copied in
    per_forward = np.array(traffic["per_forward"])
    assert (per_forward[:, 1] > 0).all() and list(per_forward[:, 0]) == sorted(per_forward[:, 0])
    cost = build_cost(profile, None)
    assert isinstance(cost, FittedCost) and cost.traffic is not None
    t = per_forward[:, 0]
    host, disk = cost.traffic.at(t)
    np.testing.assert_allclose(host, per_forward[:, 1])  # measured sizes: the measured bytes
    np.testing.assert_allclose(disk, per_forward[:, 2])
    # the fetch term is coefficient x measured bytes: doubling the traffic adds exactly that much
    fields = {f: getattr(profile, f) for f in profile.__slots__}  # type: ignore[attr-defined]
    fields["coefficients"] = {**profile.coefficients, "per_host_byte_s": 1e-9, "per_disk_byte_s": 4e-9}
    base = FittedCost.build(FittedProfile(**fields))
    doubled = FittedCost.build(FittedProfile(**{**fields, "expert_traffic": {
        **traffic, "per_forward": (per_forward * [1, 2, 2]).tolist()}}))
    extra = doubled.step_seconds(t, 1, t, t) - base.step_seconds(t, 1, t, t)
    np.testing.assert_allclose(extra, host * 1e-9 + disk * 4e-9, rtol=1e-9)
    assert (extra > 0).all()
