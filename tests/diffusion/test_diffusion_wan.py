"""Wan 2.1 text-to-video against diffusers' own WanPipeline (fp32 CPU), with diffusers' tests'
flow-matching Euler scheduler and with Wan 2.1's own UniPC: several requests of mixed frame counts
and sizes combined per step, suspend/resume on another engine, bad requests failing alone, our
UMT5 encoder against transformers', and the frames written as PNGs and MP4."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import tiny_wan as tw  # noqa: E402
from tiny_diffusion import run_resumed, suspended_in_company  # noqa: E402

from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402
from batchgen.errors import RequestError  # noqa: E402

# Largest |difference| of [0, 1] frame values vs diffusers' pipeline alone per request. Measured
# 7e-7 to 2.1e-6 (flow-matching Euler) and 8.6e-7 to 1.4e-6 (UniPC) over the mixed requests: rows
# batched with others and CFG's two rows in one forward (WanPipeline: two) change GEMM blocking
# only. A guidance of 4.0 for 5.0 moves the frames by 4.8e-4, a prompt's letter by 1.7e-3.
TOL = 2e-5


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tw.build_wan(tmp_path_factory.mktemp("wan") / "wan")


@pytest.fixture(scope="module")
def dirs(wan: Path) -> dict[str, Path]:
    """The pipeline with diffusers' tests' scheduler (flow-matching Euler, shift 7) and with Wan
    2.1's own (UniPC multistep over flow sigmas, shift 3)."""
    return {"euler": wan, "unipc": tw.with_unipc(wan, wan.with_name("wan_unipc"))}


def _engine(path: Path, **kw) -> DiffusionEngine:
    return DiffusionEngine(path, max_sequence_length=tw.TEXT_LENGTH, **kw)


def _gap(out_array: np.ndarray, ref: torch.Tensor) -> float:
    return float((torch.from_numpy(out_array) - ref).abs().max())


def _ref(path: Path, r: ImageRequest) -> torch.Tensor:
    return tw.reference(path, r.prompt, r.height, r.width, r.num_frames, r.num_inference_steps, r.guidance_scale, r.seed)


MIXED = [ImageRequest(prompt="a red fox in the snow", height=16, width=16, num_frames=5, num_inference_steps=3, seed=0),
         ImageRequest(prompt="the cat", height=32, width=16, num_frames=9, num_inference_steps=2, guidance_scale=1.0,
                      seed=1),
         ImageRequest(prompt="  the  dog &amp; sleeps ", height=16, width=16, num_frames=5, num_inference_steps=3,
                      guidance_scale=3.0, seed=2),
         ImageRequest(prompt="a tree", height=32, width=16, num_frames=9, num_inference_steps=3, seed=3)]


@pytest.mark.parametrize("sched", ["euler", "unipc"])
def test_matches_diffusers_mixed_frames_and_sizes_combined_per_step(dirs, sched):
    wan = dirs[sched]
    engine = _engine(wan)
    outs = engine.generate_outputs(MIXED)
    # two latent shapes ([16, 2, 2, 2] and [16, 3, 4, 2]): one token-packed forward a step for both,
    # requests at different timesteps (and with or without guidance) sharing it
    assert engine.num_steps_taken == 11 and engine.num_forwards == 3
    gaps = []
    for r, o in zip(MIXED, outs):
        assert o.error is None and o.array.shape == (r.num_frames, r.height, r.width, 3)
        assert len(o.frames) == r.num_frames and o.frames[0].size == (r.width, r.height)
        gaps.append(_gap(o.array, _ref(wan, r)))
    assert max(gaps) <= TOL, gaps


def test_wan22_two_experts_each_take_their_steps_as_diffusers(tmp_path):
    """Wan 2.2 A14B's layout: transformer_2 runs the steps below boundary_ratio x 1000 (with shift
    7 and 3 steps the timesteps are 1000, 876.5, 46.8: boundary 900 gives the first step to
    `transformer`). A request joining a step late puts both experts in one step."""
    path = tw.build_wan(tmp_path / "wan22", boundary_ratio=0.9, seed=4)
    engine = _engine(path)
    assert engine.pipe.transformer_2 is not None and engine.pipe.boundary_ratio == 0.9
    first, late = MIXED[3], MIXED[0]
    ids = [engine.add_request(first)]
    engine.step()
    ids.append(engine.add_request(late))  # at step 1 `first` is at 876.5 (low noise), `late` at 1000
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    got = {o.index: o for o in outs}
    for r, tid in zip((first, late), ids):
        assert got[tid].error is None and _gap(got[tid].array, _ref(path, r)) <= TOL
    # without its second expert (transformer alone throughout) the video is another one
    alone = tw.build_wan(tmp_path / "wan21", seed=4)
    assert _gap(_engine(alone).generate_outputs([first])[0].array, _ref(path, first)) > 100 * TOL


