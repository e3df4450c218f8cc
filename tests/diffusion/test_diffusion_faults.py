"""Faults and corners found by review: DiT with Euler vs diffusers, requests a scheduler refuses,
non-finite guidance, and pipeline directories broken in ways that used to pass load."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("diffusers")

import tiny_diffusion as tiny  # noqa: E402

from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402
from batchgen.errors import ModelLoadError, RequestError, UnsupportedModelError  # noqa: E402


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny.build_dit(tmp_path_factory.mktemp("dit_f") / "pipe", layers=1)


@pytest.fixture(scope="module")
def pix_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny.build_pixart(tmp_path_factory.mktemp("pix_f") / "pipe", layers=1)


def test_dit_euler_matches_diffusers(dit_dir, tmp_path):
    # DiTPipeline hands the scheduler the *scaled* model input as the sample; Euler's scaling
    # is not the identity, so stepping from the unscaled latents gave another image.
    path = tiny.with_scheduler(dit_dir, tmp_path / "euler", "euler")
    reqs = [ImageRequest(class_label=5, num_inference_steps=4, guidance_scale=1.0, seed=2),
            ImageRequest(class_label=3, num_inference_steps=3, guidance_scale=2.5, seed=7)]
    for r, o in zip(reqs, DiffusionEngine(path).generate_outputs(reqs)):
        ref = tiny.reference_dit(path, r.class_label, r.num_inference_steps, r.guidance_scale, r.seed)
        assert (torch.from_numpy(o.array) - ref).abs().max() <= 1e-4


def test_requests_the_scheduler_or_guidance_refuse_fail_alone(dit_dir):
    out = DiffusionEngine(dit_dir).generate([
        ImageRequest(class_label=1, num_inference_steps=2000),         # DDIM: > num_train_timesteps
        ImageRequest(class_label=1, num_inference_steps=2, guidance_scale=float("inf")),
        ImageRequest(class_label=1, num_inference_steps=2, guidance_scale=float("nan")),
        ImageRequest(class_label=2, num_inference_steps=2)])
    assert isinstance(out[0], RequestError) and "num_inference_steps 2000" in str(out[0])
    assert isinstance(out[1], RequestError) and "guidance_scale" in str(out[1]) and "inf" in str(out[1])
    assert isinstance(out[2], RequestError) and "guidance_scale" in str(out[2])
    assert out[3].size == (16, 16)


def _copy(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit(path, **kw):
    data = json.loads(path.read_text())
    data.update(kw)
    path.write_text(json.dumps(data))


def test_broken_dit_dirs_fail_at_load_naming_the_part(dit_dir, tmp_path):
    d = _copy(dit_dir, tmp_path, "sched")
    _edit(d / "scheduler" / "scheduler_config.json", beta_schedule="nonsense")  # used to fail at the first request
    with pytest.raises(ModelLoadError, match="scheduler_config.json.*nonsense"):
        DiffusionEngine(d)
    d = _copy(dit_dir, tmp_path, "layers")
    _edit(d / "transformer" / "config.json", num_layers=2)  # weights hold 1 block
    with pytest.raises(ModelLoadError, match="transformer.*weights missing.*transformer_blocks.1"):
        DiffusionEngine(d)
    d = _copy(dit_dir, tmp_path, "entry")
    _edit(d / "model_index.json", transformer="DiTTransformer2DModel")
    with pytest.raises(ModelLoadError, match="entry 'transformer' must be"):
        DiffusionEngine(d)
    with pytest.raises(ValueError, match="max_batch_rows must be a positive integer, got 0"):
        DiffusionEngine(dit_dir, max_batch_rows=0)
    with pytest.raises(UnsupportedModelError, match="dtype 'fp32'"):
        DiffusionEngine(dit_dir, dtype="fp32")
    d = _copy(dit_dir, tmp_path, "list")
    (d / "model_index.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        DiffusionEngine(d)


def test_broken_text_encoder_fails_at_load(pix_dir, tmp_path):
    d = _copy(pix_dir, tmp_path, "t5")
    (d / "text_encoder" / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ModelLoadError, match="text encoder.*SafetensorError"):
        DiffusionEngine(d, max_sequence_length=tiny.T5_MAX_LENGTH)
    d = _copy(pix_dir, tmp_path, "t5layers")
    _edit(d / "text_encoder" / "config.json", num_layers=3)  # used to fail at the first prompt
    with pytest.raises(ModelLoadError, match="T5 weights missing.*encoder.block.2"):
        DiffusionEngine(d, max_sequence_length=tiny.T5_MAX_LENGTH)
    d = _copy(pix_dir, tmp_path, "tok")
    (d / "tokenizer" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        DiffusionEngine(d, max_sequence_length=tiny.T5_MAX_LENGTH)


def test_images_jsonl_ids_sizes_and_seeds(dit_dir, tmp_path):
    from batchgen.cli import main

    def line(cid, body):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/images/generations", "body": body})

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([
        line("a b", {"class_label": 1, "num_inference_steps": 2, "seed": 1}),
        line("a_b", {"class_label": 2, "num_inference_steps": 2, "seed": 2}),   # used to overwrite "a b"'s PNG
        line("under", {"class_label": 1, "size": "1_6x16", "num_inference_steps": 2}),  # int() reads "1_6" as 16
        line("bool", {"class_label": 1, "seed": True, "num_inference_steps": 2}),       # True + 0 was seed 1
        line("spaced", {"class_label": 1, "size": " 16 X 12 ", "num_inference_steps": 2})]) + "\n")
    # --dtype auto (the CLI's documented default) used to reach getattr(torch, "auto")
    assert main(["run", "--model", str(dit_dir), "--input", str(inp), "--output", str(out), "--dtype", "auto",
                 "--max-error-rate", "1"]) == 0  # some lines fail on purpose
    recs = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    urls = [recs[k]["body"]["data"][0]["url"] for k in ("a b", "a_b")]
    assert urls[0] != urls[1]
    from PIL import Image
    assert Image.open(recs["spaced"]["body"]["data"][0]["url"]).size == (16, 12)
    assert recs["under"]["status_code"] == 400 and "body.size" in recs["under"]["body"]["error"]["message"]
    assert recs["bool"]["status_code"] == 400 and "seed" in recs["bool"]["body"]["error"]["message"]


def test_a_forward_or_decode_that_raises_fails_only_its_request(dit_dir, monkeypatch):
    import batchgen.diffusion.engine.denoise as denoise
    import batchgen.diffusion.engine.diffusion_engine as engine_mod

    reqs = [ImageRequest(class_label=1, num_inference_steps=3, guidance_scale=2.0, seed=0),
            ImageRequest(class_label=7, num_inference_steps=3, guidance_scale=2.0, seed=1),   # its forward raises
            ImageRequest(class_label=2, height=32, width=16, num_inference_steps=2, seed=2),  # its decode raises
            ImageRequest(class_label=3, num_inference_steps=2, guidance_scale=1.0, seed=3)]
    want = DiffusionEngine(dit_dir).generate_outputs([reqs[0], reqs[3]])
    predict, packed, decode = denoise.predict, denoise.predict_packed, engine_mod.decode

    def bad_predict(pipe, x, t, cond, sp=None):
        if 7 in cond["class_labels"].tolist():
            raise RuntimeError("out of memory (injected)")
        return predict(pipe, x, t, cond, sp)

    def bad_packed(pipe, parts):  # both shapes' groups in one packed forward: it fails, then each alone
        if any(7 in cond["class_labels"].tolist() for _, _, cond in parts):
            raise RuntimeError("out of memory (injected)")
        return packed(pipe, parts)

    def bad_decode(pipe, latents):
        if any(z.shape[-2] == 16 for z in latents):
            raise RuntimeError("decode (injected)")
        return decode(pipe, latents)

    monkeypatch.setattr(denoise, "predict", bad_predict)
    monkeypatch.setattr(denoise, "predict_packed", bad_packed)
    monkeypatch.setattr(engine_mod, "decode", bad_decode)
    engine = DiffusionEngine(dit_dir)
    outs = engine.generate_outputs(reqs)
    assert "denoising step 0 failed" in outs[1].error and "out of memory (injected)" in outs[1].error
    assert "VAE decode failed" in outs[2].error
    for got, ref in zip((outs[0], outs[3]), want):
        assert got.error is None and abs(got.array - ref.array).max() <= 1e-4
    assert not engine.has_unfinished()


def test_pixart_sigma_matches_diffusers(pix_dir, tmp_path):
    import diffusers

    d = _copy(pix_dir, tmp_path, "sigma")
    _edit(d / "model_index.json", _class_name="PixArtSigmaPipeline")
    reqs = [ImageRequest(prompt="a red fox", height=16, width=24, num_inference_steps=3, guidance_scale=4.5, seed=0),
            ImageRequest(prompt="the cat", height=16, width=24, num_inference_steps=2, guidance_scale=1.0, seed=2)]
    outs = DiffusionEngine(d, max_sequence_length=tiny.T5_MAX_LENGTH).generate_outputs(reqs)
    pipe = diffusers.PixArtSigmaPipeline.from_pretrained(d)
    pipe.set_progress_bar_config(disable=True)
    for r, o in zip(reqs, outs):
        ref = pipe(r.prompt, height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
                   guidance_scale=r.guidance_scale, generator=torch.Generator().manual_seed(r.seed), output_type="np",
                   use_resolution_binning=False, clean_caption=False, max_sequence_length=tiny.T5_MAX_LENGTH).images[0]
        assert abs(o.array - ref).max() <= 2e-4


def test_generate_beside_requests_added_by_hand_loses_neither(dit_dir):
    """A stream over an engine that already holds trajectories (add_request) returns its own
    requests in order and keeps the others' outputs for collect() (it raised KeyError)."""
    eng = DiffusionEngine(dit_dir)
    early = eng.add_request(ImageRequest(class_label=1, num_inference_steps=2, seed=4))
    reqs = [ImageRequest(class_label=2, num_inference_steps=3, seed=5), ImageRequest(class_label=3, num_inference_steps=1, seed=6)]
    outs = eng.generate_outputs(reqs)
    alone = DiffusionEngine(dit_dir).generate_outputs(reqs)
    assert [o.index for o in outs] == [0, 1] and all(o.error is None for o in outs)
    assert all(torch.allclose(torch.from_numpy(a.array), torch.from_numpy(b.array), atol=1e-5) for a, b in zip(outs, alone))
    kept = eng.collect()
    while not kept and eng.has_unfinished():
        kept = eng.step()
    assert [o.index for o in kept] == [early] and kept[0].error is None


