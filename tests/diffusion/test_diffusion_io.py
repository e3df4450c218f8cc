"""`batchgen run` on /v1/images/generations JSONL (batchgen.diffuse on a cluster: test_diffusion_sp.py,
which shares its LocalCluster)."""
from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")

import pandas as pd  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import tiny_diffusion as tiny  # noqa: E402
from PIL import Image  # noqa: E402

from batchgen.cli import main  # noqa: E402
from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402
from batchgen.diffusion.jobs.images_batch import IMAGES  # noqa: E402
from batchgen.diffusion.jobs.images_lines import ImagesReader, LineResult  # noqa: E402
from batchgen.diffusion.jobs.images_sink import ImagesParquetSink  # noqa: E402
from batchgen.io.job import run_job  # noqa: E402
from batchgen.io.parquet_sink import parts_dir  # noqa: E402


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_dit(tmp_path_factory.mktemp("dit_io") / "pipe")


def _line(cid: str, body: dict, url: str = "/v1/images/generations") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


LINES = [_line("a", {"class_label": 1, "size": "16x16", "n": 2, "seed": 3, "num_inference_steps": 3}),
         _line("b", {"class_label": 2, "num_inference_steps": 2, "response_format": "b64_json"}),
         _line("c", {"class_label": 1, "size": "18x18", "num_inference_steps": 2}),
         "{not json", _line("d", {"class_label": 1}, url="/v1/completions"),
         _line("e", {"class_label": 1, "num_inference_steps": 2, "quality": "hd"})]


