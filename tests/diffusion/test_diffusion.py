"""batchgen.diffusion against diffusers' own pipelines, one request at a time (fp32 CPU)."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import tiny_diffusion as tiny  # noqa: E402

from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402
from batchgen.errors import ModelLoadError, RequestError, StateError, UnsupportedModelError  # noqa: E402

# Largest |difference| of [0, 1] image values vs diffusers alone, per scheduler: batching
# changes GEMM blocking (~1e-6 per forward); multistep DPM-Solver carries it further.
TOL = {"ddim": 1e-4, "dpm": 2e-4, "euler": 1e-4, "ddpm": 1e-4}


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny.build_dit(tmp_path_factory.mktemp("dit") / "pipe")


@pytest.fixture(scope="module")
def pixart_dirs(tmp_path_factory: pytest.TempPathFactory):
    base = tiny.build_pixart(tmp_path_factory.mktemp("pix") / "dpm", sched="dpm")
    return {"dpm": base, **{s: tiny.with_scheduler(base, base.parent / s, s) for s in ("euler", "ddpm")}}


def _pix_engine(path, **kw):
    return DiffusionEngine(path, max_sequence_length=tiny.T5_MAX_LENGTH, **kw)


def test_dit_matches_diffusers_mixed_batch(dit_dir):
    reqs = [ImageRequest(class_label=3, num_inference_steps=9, guidance_scale=4.0, seed=0),
            ImageRequest(class_label=5, num_inference_steps=4, guidance_scale=1.0, seed=1),
            ImageRequest(class_label=5, num_inference_steps=6, guidance_scale=2.5, seed=7),
            ImageRequest(class_label=0, num_inference_steps=9, guidance_scale=1.0, seed=2)]
    engine = DiffusionEngine(dit_dir)
    outs = engine.generate_outputs(reqs)
    # one forward per step for all four (guided and not, timesteps apart): 9 forwards, not 28
    assert engine.num_forwards == 9 and engine.num_steps_taken == 28
    for r, o in zip(reqs, outs):
        assert o.error is None and o.image.size == (16, 16)
        ref = tiny.reference_dit(dit_dir, r.class_label, r.num_inference_steps, r.guidance_scale, r.seed)
        assert (torch.from_numpy(o.array) - ref).abs().max() <= TOL["ddim"]
        assert np.array_equal(np.asarray(o.image), (ref.numpy() * 255).round().astype(np.uint8)) or \
            np.abs(np.asarray(o.image).astype(int) - (ref.numpy() * 255).round()).max() <= 1


@pytest.mark.parametrize("sched", ["dpm", "euler", "ddpm"])
def test_pixart_matches_diffusers_mixed_sizes_steps_guidance(pixart_dirs, sched):
    path = pixart_dirs[sched]
    reqs = [ImageRequest(prompt="a red fox in the snow", height=16, width=24, num_inference_steps=6, guidance_scale=4.5, seed=0),
            ImageRequest(prompt="the cat", height=16, width=24, num_inference_steps=4, guidance_scale=1.0, seed=2),
            ImageRequest(prompt="the dog sleeps", height=32, width=16, num_inference_steps=5, guidance_scale=3.0, seed=3),
            ImageRequest(prompt="a house", height=16, width=24, num_inference_steps=2, guidance_scale=2.0, seed=4)]
    engine = _pix_engine(path)
    outs = engine.generate_outputs(reqs)
    assert engine.num_forwards < engine.num_steps_taken
    for r, o in zip(reqs, outs):
        assert o.error is None and o.image.size == (r.width, r.height)
        ref = tiny.reference_pixart(path, r.prompt, r.height, r.width, r.num_inference_steps, r.guidance_scale, r.seed)
        assert (torch.from_numpy(o.array) - ref).abs().max() <= TOL[sched], sched


def test_one_forward_for_different_timesteps(dit_dir):
    engine = DiffusionEngine(dit_dir)
    engine.add_request(ImageRequest(class_label=1, num_inference_steps=6, guidance_scale=3.0, seed=0))
    engine.step()
    engine.step()
    late = engine.add_request(ImageRequest(class_label=2, num_inference_steps=6, guidance_scale=5.0, seed=1))
    before = engine.num_forwards
    engine.step()  # first at step 2, the newcomer at step 0: one forward of 4 rows
    assert engine.num_forwards == before + 1 and engine.trajectory(late).step == 1


def test_bad_requests_fail_alone(dit_dir, pixart_dirs):
    engine = DiffusionEngine(dit_dir)
    good = ImageRequest(class_label=1, num_inference_steps=3, seed=0)
    out = engine.generate([ImageRequest(class_label=1, num_inference_steps=0), good,
                           ImageRequest(class_label=10, num_inference_steps=3),
                           ImageRequest(class_label=1, height=18, width=18, num_inference_steps=3),
                           ImageRequest(prompt="x", num_inference_steps=3)])
    assert isinstance(out[1], __import__("PIL.Image").Image.Image)
    msgs = [str(o) for o in out if isinstance(o, RequestError)]
    assert len(msgs) == 4
    assert "num_inference_steps" in msgs[0] and "0" in msgs[0]
    assert "class_label 10" in msgs[1]
    assert "height 18 is not a multiple of 4" in msgs[2]
    assert "class-conditional" in msgs[3]
    pix = _pix_engine(pixart_dirs["dpm"])
    out = pix.generate([ImageRequest(prompt="word " * 40, num_inference_steps=2), ImageRequest(prompt="ok", num_inference_steps=2)])
    assert isinstance(out[0], RequestError) and "max_sequence_length 32" in str(out[0])
    assert not isinstance(out[1], RequestError)


def test_unsupported_pipeline_and_scheduler_fail_at_load(tmp_path, dit_dir):
    with pytest.raises(ModelLoadError, match="model_index.json"):
        DiffusionEngine(tmp_path)
    bad = tiny.build_dit(tmp_path / "unipc", sched="UniPCMultistepScheduler")
    with pytest.raises(UnsupportedModelError, match="UniPCMultistepScheduler"):
        DiffusionEngine(bad)
    index = json.loads((bad / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionPipeline"
    (bad / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedModelError, match="StableDiffusionPipeline"):
        DiffusionEngine(bad)


@pytest.mark.parametrize("which", ["dit", "dpm", "ddpm"])
def test_suspend_resume_on_another_engine_is_bit_identical(dit_dir, pixart_dirs, which):
    if which == "dit":
        path, req, make = dit_dir, ImageRequest(class_label=4, num_inference_steps=7, guidance_scale=3.0, seed=5), DiffusionEngine
    else:
        path, make = pixart_dirs[which], _pix_engine
        req = ImageRequest(prompt="a blue bird", height=16, width=24, num_inference_steps=7, guidance_scale=3.0, seed=5)
    whole = make(path).generate_outputs([req])[0].array
    first = make(path)
    tid = first.add_request(req)
    for _ in range(3):
        first.step()
    data = first.suspend(tid)
    assert isinstance(data, bytes) and not first.has_unfinished()
    traj = pickle.loads(data)[1]
    assert traj.step == 3 and traj.rng_state is not None
    if which == "dpm":  # DDIM and DDPM keep no cursor (the step index is ours); DPM-Solver its history
        assert traj.scheduler_state["model_outputs"] and traj.scheduler_state["_step_index"] == 3
    second = make(path)
    second.resume(data)
    outs = []
    while second.has_unfinished():
        outs += second.step()
    assert np.array_equal(outs[0].array, whole)


def test_resume_refuses_other_model_and_garbage(dit_dir, pixart_dirs):
    first = DiffusionEngine(dit_dir)
    tid = first.add_request(ImageRequest(class_label=4, num_inference_steps=3))
    first.step()
    data = first.suspend(tid)
    with pytest.raises(StateError, match="suspended on model"):
        _pix_engine(pixart_dirs["dpm"]).resume(data)
    with pytest.raises(StateError):
        first.resume(b"not a state")


def test_our_t5_encoder_and_tokenizer_equal_transformers(pixart_dirs):
    """batchgen.diffusion.models.t5 (plain torch, `tokenizers`) against transformers' T5, the oracle:
    the same ids and mask (padding, and truncation keeping </s> last) and the same embeddings."""
    import transformers

    from batchgen.diffusion.models.t5 import T5Encoder, T5Tokens

    root = pixart_dirs["dpm"]
    texts = ["a red fox", "", "the quick brown fox jumps over the lazy dog " * 8]
    ref_tok = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    ref = ref_tok(texts, padding="max_length", max_length=tiny.T5_MAX_LENGTH, truncation=True, return_tensors="pt")
    ids, mask = T5Tokens(root / "tokenizer").batch(texts, tiny.T5_MAX_LENGTH)
    assert torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)
    ref_enc = transformers.T5EncoderModel.from_pretrained(root / "text_encoder").eval()
    with torch.no_grad():
        want = ref_enc(ref.input_ids, attention_mask=ref.attention_mask)[0]
    got = T5Encoder(root / "text_encoder", torch.float32, "cpu")(ids, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