def test_numpy_numbers_are_taken_as_the_values_they_stand_for(dit_dir):
    import numpy as np

    req = ImageRequest(class_label=np.int64(3), height=np.int32(16), width=np.int64(16),
                       num_inference_steps=np.int64(2), guidance_scale=np.float32(1.5), seed=np.uint32(9))
    assert req.basic_error() is None and type(req.height) is int and type(req.guidance_scale) is float
    plain = ImageRequest(class_label=3, height=16, width=16, num_inference_steps=2, guidance_scale=1.5, seed=9)
    a, b = DiffusionEngine(dit_dir).generate_outputs([req, plain])
    assert a.error is None and np.array_equal(a.array, b.array)
    assert "got True" in ImageRequest(class_label=1, seed=True).basic_error()


def test_a_request_far_past_the_native_size_fails_alone_and_the_cap_can_be_raised(dit_dir, tmp_path):
    # The tiny DiT is native at 16 px (16 tokens): the default cap is 16x that, 256 tokens (64 px).
    # A 16384 px request used to start a forward over 16M tokens and never finish.
    huge = ImageRequest(class_label=1, height=16384, width=16384, num_inference_steps=2)
    edge = ImageRequest(class_label=1, height=64, width=64, num_inference_steps=1)
    over = ImageRequest(class_label=1, height=68, width=64, num_inference_steps=1)
    out = DiffusionEngine(dit_dir).generate([huge, edge, over, ImageRequest(class_label=2, num_inference_steps=1)])
    assert isinstance(out[0], RequestError) and "16,777,216 image tokens" in str(out[0]) \
        and "max_image_tokens 256" in str(out[0])
    assert out[1].size == (64, 64)
    assert isinstance(out[2], RequestError) and "max_image_tokens" in str(out[2])
    assert out[3].size == (16, 16)
    assert DiffusionEngine(dit_dir, max_image_tokens=272).generate([over])[0].size == (64, 68)
    with pytest.raises(ValueError, match="max_image_tokens"):
        DiffusionEngine(dit_dir, max_image_tokens=0)

    from batchgen.cli import main
    inp, res = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/images/generations",
                               "body": {"class_label": 1, "size": "64x68", "num_inference_steps": 1}}) + "\n")
    args = ["run", "--model", str(dit_dir), "--input", str(inp), "--output", str(res)]
    assert main(args) == 3  # its one row failed: a job with every row failed never exits 0
    assert "max_image_tokens" in json.loads(res.read_text())["response"]["body"]["error"]["message"]
    assert main(args + ["--overwrite", "--max-image-tokens", "272"]) == 0
    assert json.loads(res.read_text())["response"]["status_code"] == 200