def _args(model: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    # most lines here are bad on purpose: an error budget of 100% keeps exit 0 for them
    return ["run", "--model", str(model), "--input", str(inp), "--output", str(out), "--progress", "off",
            "--max-error-rate", "1", *extra]


def _key(record: dict) -> str | int:
    return record["custom_id"] or record["response"]["body"]["error"]["line"]


def _pixels(path: str) -> np.ndarray:
    return np.asarray(Image.open(path)).astype(np.int16)


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    # An image packed into one forward with others agrees with the same image made alone within
    # 1e-5 (fp32; diffusion/models/packed.py), not bit for bit (AVX2 and AVX512 sum in other orders).
    # 1e-5 of [0, 1] is 0.003 of a uint8 level, so quantisation moves a pixel by one level at most.
    return got.shape == want.shape and int(np.abs(got - want).max()) <= 1


def test_batchgen_run_images_jsonl_with_resume(dit_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    args = _args(dit_dir, inp, out)
    assert main(args) == 0
    assert main(args) == 2  # exists, neither --resume nor --overwrite
    # What a run killed after two rows leaves: complete records of a (2 PNGs) and line 4.
    kept = [r for r in out.read_text().splitlines(keepends=True) if _key(json.loads(r)) in ("a", 4)]
    out.write_text("".join(kept))
    [a_first] = [r for r in map(json.loads, kept) if r["custom_id"] == "a"]
    a_pngs = {d["url"]: Path(d["url"]).read_bytes() for d in a_first["response"]["body"]["data"]}
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "4 rows: 1 succeeded, 3 errors (2 already done before this run)" in err
    assert "images generated" in err
    text = out.read_text()
    assert text.startswith("".join(kept))  # kept rows: byte-identical, never recomputed
    records = [json.loads(x) for x in text.splitlines()]
    assert sorted(map(str, map(_key, records))) == ["4", "a", "b", "c", "d", "e"]  # each row once
    by_key = {_key(r): r for r in records}
    a = by_key["a"]["response"]
    assert a["status_code"] == 200 and len(a["body"]["data"]) == 2
    assert {p: Path(p).read_bytes() for p in a_pngs} == a_pngs  # a's PNGs were not rewritten
    imgs = [_pixels(d["url"]) for d in a["body"]["data"]]
    assert imgs[0].shape == (16, 16, 3) and not np.array_equal(imgs[0], imgs[1])  # seeds 3 and 4
    ref = DiffusionEngine(dit_dir).generate([ImageRequest(class_label=1, num_inference_steps=3, seed=4)])[0]
    assert _close(imgs[1], np.asarray(ref).astype(np.int16))
    assert base64.b64decode(by_key["b"]["response"]["body"]["data"][0]["b64_json"])[:4] == b"\x89PNG"
    err = {k: r["response"]["body"]["error"]["message"] for k, r in by_key.items()
           if r["response"]["status_code"] == 400}
    assert set(err) == {"c", 4, "d", "e"}
    assert "height 18" in err["c"] and "line 3" in err["c"]
    assert "JSON" in err[4] and "url" in err["d"] and "quality" in err["e"]


def test_images_resume_refuses_an_edited_input(dit_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(LINES[:2]) + "\n")
    assert main(_args(dit_dir, inp, out)) == 0
    before = out.read_text()
    inp.write_text("\n".join(LINES) + "\n")  # two lines done, four lines added: another input
    capsys.readouterr()
    assert main([*_args(dit_dir, inp, out), "--resume"]) == 2  # a message, not a raise
    assert "started from another input" in capsys.readouterr().err
    assert out.read_text() == before


def test_images_parquet_output(dit_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    inp.write_text("\n".join(LINES) + "\n")
    assert main(_args(dit_dir, inp, out)) == 0
    assert "6 rows: 2 succeeded, 4 errors; 3 images generated" in capsys.readouterr().err
    df = pd.read_parquet(out)
    assert df.columns.tolist() == ["custom_id", "line", "status_code", "images", "error", "error_code",
                                   "error_param"]
    assert df["line"].tolist() == [1, 2, 3, 4, 5, 6]  # input order, whatever finished first
    assert df["status_code"].tolist() == [200, 200, 400, 400, 400, 400]
    a, b = df["images"][0].tolist(), df["images"][1].tolist()
    assert len(a) == 2 and len(b) == 1 and all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in a + b)
    assert _pixels(a[0]).shape == (16, 16, 3)
    assert df["images"][2] is None and "height 18" in df["error"][2]
    assert df["error_code"][3] == "invalid_json" and df["error_param"][5] == "body.quality"
    # --resume of a finished output: every row is read back as done (by its JSONL key)
    assert main(_args(dit_dir, inp, out, "--resume")) == 0
    assert "0 rows" in capsys.readouterr().err and pd.read_parquet(out).equals(df)


def test_images_on_workers_equal_the_local_job(dit_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    here, there = tmp_path / "here.jsonl", tmp_path / "there.jsonl"
    assert main(_args(dit_dir, inp, here)) == 0
    capsys.readouterr()
    assert main(_args(dit_dir, inp, there, "--workers", "2")) == 0
    assert "6 rows: 2 succeeded, 4 errors; 3 images generated" in capsys.readouterr().err
    want = {_key(r): r for r in map(json.loads, here.read_text().splitlines())}
    got = {_key(r): r for r in map(json.loads, there.read_text().splitlines())}
    assert sorted(map(str, got)) == sorted(map(str, want))  # every line once
    for key, record in want.items():
        body, other = record["response"]["body"], got[key]["response"]["body"]
        assert got[key]["response"]["status_code"] == record["response"]["status_code"]
        assert body.get("error") == other.get("error")
        for mine, theirs in zip(body.get("data", []), other.get("data", [])):
            if "url" in mine:
                assert _close(_pixels(theirs["url"]), _pixels(mine["url"]))


class _Painter:
    """A backend without a model: each line's images are flat squares; Ctrl-C after ``stop_after``."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.left, self.ran = stop_after, 0

    def run(self, lines: Iterable[tuple[list[ImageRequest], str]], max_in_flight: int
            ) -> Iterator[tuple[int, LineResult]]:
        for position, (images, _) in enumerate(lines):
            if self.left is not None:
                if self.left == 0:
                    raise KeyboardInterrupt
                self.left -= 1
            self.ran += 1
            yield position, LineResult([Image.new("RGB", (2, 2), (r.seed, 0, 0)) for r in images])


def test_images_parquet_resume_after_interrupt(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    inp.write_text("\n".join([*LINES[:3], "", *LINES[3:], _line("f", {"class_label": 3, "seed": 9})]) + "\n")

    def run(backend: _Painter, resume: bool) -> None:
        sink = ImagesParquetSink(out, resume=resume)
        sink.flush_rows = 1
        run_job(ImagesReader(inp).requests(sink.done), sink, backend, work=IMAGES, flush_seconds=1e9)

    first, second = _Painter(stop_after=2), _Painter()
    with pytest.raises(KeyboardInterrupt):
        run(first, resume=False)
    assert parts_dir(out).is_dir() and not out.exists()
    run(second, resume=True)
    assert (first.ran, second.ran) == (2, 2)  # a, b, c, f: each line once
    rows = pq.read_table(out).to_pydict()
    assert rows["custom_id"] == ["a", "b", "c", None, "d", "e", "f"]
    assert rows["line"] == [1, 2, 3, 5, 6, 7, 8]  # line 4 is blank
    assert rows["status_code"] == [200, 200, 200, 400, 400, 400, 200]  # c's size fails in an engine only
    assert [len(x or []) for x in rows["images"]] == [2, 1, 1, 0, 0, 0, 1]