@pytest.mark.parametrize("sched", ["euler", "unipc"])
def test_suspend_resume_on_another_engine(dirs, sched):
    """Suspended at step 2 while it shares the engine (and, packed, its forwards) with a request of
    another frame count: resumed alone elsewhere, bit-identical to the run that kept going where
    it was once that company left; resumed beside a request of its own shape, both within TOL of
    diffusers. UniPC's multistep history travels too."""
    wan = dirs[sched]
    req = ImageRequest(prompt="a blue bird", height=32, width=16, num_frames=9, num_inference_steps=4,
                       guidance_scale=4.0, seed=5)
    company = ImageRequest(prompt="a tree", height=16, width=16, num_frames=5, num_inference_steps=3, seed=6)

    whole, data = suspended_in_company(lambda: _engine(wan), req, company)
    traj = pickle.loads(data)[1]
    assert traj.step == 2 and traj.num_frames == 9 and tuple(traj.latents.shape) == (16, 3, 4, 2)
    assert np.array_equal(run_resumed(_engine(wan), data)[0], whole)
    third = _engine(wan)
    beside = ImageRequest(prompt="the dog", height=32, width=16, num_frames=9, num_inference_steps=3, seed=7)
    third.add_request(beside)
    got = run_resumed(third, data)
    assert third.num_forwards == 3  # the two shared every step
    for r, video in zip((beside, req), got):
        assert _gap(video, _ref(wan, r)) <= TOL


def test_bad_requests_fail_alone(wan, tmp_path):
    from tiny_diffusion import build_dit

    out = _engine(wan).generate([
        ImageRequest(prompt="a fox", height=16, width=16, num_frames=6, num_inference_steps=2),
        ImageRequest(prompt="a fox", height=24, width=16, num_frames=5, num_inference_steps=2),
        ImageRequest(prompt="a fox", height=16, width=16, num_frames=5, num_inference_steps=2, seed=1),
        ImageRequest(prompt="a fox", height=16, width=16, num_frames=0, num_inference_steps=2),
        ImageRequest(class_label=3, height=16, width=16, num_frames=5, num_inference_steps=2),
        ImageRequest(prompt="word " * 40, height=16, width=16, num_frames=5, num_inference_steps=2)])
    assert isinstance(out[2], list) and len(out[2]) == 5
    msgs = [str(o) for o in out if isinstance(o, RequestError)]
    assert len(msgs) == 5
    assert "num_frames 6" in msgs[0] and "4k + 1" in msgs[0]
    assert "height 24 is not a multiple of 16" in msgs[1]
    assert "num_frames must be a positive integer, got 0" in msgs[2]
    assert "text-to-video" in msgs[3]
    assert "max_sequence_length 16" in msgs[4]
    dit = _engine(build_dit(tmp_path / "dit"))
    out = dit.generate([ImageRequest(class_label=1, num_frames=5, num_inference_steps=2),
                        ImageRequest(class_label=1, num_inference_steps=2)])
    assert "num_frames 5: this DiTPipeline makes images" in str(out[0]) and not isinstance(out[1], RequestError)


