"""Token-packed forwards (batchgen/diffusion/models/packed.py, packed_wan.py, packed_sd3.py, packed_flux.py): several latent shapes
in one forward, against diffusers' own transformer forward per shape (fp32 CPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import tiny_diffusion as tiny  # noqa: E402
import tiny_mmdit  # noqa: E402
import tiny_wan  # noqa: E402

from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402
from batchgen.diffusion.models.mmdit import predict_mmdit  # noqa: E402
from batchgen.diffusion.models.packed import packable, predict_packed  # noqa: E402
from batchgen.diffusion.models.pipeline import load_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("packed")
    return {"dit": tiny.build_dit(base / "dit", layers=2, heads=2, head_dim=8),
            "pixart": tiny.build_pixart(base / "pix"),
            "wan": tiny_wan.build_wan(base / "wan"),
            "sd3": tiny_mmdit.build_sd3(base / "sd3"),
            "flux": tiny_mmdit.build_flux(base / "flux"),
            "flux_schnell": tiny_mmdit.build_flux(base / "schnell", guidance=False)}


def _parts(pipe, shapes, gen: torch.Generator):
    m = pipe.transformer
    parts = []
    for b, shape in shapes:
        x = torch.randn(b, pipe.latent_channels, *shape, generator=gen)  # Wan: (latent frames, h, w)
        t = torch.randint(0, 1000, (b,), generator=gen)
        if pipe.family in ("sd3", "flux"):  # flow matching: timesteps are sigma x 1000, any real
            t = torch.rand(b, generator=gen) * 1000
            cond = {"embeds": torch.randn(b, pipe.text_length, m.config.joint_attention_dim, generator=gen),
                    "pooled": torch.randn(b, m.config.pooled_projection_dim, generator=gen)}
            if pipe.guidance_embeds:
                cond["guidance"] = 1 + 4 * torch.rand(b, generator=gen)
        elif pipe.family == "wan":  # the transformer takes no mask: rows past a prompt are zeros
            cond = {"embeds": torch.randn(b, pipe.text_length, m.config.text_dim, generator=gen)}
        elif pipe.family == "dit":
            cond = {"class_labels": torch.randint(0, 10, (b,), generator=gen)}
        else:
            mask = torch.zeros(b, tiny.T5_MAX_LENGTH)
            for i in range(b):
                mask[i, :3 + 4 * i] = 1  # prompts of different lengths
            cond = {"embeds": torch.randn(b, tiny.T5_MAX_LENGTH, m.config.caption_channels, generator=gen),
                    "mask": mask}
        parts.append((x, t, cond))
    return parts


def _diffusers(pipe, x, t, cond):
    m = pipe.transformer
    if pipe.family == "flux":  # diffusers' forward on the inputs FluxPipeline makes
        return predict_mmdit(pipe, x, t, cond)
    if pipe.family == "sd3":
        return m(hidden_states=x, timestep=t, encoder_hidden_states=cond["embeds"],
                 pooled_projections=cond["pooled"], return_dict=False)[0]
    if pipe.family == "wan":
        return m(hidden_states=x, timestep=t, encoder_hidden_states=cond["embeds"], return_dict=False)[0]
    if pipe.family == "dit":
        return m(x, timestep=t, class_labels=cond["class_labels"]).sample
    return m(x, encoder_hidden_states=cond["embeds"], encoder_attention_mask=cond["mask"], timestep=t,
             added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample


SHAPES = {"dit": [(3, (8, 8)), (2, (4, 4)), (1, (12, 12))],  # DiT's own forward unpatchifies squares only
          "pixart": [(3, (8, 8)), (2, (4, 6)), (1, (12, 8))],
          "wan": [(3, (3, 4, 6)), (2, (2, 4, 4)), (1, (5, 6, 2))],  # latent frames, h, w
          "sd3": [(3, (8, 8)), (2, (4, 6)), (1, (12, 8))],
          "flux": [(3, (8, 8)), (2, (4, 6)), (1, (12, 8))]}  # (a dual-attention block and a last one without text out)


@pytest.mark.parametrize("family", ["dit", "pixart", "wan", "sd3", "flux", "flux_schnell"])
def test_packed_forward_equals_diffusers_per_shape(dirs, family):
    pipe = load_pipeline(dirs[family])
    assert pipe.packs
    shapes = SHAPES[pipe.family]
    parts = _parts(pipe, shapes, torch.Generator().manual_seed(0))
    with torch.no_grad():
        outs = predict_packed(pipe, parts)
        for (x, t, cond), out in zip(parts, outs):
            want = _diffusers(pipe, x, t, cond)
            assert out.shape == want.shape
            # sharing the GEMMs with other shapes changes their blocking, nothing else
            assert (out - want).abs().max() <= 1e-5
            # alone, the packed forward is diffusers' arithmetic op for op
            assert torch.equal(predict_packed(pipe, [(x, t, cond)])[0], want)


def test_what_cannot_be_packed_is_named(dirs):
    from diffusers.models.attention_processor import AttnProcessor

    pipe = load_pipeline(dirs["dit"])
    assert packable(pipe.transformer) is None
    pipe.transformer.transformer_blocks[1].attn1.set_processor(AttnProcessor())
    assert packable(pipe.transformer) == "block 1 attention processor is AttnProcessor"
    assert packable(torch.nn.Linear(2, 2)) == "the transformer has no transformer_blocks"
    sd3 = load_pipeline(dirs["sd3"]).transformer
    assert packable(sd3) is None
    sd3.transformer_blocks[0].attn2.set_processor(AttnProcessor())
    assert packable(sd3) == "block 0 attention processor is AttnProcessor"
    flux = load_pipeline(dirs["flux"]).transformer
    assert packable(flux) is None
    flux.single_transformer_blocks[1].attn.processor._attention_backend = "flash"
    assert packable(flux) == "single block 1 attention runs on a set backend or parallel config"


def _mixed() -> list[ImageRequest]:
    return [ImageRequest(class_label=3, height=16, width=16, num_inference_steps=5, guidance_scale=4.0, seed=0),
            ImageRequest(class_label=5, height=32, width=32, num_inference_steps=3, guidance_scale=1.0, seed=1),
            ImageRequest(class_label=1, height=8, width=8, num_inference_steps=4, guidance_scale=2.0, seed=2),
            ImageRequest(class_label=0, height=32, width=32, num_inference_steps=5, guidance_scale=3.0, seed=3)]


def test_engine_runs_every_shape_of_a_step_in_one_forward(dirs):
    reqs = _mixed()
    engine = DiffusionEngine(dirs["dit"])
    outs = engine.generate_outputs(reqs)
    # three latent shapes at mixed timesteps and guidance: one forward a step, 5 steps
    assert engine.num_forwards == 5 and engine.num_steps_taken == 17
    for r, o in zip(reqs, outs):
        alone = DiffusionEngine(dirs["dit"]).generate_outputs([r])[0]  # one shape: diffusers' arithmetic
        assert o.error is None and o.image.size == (r.width, r.height)
        assert abs(o.array - alone.array).max() <= 1e-4


def test_an_unpackable_pipeline_runs_one_forward_per_shape(dirs, monkeypatch):
    import batchgen.diffusion.models.packed as packed

    reqs = _mixed()
    want = DiffusionEngine(dirs["dit"]).generate_outputs(reqs)
    monkeypatch.setattr(packed, "packable", lambda transformer: "not this one")
    engine = DiffusionEngine(dirs["dit"])
    assert not engine.pipe.packs and not engine.cost.packed
    outs = engine.generate_outputs(reqs)
    # 16 px: 5 steps, 32 px: 5 (two requests, 3 and 5 steps), 8 px: 4
    assert engine.num_forwards == 14
    for got, ref in zip(outs, want):
        assert got.error is None and abs(got.array - ref.array).max() <= 1e-4
