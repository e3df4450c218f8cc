"""`batchgen run` on /v1/images/generations JSONL (batchgen.diffuse on a cluster: test_diffusion_sp.py,
which shares its LocalCluster)."""
from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("diffusers")

import tiny_diffusion as tiny  # noqa: E402

from batchgen.cli import main  # noqa: E402
from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny.build_dit(tmp_path_factory.mktemp("dit_io") / "pipe")


def _line(cid, body, url="/v1/images/generations"):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_batchgen_run_images_jsonl_with_resume(dit_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [_line("a", {"class_label": 1, "size": "16x16", "n": 2, "seed": 3, "num_inference_steps": 3}),
             _line("b", {"class_label": 2, "num_inference_steps": 2, "response_format": "b64_json"}),
             _line("c", {"class_label": 1, "size": "18x18", "num_inference_steps": 2}),
             "{not json", _line("d", {"class_label": 1}, url="/v1/completions"),
             _line("e", {"class_label": 1, "num_inference_steps": 2, "quality": "hd"})]
    inp.write_text("\n".join(lines[:2]) + "\n")
    args = ["run", "--model", str(dit_dir), "--input", str(inp), "--output", str(out)]
    assert main(args) == 0
    first = out.read_text()
    assert main(args) == 2  # exists, neither --resume nor --overwrite
    cmd = [sys.executable, "-m", "batchgen.cli", *args]
    inp.write_text("\n".join(lines) + "\n")
    res = subprocess.run(cmd + ["--resume"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert out.read_text().startswith(first)
    records = {r["custom_id"] or r["response"]["body"]["error"]["line"]: r
               for r in map(json.loads, out.read_text().splitlines())}
    assert len(records) == 6
    a = records["a"]["response"]
    assert a["status_code"] == 200 and len(a["body"]["data"]) == 2
    imgs = [np.asarray(__import__("PIL.Image").Image.open(d["url"])) for d in a["body"]["data"]]
    assert imgs[0].shape == (16, 16, 3) and not np.array_equal(imgs[0], imgs[1])  # seeds 3 and 4
    ref = DiffusionEngine(dit_dir).generate([ImageRequest(class_label=1, num_inference_steps=3, seed=4)])[0]
    assert np.array_equal(imgs[1], np.asarray(ref))
    assert base64.b64decode(records["b"]["response"]["body"]["data"][0]["b64_json"])[:4] == b"\x89PNG"
    err = {k: r["response"]["body"]["error"]["message"] for k, r in records.items() if r["response"]["status_code"] == 400}
    assert set(err) == {"c", 4, "d", "e"}
    assert "height 18" in err["c"] and "line 3" in err["c"]
    assert "JSON" in err[4] and "url" in err["d"] and "quality" in err["e"]
