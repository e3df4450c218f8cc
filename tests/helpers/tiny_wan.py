"""A tiny random Wan 2.1 text-to-video pipeline (WanPipeline) written with save_pretrained, and
diffusers' own pipeline over the same modules as the reference. No downloads.

Built by the diffusers / transformers config classes at the sizes of diffusers' own Wan tests
(transformer: 2 heads of 12, 2 layers; VAE: base_dim 3, temporal downsampling x4), with a UMT5
encoder (d_model 32, 2 layers, a bias table per layer) and the session's T5 tokenizer. diffusers
loads a WanTransformer3DModel folder only with `accelerate` installed (its fp32-kept modules), so
the reference pipeline holds the modules that were saved rather than reading them back.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from tiny_diffusion import randomize
from tiny_mmdit import t5_tokenizer

TEXT_LENGTH = 16  # max_sequence_length the tests pass (WanPipeline's default is 512)
_BUILT: dict[str, Any] = {}  # folder -> the WanPipeline saved there


def flow_scheduler(**kw: Any) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**kw)


def build_wan(path: str | os.PathLike, *, seed: int = 0, scheduler: Any = None,
              boundary_ratio: float | None = None) -> Path:
    """WanPipeline at `path`; scheduler: FlowMatchEulerDiscreteScheduler(shift=7.0) by default
    (diffusers' Wan tests). boundary_ratio: a second, differently drawn transformer as Wan 2.2
    A14B's low-noise expert (transformer_2), taking the steps below that share of the timesteps."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path)
    tok = t5_tokenizer(path / "tokenizer")
    enc = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                      feed_forward_proj="gated-gelu", relative_attention_num_buckets=8))
    randomize(enc, seed + 2, scale=1.0)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=32)
    randomize(transformer, seed)
    second = None
    if boundary_ratio is not None:
        second = WanTransformer3DModel.from_config(transformer.config)
        randomize(second, seed + 10)
        second = second.eval()
    pipe = WanPipeline(tokenizer=tok, text_encoder=enc.eval(), vae=vae.eval(), transformer=transformer.eval(),
                       scheduler=scheduler if scheduler is not None else flow_scheduler(shift=7.0),
                       transformer_2=second, boundary_ratio=boundary_ratio)
    pipe.save_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    _BUILT[str(path)] = pipe
    return path


def with_unipc(src: Path, dst: Path) -> Path:
    """A copy of the pipeline at `src` with Wan 2.1's own scheduler: UniPC multistep (order 2)
    over flow sigmas, flow_shift 3.0, as the Wan-AI snapshots configure it."""
    import json
    import shutil

    from diffusers import UniPCMultistepScheduler, WanPipeline

    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "scheduler")
    sched.save_pretrained(dst / "scheduler")
    index = json.loads((dst / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "UniPCMultistepScheduler"]
    (dst / "model_index.json").write_text(json.dumps(index))
    ref = _BUILT[str(src)]
    pipe = WanPipeline(tokenizer=ref.tokenizer, text_encoder=ref.text_encoder, vae=ref.vae, transformer=ref.transformer,
                       scheduler=sched)
    pipe.set_progress_bar_config(disable=True)
    _BUILT[str(dst)] = pipe
    return dst


def reference(path: Path, prompt: str, height: int, width: int, num_frames: int, steps: int, guidance: float | None,
              seed: int, negative_prompt: str | None = None) -> torch.Tensor:
    """diffusers' WanPipeline alone on one request: video [F, H, W, 3] floats in [0, 1]."""
    pipe = _BUILT[str(path)]
    kw: dict[str, Any] = {} if guidance is None else {"guidance_scale": guidance}
    out = pipe(prompt, negative_prompt=negative_prompt, height=height, width=width, num_frames=num_frames,
               num_inference_steps=steps, max_sequence_length=TEXT_LENGTH, generator=torch.Generator().manual_seed(seed),
               output_type="np", **kw)
    return torch.from_numpy(out.frames[0])


def pipeline(path: Path) -> Any:
    """The WanPipeline that build_wan saved at `path`."""
    return _BUILT[str(path)]