def test_umt5_encoder_and_prompt_embeddings_equal_transformers_and_the_pipeline(wan):
    """t5.py with a bias table per layer (UMT5) against transformers' UMT5EncoderModel, and the
    prompt embeddings (cleaned, zeroed past each prompt) against WanPipeline.encode_prompt."""
    import transformers

    from batchgen.diffusion.models.condition import encode_prompts
    from batchgen.diffusion.models.pipeline import load_pipeline
    from batchgen.diffusion.models.t5 import T5Encoder, T5Tokens

    texts = ["a red fox", "", "The QUICK brown fox, jumps over the lazy dog's 42 bones " * 3, " a &amp;  b "]
    ref_tok = transformers.AutoTokenizer.from_pretrained(wan / "tokenizer")
    ref = ref_tok(texts, padding="max_length", max_length=tw.TEXT_LENGTH, truncation=True, return_tensors="pt")
    ids, mask = T5Tokens(wan / "tokenizer").batch(texts, tw.TEXT_LENGTH)
    assert torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)
    model = transformers.UMT5EncoderModel.from_pretrained(wan / "text_encoder").eval()
    with torch.no_grad():
        want = model(ref.input_ids, ref.attention_mask).last_hidden_state
    encoder = T5Encoder(wan / "text_encoder", torch.float32, "cpu")
    assert encoder.config.bias_per_layer
    torch.testing.assert_close(encoder(ids, mask), want, rtol=1e-5, atol=1e-5)
    pipe = load_pipeline(wan, max_sequence_length=tw.TEXT_LENGTH)
    got = encode_prompts(pipe, texts)
    with torch.no_grad():
        embeds, _ = tw.pipeline(wan).encode_prompt(texts, do_classifier_free_guidance=False,
                                                   max_sequence_length=tw.TEXT_LENGTH)
    for i in range(len(texts)):
        torch.testing.assert_close(got[i]["embeds"], embeds[i], rtol=1e-5, atol=1e-5)


def _frames_of(folder: str) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(p)) for p in sorted(Path(folder).glob("*.png"))])


def test_batchgen_run_and_diffuse_write_videos(wan, tmp_path):
    """`batchgen run` on an image JSONL with num_frames and batchgen.diffuse with a num_frames
    column, both in this process: frame PNGs equal to the engine's frames, and an MP4 of them."""
    import pandas as pd

    import batchgen
    from batchgen.cli import main

    av = pytest.importorskip("av")

    def line(cid: str, body: dict) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/images/generations", "body": body})

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([line("a", {"prompt": "a red fox", "size": "16x32", "num_frames": 5, "n": 2,
                                         "num_inference_steps": 2, "seed": 1}),
                              line("b", {"prompt": "a fox", "size": "16x16", "num_frames": 6}),
                              line("c", {"prompt": "a fox", "num_frames": 5, "response_format": "b64_json"})]) + "\n")
    assert main(["run", "--model", str(wan), "--input", str(inp), "--output", str(out), "--progress", "off",
                 "--max-error-rate", "1"]) == 0
    by_id = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert "num_frames 6 is not 4k + 1" in by_id["b"]["body"]["error"]["message"]
    assert by_id["c"]["status_code"] == 400 and "body.response_format" in by_id["c"]["body"]["error"]["message"]
    want = DiffusionEngine(wan).generate([ImageRequest(prompt="a red fox", height=32, width=16, num_frames=5,
                                                       num_inference_steps=2, seed=s) for s in (1, 2)])
    for item, frames in zip(by_id["a"]["body"]["data"], want):
        got = _frames_of(item["frames_dir"])
        assert got.shape == (5, 32, 16, 3)
        assert np.abs(got.astype(int) - np.stack([np.asarray(f) for f in frames]).astype(int)).max() <= 1
        with av.open(item["url"]) as video:
            assert sum(1 for _ in video.decode(video=0)) == 5

    pdf = pd.DataFrame({"prompt": ["a red fox", "a cat"], "height": [16, 16], "width": [16, 24],
                        "num_frames": [5, 5], "num_inference_steps": [2, 2], "seed": [0, 1]})
    res = batchgen.diffuse(pdf, model=wan, output_dir=tmp_path / "videos",
                           engine_options={"max_sequence_length": tw.TEXT_LENGTH})
    assert res["error"].isna().tolist() == [True, False] and "width 24 is not a multiple of 16" in res["error"][1]
    assert res["image_path"].isna().all() and res["video_path"][0].endswith(".mp4")
    want = _engine(wan).generate([ImageRequest(prompt="a red fox", height=16, width=16, num_frames=5,
                                               num_inference_steps=2, seed=0)])[0]
    got = _frames_of(res["frames_dir"][0])
    assert np.abs(got.astype(int) - np.stack([np.asarray(f) for f in want]).astype(int)).max() <= 1


