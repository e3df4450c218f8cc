"""SD3 and Flux (dev, schnell) against diffusers' own pipelines (fp32 CPU): several requests of mixed
sizes, steps and guidance combined per step, suspend/resume on another engine, bad requests failing
alone, and our CLIP / T5 text side against transformers (the oracle)."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import tiny_mmdit as tm  # noqa: E402
from tiny_diffusion import run_resumed, suspended_in_company  # noqa: E402

from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402
from batchgen.errors import ModelLoadError, RequestError, StateError, UnsupportedModelError  # noqa: E402

# Largest |difference| of [0, 1] image values vs diffusers' pipeline alone per request. Measured
# 1.3e-6 to 2e-6 (rows batched with others and in another CFG order change GEMM blocking only).
TOL = 2e-5
# sd3: shift 3.0 (SD3.5's scheduler); sd3_no_t5: no T5 (zeros) and dynamic shifting by image size
FAMILIES = ("sd3", "sd3_no_t5", "flux_dev", "flux_schnell")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mmdit")
    return {"sd3": tm.build_sd3(base / "sd3"), "sd3_no_t5": tm.build_sd3(base / "sd3_no_t5", t5=False, dynamic=True, seed=5),
            "flux_dev": tm.build_flux(base / "flux_dev"), "flux_schnell": tm.build_flux(base / "schnell", guidance=False)}


def _engine(path: Path, **kw) -> DiffusionEngine:
    return DiffusionEngine(path, max_sequence_length=tm.T5_LENGTH, **kw)


def _guidance(family: str, value: float | None) -> float | None:
    return None if family == "flux_schnell" else value


def _mixed(family: str) -> list[ImageRequest]:
    g = lambda v: _guidance(family, v)  # noqa: E731
    return [ImageRequest(prompt="a red fox in the snow", height=16, width=24, num_inference_steps=3, guidance_scale=g(5.0), seed=0),
            ImageRequest(prompt="the cat", height=16, width=24, num_inference_steps=2, guidance_scale=g(1.0), seed=1),
            ImageRequest(prompt="the dog sleeps", height=32, width=16, num_inference_steps=3, seed=2)]  # the model's default


def _gap(out_array: np.ndarray, ref: torch.Tensor) -> float:
    return float((torch.from_numpy(out_array) - ref).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_diffusers_mixed_sizes_combined_per_step(dirs, family):
    path = dirs[family]
    reqs = _mixed(family)
    engine = _engine(path)
    outs = engine.generate_outputs(reqs)
    # two latent shapes at different timesteps: one packed forward a step (packed_sd3.py, packed_flux.py)
    assert engine.pipe.packs and engine.num_steps_taken == 8 and engine.num_forwards == 3
    for r, o in zip(reqs, outs):
        assert o.error is None and o.image.size == (r.width, r.height)
        ref = tm.reference(path, r.prompt, r.height, r.width, r.num_inference_steps, r.guidance_scale, r.seed)
        assert _gap(o.array, ref) <= TOL, family


@pytest.mark.parametrize("family", ["sd3", "flux_dev"])
def test_suspend_resume_on_another_engine(dirs, family):
    """Suspended at step 2 while it shares the engine (and, packed, its forwards) with a request
    of another shape: resumed alone elsewhere, bit-identical to the run that kept going
    where it was once that company left; resumed beside a request of its own shape (one forward,
    other timesteps), both within TOL of diffusers."""
    path = dirs[family]
    req = ImageRequest(prompt="a blue bird", height=32, width=16, num_inference_steps=4, guidance_scale=3.0, seed=5)
    company = ImageRequest(prompt="a tree", height=16, width=24, num_inference_steps=3, seed=6)
    whole, data = suspended_in_company(lambda: _engine(path), req, company)
    traj = pickle.loads(data)[1]
    assert traj.step == 2 and traj.scheduler_state["_step_index"] == 2
    assert np.array_equal(run_resumed(_engine(path), data)[0], whole)
    third = _engine(path)
    beside = ImageRequest(prompt="the dog", height=32, width=16, num_inference_steps=3, seed=7)
    third.add_request(beside)
    got = run_resumed(third, data)
    assert third.num_forwards == 3  # the two shared every step
    for r, image in zip((beside, req), got):
        ref = tm.reference(path, r.prompt, r.height, r.width, r.num_inference_steps, r.guidance_scale, r.seed)
        assert _gap(image, ref) <= TOL


def test_resume_refuses_another_text_length(dirs):
    first = _engine(dirs["sd3"])
    tid = first.add_request(ImageRequest(prompt="a cat", height=16, width=16, num_inference_steps=3))
    first.step()
    data = first.suspend(tid)
    with pytest.raises(StateError, match="padded to"):
        DiffusionEngine(dirs["sd3"], max_sequence_length=tm.T5_LENGTH + 1).resume(data)


def test_bad_requests_fail_alone(dirs):
    schnell = _engine(dirs["flux_schnell"])
    out = schnell.generate([ImageRequest(prompt="a fox", height=16, width=16, num_inference_steps=2, guidance_scale=3.5),
                            ImageRequest(prompt="a fox", height=18, width=16, num_inference_steps=2),
                            ImageRequest(prompt="a fox", height=16, width=16, num_inference_steps=2, seed=1),
                            ImageRequest(class_label=3, num_inference_steps=2),
                            ImageRequest(prompt="word " * 40, height=16, width=16, num_inference_steps=2)])
    assert not isinstance(out[2], RequestError)
    msgs = [str(o) for o in out if isinstance(o, RequestError)]
    assert len(msgs) == 4
    assert "guidance_scale 3.5" in msgs[0] and "no guidance" in msgs[0]
    assert "height 18 is not a multiple of 4 (patch 2 x VAE factor 2)" in msgs[1]
    assert "text-to-image" in msgs[2]
    assert "max_sequence_length 24" in msgs[3]
    sd3 = _engine(dirs["sd3"], max_image_tokens=64)
    out = sd3.generate([ImageRequest(prompt="a fox", height=64, width=32, num_inference_steps=2),
                        ImageRequest(prompt="a fox", height=16, width=20, num_inference_steps=2, guidance_scale=-1.0),
                        ImageRequest(prompt="a fox", height=16, width=16, num_inference_steps=2)])
    assert "max_image_tokens 64" in str(out[0]) and "guidance_scale" in str(out[1])
    assert not isinstance(out[2], RequestError)


def test_our_clip_encoders_and_tokenizers_equal_transformers(dirs):
    """clip.py (plain torch, `tokenizers` over vocab.json + merges.txt or tokenizer.json) against
    transformers' CLIPTokenizer, CLIPTextModelWithProjection (SD3's two) and CLIPTextModel (Flux's):
    the same ids (padding with '!' for CLIP-G, truncation keeping the end token), hidden states and
    pooled / projected outputs."""
    import transformers

    from batchgen.diffusion.models.clip import CLIPTextEncoder, CLIPTokens

    texts = ["a red fox", "", "The QUICK brown fox, jumps over the lazy dog's 42 bones " * 3, "naïve  café"]
    cases = [(dirs["sd3"], "", transformers.CLIPTextModelWithProjection),
             (dirs["sd3"], "_2", transformers.CLIPTextModelWithProjection),
             (dirs["flux_dev"], "", transformers.CLIPTextModel)]
    assert not (dirs["sd3"] / "tokenizer" / "tokenizer.json").exists()
    assert (dirs["sd3"] / "tokenizer_2" / "tokenizer.json").exists()
    for root, n, cls in cases:
        ref_tok = transformers.CLIPTokenizer.from_pretrained(root / f"tokenizer{n}")
        ref = ref_tok(texts, padding="max_length", max_length=ref_tok.model_max_length, truncation=True,
                      return_tensors="pt").input_ids
        ours = CLIPTokens(root / f"tokenizer{n}")
        ids = ours.batch(texts, ours.max_length)
        assert torch.equal(ids, ref), (root.name, n)
        model = cls.from_pretrained(root / f"text_encoder{n}").eval()
        with torch.no_grad():
            want = model(ref, output_hidden_states=True)
        hidden, pooled = CLIPTextEncoder(root / f"text_encoder{n}", torch.float32, "cpu")(ids)
        torch.testing.assert_close(hidden, want.hidden_states[-2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pooled, want.text_embeds if cls is transformers.CLIPTextModelWithProjection
                                   else want.pooler_output, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["sd3", "sd3_no_t5", "flux_dev"])
def test_prompt_embeddings_equal_the_pipelines_encode_prompt(dirs, family):
    """mmdit_text.py's SD3 / Flux assembly of CLIP and T5 outputs against diffusers' encode_prompt
    (its encoders are transformers')."""
    from batchgen.diffusion.models.pipeline import load_pipeline

    path = dirs[family]
    ref = tm.pipeline(tm.pipeline_class(path), str(path))
    prompts = ["a red fox in the snow", ""]
    got = load_pipeline(path, max_sequence_length=tm.T5_LENGTH).text_encoder.encode(prompts)
    with torch.no_grad():
        if family.startswith("sd3"):
            embeds, _, pooled, _ = ref.encode_prompt(prompts, prompts, prompts, do_classifier_free_guidance=False,
                                                     max_sequence_length=tm.T5_LENGTH)
        else:
            embeds, pooled, _ = ref.encode_prompt(prompts, prompts, max_sequence_length=tm.T5_LENGTH)
    for i in range(len(prompts)):
        torch.testing.assert_close(got[i]["embeds"], embeds[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[i]["pooled"], pooled[i], rtol=1e-5, atol=1e-5)


def test_unsupported_components_fail_at_load(dirs, tmp_path):
    import shutil

    from tiny_diffusion import scheduler

    bad = shutil.copytree(dirs["flux_schnell"], tmp_path / "ddim")
    scheduler("ddim").save_pretrained(bad / "scheduler")
    index = json.loads((bad / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "DDIMScheduler"]
    (bad / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedModelError, match="DDIMScheduler.*flux"):
        DiffusionEngine(bad)
    noisy = shutil.copytree(dirs["flux_schnell"], tmp_path / "noisy")
    tm.flow_scheduler(stochastic_sampling=True).save_pretrained(noisy / "scheduler")
    with pytest.raises(UnsupportedModelError, match="stochastic_sampling"):
        DiffusionEngine(noisy)
    wrong = shutil.copytree(dirs["sd3"], tmp_path / "wrong")
    index = json.loads((wrong / "model_index.json").read_text())
    index["text_encoder_2"] = ["transformers", "CLIPTextModel"]
    (wrong / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedModelError, match="text_encoder_2 class 'CLIPTextModel'"):
        DiffusionEngine(wrong)
    gone = shutil.copytree(dirs["sd3"], tmp_path / "gone")
    shutil.rmtree(gone / "tokenizer_3")
    with pytest.raises(ModelLoadError, match="tokenizer_3"):
        DiffusionEngine(gone)


def test_a_failing_forward_fails_only_its_shape(dirs, monkeypatch):
    import batchgen.diffusion.engine.denoise as denoise

    engine = _engine(dirs["flux_schnell"])
    f = engine.pipe.vae_scale_factor
    predict, packed = denoise.predict, denoise.predict_packed
    huge = (32 // f, 16 // f)  # the 32 x 16 px request's latents

    def fragile(pipe, x, t, cond, sp=None):
        if tuple(x.shape[-2:]) == huge:
            raise RuntimeError("out of memory (simulated)")
        return predict(pipe, x, t, cond, sp)

    def fragile_pack(pipe, parts):  # both shapes in one packed forward: it fails, then each shape alone
        if any(tuple(x.shape[-2:]) == huge for x, _, _ in parts):
            raise RuntimeError("out of memory (simulated)")
        return packed(pipe, parts)

    monkeypatch.setattr(denoise, "predict", fragile)
    monkeypatch.setattr(denoise, "predict_packed", fragile_pack)
    reqs = _mixed("flux_schnell")
    outs = engine.generate_outputs(reqs)
    assert "denoising step 0 failed: RuntimeError: out of memory (simulated)" in outs[2].error
    for r, o in zip(reqs[:2], outs[:2]):
        ref = tm.reference(dirs["flux_schnell"], r.prompt, r.height, r.width, r.num_inference_steps, None, r.seed)
        assert o.error is None and _gap(o.array, ref) <= TOL


def test_batchgen_run_and_diffuse_take_mmdit_pipelines(dirs, tmp_path, capsys):
    """`batchgen run` on an image JSONL (Flux-schnell, the pipeline's own max_sequence_length) and
    batchgen.diffuse on a DataFrame (SD3), both in this process, as for DiT and PixArt."""
    import pandas as pd
    from PIL import Image

    import batchgen
    from batchgen.cli import main

    def line(cid: str, body: dict) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/images/generations", "body": body})

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([line("a", {"prompt": "a red fox", "size": "24x16", "n": 2, "num_inference_steps": 2, "seed": 1}),
                              line("b", {"prompt": "a fox", "size": "16x16", "guidance_scale": 3.5}),
                              line("c", {"prompt": "a fox", "size": "18x16"})]) + "\n")
    assert main(["run", "--model", str(dirs["flux_schnell"]), "--input", str(inp), "--output", str(out),
                 "--progress", "off", "--max-error-rate", "1"]) == 0
    by_id = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert "guidance_scale 3.5: this FluxPipeline has no guidance" in by_id["b"]["body"]["error"]["message"]
    assert by_id["b"]["status_code"] == 400 and by_id["c"]["status_code"] == 400
    assert "width 18 is not a multiple of 4" in by_id["c"]["body"]["error"]["message"]
    got = [np.asarray(Image.open(d["url"])) for d in by_id["a"]["body"]["data"]]
    want = DiffusionEngine(dirs["flux_schnell"]).generate(
        [ImageRequest(prompt="a red fox", height=16, width=24, num_inference_steps=2, seed=s) for s in (1, 2)])
    for g, w in zip(got, want):
        assert g.shape == (16, 24, 3) and np.abs(g.astype(int) - np.asarray(w).astype(int)).max() <= 1

    pdf = pd.DataFrame({"prompt": ["a red fox", "a cat", "a dog"], "height": [16, 32, 16], "width": [24, 16, 18],
                        "num_inference_steps": [2, 3, 2], "guidance_scale": [4.0, None, None], "seed": [0, 1, 2]})
    res = batchgen.diffuse(pdf, model=dirs["sd3"], output_dir=tmp_path / "png",
                           engine_options={"max_sequence_length": tm.T5_LENGTH})
    assert res["error"].isna().tolist() == [True, True, False] and "width 18" in res["error"][2]
    want = _engine(dirs["sd3"]).generate([ImageRequest(prompt=p, height=h, width=w, num_inference_steps=n, seed=s,
                                                       guidance_scale=g)
                                          for p, h, w, n, s, g in zip(pdf.prompt, pdf.height, pdf.width,
                                                                      pdf.num_inference_steps, pdf.seed, (4.0, None))])
    for path, w in zip(res["image_path"][:2], want):
        assert np.abs(np.asarray(Image.open(path)).astype(int) - np.asarray(w).astype(int)).max() <= 1


def test_calibrate_times_mmdit_forwards(dirs):
    from batchgen.diffusion.distributed.calibrate import calibrate
    from batchgen.diffusion.distributed.elastic_loop import allowed_degrees
    from batchgen.diffusion.models.pipeline import load_pipeline

    for family in ("sd3", "flux_dev"):
        pipe = load_pipeline(dirs[family], max_sequence_length=tm.T5_LENGTH)
        cost = calibrate(pipe, rows=(1, 2), latents=(4, 8))
        assert cost.fixed >= 0 and cost.per_token >= 0
        # Ulysses splits the heads: SD3's 4 over 1, 2 or 4 workers, Flux's 2 over 1 or 2
        assert allowed_degrees(pipe, 4) == ((1, 2, 4) if family == "sd3" else (1, 2))