def test_calibrate_times_wan_forwards(wan):
    from batchgen.diffusion.distributed.calibrate import calibrate
    from batchgen.diffusion.distributed.elastic_loop import allowed_degrees
    from batchgen.diffusion.models.pipeline import load_pipeline

    pipe = load_pipeline(wan, max_sequence_length=tw.TEXT_LENGTH)
    cost = calibrate(pipe, rows=(1, 2), latents=(4, 8))
    assert cost.fixed >= 0 and cost.per_token >= 0
    assert allowed_degrees(pipe, 4) == (1, 2)  # Ulysses splits its 2 heads


def test_unsupported_wan_components_fail_at_load(wan, tmp_path):
    import shutil

    from tiny_diffusion import scheduler

    from batchgen.errors import ModelLoadError, UnsupportedModelError

    def copy_with(name: str, **entries: object) -> Path:  # the pipeline with model_index.json entries set
        dst = shutil.copytree(wan, tmp_path / name)
        index = json.loads((dst / "model_index.json").read_text())
        (dst / "model_index.json").write_text(json.dumps({**index, **entries}))
        return dst

    bad = copy_with("ddim", scheduler=["diffusers", "DDIMScheduler"])
    scheduler("ddim").save_pretrained(bad / "scheduler")
    with pytest.raises(UnsupportedModelError, match="DDIMScheduler.*not supported for wan"):
        DiffusionEngine(bad)
    # Wan 2.2's second expert needs its folder and a boundary in (0, 1)
    with pytest.raises(ModelLoadError, match="'transformer_2' must be a WanTransformer3DModel with a transformer_2/"):
        DiffusionEngine(copy_with("two", transformer_2=["diffusers", "WanTransformer3DModel"]))
    two = copy_with("boundary", transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=1.5)
    shutil.copytree(two / "transformer", two / "transformer_2")
    with pytest.raises(ModelLoadError, match="boundary_ratio must be a number in \\(0, 1\\), got 1.5"):
        DiffusionEngine(two)
    with pytest.raises(UnsupportedModelError, match="expand_timesteps"):
        DiffusionEngine(copy_with("ti2v", expand_timesteps=True))


def test_b64_json_for_a_video_fails_its_line_even_without_num_frames() -> None:
    """A line may leave num_frames out on a video model (its default length): the reader cannot
    know it asked for a video, so the backend refuses b64_json once the frames come back."""
    from PIL import Image

    from batchgen.diffusion.engine.output import ImageOutput
    from batchgen.diffusion.jobs.images_batch import DiffusionBackend

    def stream(requests, in_flight):  # noqa: ANN001, ANN202 - a stand-in for an engine's stream
        for i, req in enumerate(requests):
            frame = Image.new("RGB", (2, 2))
            yield i, (ImageOutput(index=i, frames=[frame] * 5) if req.prompt == "video"
                      else ImageOutput(index=i, image=frame))

    lines = [([ImageRequest(prompt="video")], "b64_json"), ([ImageRequest(prompt="video")], "url"),
             ([ImageRequest(prompt="image")], "b64_json")]
    got = dict(DiffusionBackend(stream).run(iter(lines), 8))
    assert "body.response_format" in got[0].error and got[0].images == []
    assert got[1].error is None and len(got[1].images[0]) == 5
    assert got[2].error is None and got[2].images[0].size == (2, 2)


def test_a_prompt_the_text_encoder_fails_on_fails_alone(wan, monkeypatch) -> None:
    """The encoder runs a few prompts per call; a call that raises is retried prompt by prompt."""
    import batchgen.diffusion.engine.encoding as encoding

    encode = encoding.encode_prompts

    def fragile(pipe, prompts):  # noqa: ANN001, ANN202
        if "poison" in prompts:
            raise RuntimeError("out of memory (injected)")
        return encode(pipe, prompts)

    reqs = [ImageRequest(prompt=p, num_frames=5, height=16, width=16, num_inference_steps=2, seed=i)
            for i, p in enumerate(["a fox", "poison", "a boat"])]
    want = DiffusionEngine(wan).generate_outputs([reqs[0], reqs[2]])
    monkeypatch.setattr(encoding, "encode_prompts", fragile)
    outs = DiffusionEngine(wan).generate_outputs(reqs)
    assert "text encoder failed" in outs[1].error and "out of memory (injected)" in outs[1].error
    for got, ref in zip((outs[0], outs[2]), want):
        assert got.error is None and np.abs(got.array - ref.array).max() <= 1e-5
