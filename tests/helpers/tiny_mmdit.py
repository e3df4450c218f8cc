"""Tiny random MMDiT pipelines (StableDiffusion3Pipeline, FluxPipeline dev and schnell) written with
save_pretrained, and diffusers' own pipelines over them as the reference. No downloads.

Built by diffusers / transformers config classes, so folders, weight names and configs are what a
real snapshot has. The CLIP tokenizer folders keep only vocab.json + merges.txt (+ configs), as
SD3 and Flux snapshots ship them; the T5 ones have tokenizer.json. Weights are re-drawn with a
wide spread (tiny_diffusion.randomize) so that every parameter changes the image.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
from tiny_diffusion import build_t5_tokenizer, randomize

T5_LENGTH = 24  # max_sequence_length the tests pass (SD3's default is 256, Flux's 512)


@functools.lru_cache(maxsize=1)
def _clip_bpe_dir() -> Path:
    """vocab.json + merges.txt of one byte-level BPE (<|startoftext|>=0, <|endoftext|>=1) trained
    once per test session on Python's own documentation strings."""
    import tempfile

    from demo_builder import corpus
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    path = Path(tempfile.mkdtemp(prefix="tiny-clip-bpe-"))
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|startoftext|>", "<|endoftext|>"],
                                  end_of_word_suffix="</w>", initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([s.lower() for s in corpus()], trainer)
    tok.model.save(str(path))
    return path


def build_clip_tokenizer(path: Path, pad: str = "<|endoftext|>") -> Any:
    """A CLIPTokenizer folder (model_max_length 16) over the session's BPE."""
    import shutil

    from transformers import CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(_clip_bpe_dir() / name, path / name)
    hf = CLIPTokenizer.from_pretrained(str(path), pad_token=pad, model_max_length=16)
    hf.save_pretrained(str(path))
    return hf


@functools.lru_cache(maxsize=1)
def _t5_tokenizer_dir() -> Path:
    """One trained T5 tokenizer per test session (training takes seconds), copied where needed."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="tiny-t5-tok-"))
    build_t5_tokenizer(path)
    return path


def t5_tokenizer(path: Path) -> Any:
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(_t5_tokenizer_dir(), path, dirs_exist_ok=True)
    return AutoTokenizer.from_pretrained(str(path))


def _drop_tokenizer_json(folder: Path) -> None:
    # real SD3 / Flux snapshots ship CLIP tokenizers as vocab.json + merges.txt only
    (folder / "tokenizer.json").unlink(missing_ok=True)


def _clip(vocab: int, hidden: int, eos: int, projection: int | None, seed: int, act: str) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                         num_attention_heads=4, max_position_embeddings=16, hidden_act=act, bos_token_id=0,
                         eos_token_id=eos, pad_token_id=1, projection_dim=projection or hidden)
    model = CLIPTextModelWithProjection(cfg) if projection else CLIPTextModel(cfg)
    randomize(model, seed, scale=1.0)
    return model.eval()


def _t5(vocab: int, d_model: int, seed: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    t5 = T5EncoderModel(T5Config(vocab_size=vocab, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                                 num_heads=4, feed_forward_proj="gated-gelu", relative_attention_num_buckets=8))
    randomize(t5, seed, scale=1.0)
    return t5.eval()


def _vae(seed: int, latent_channels: int = 4) -> Any:
    from diffusers import AutoencoderKL

    # SD3 and Flux VAEs shift as well as scale the latents
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=16, scaling_factor=1.5, shift_factor=0.1,
                        use_quant_conv=False, use_post_quant_conv=False)
    randomize(vae, seed, scale=0.5)
    return vae.eval()


def flow_scheduler(**kw: Any) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**kw)


def build_sd3(path: str | os.PathLike, *, seed: int = 0, dynamic: bool = False, t5: bool = True) -> Path:
    """StableDiffusion3Pipeline: CLIP-L (hidden 16, legacy eos_token_id 2) and CLIP-G (hidden 24,
    pad '!') with projections, T5 (d_model 48) or none, SD3Transformer2DModel (patch 2, qk rms norm
    and a dual-attention block as SD3.5), VAE x2. dynamic: the scheduler shifts by image size
    (mu), else shift 3.0 as SD3.5."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    path = Path(path)
    tok1 = build_clip_tokenizer(path / "tokenizer")
    tok2 = build_clip_tokenizer(path / "tokenizer_2", pad="!")
    tok3 = t5_tokenizer(path / "tokenizer_3") if t5 else None
    enc1 = _clip(len(tok1), 16, 2, 16, seed + 2, "quick_gelu")
    enc2 = _clip(len(tok2), 24, tok2.eos_token_id, 24, seed + 3, "gelu")
    enc3 = _t5(len(tok3), 48, seed + 4) if t5 else None
    transformer = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                        num_attention_heads=4, joint_attention_dim=48, caption_projection_dim=32,
                                        pooled_projection_dim=40, out_channels=4, pos_embed_max_size=16,
                                        qk_norm="rms_norm", dual_attention_layers=(0,))
    randomize(transformer, seed)
    sched = flow_scheduler(shift=1.0, use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256,
                           base_shift=0.5, max_shift=1.16) if dynamic else flow_scheduler(shift=3.0)
    pipe = StableDiffusion3Pipeline(transformer=transformer.eval(), scheduler=sched, vae=_vae(seed + 1),
                                    text_encoder=enc1, tokenizer=tok1, text_encoder_2=enc2, tokenizer_2=tok2,
                                    text_encoder_3=enc3, tokenizer_3=tok3)
    pipe.save_pretrained(path)
    _drop_tokenizer_json(path / "tokenizer")  # tokenizer_2 keeps its tokenizer.json: both paths are read
    return path


def build_flux(path: str | os.PathLike, *, seed: int = 0, guidance: bool = True) -> Path:
    """FluxPipeline: CLIP-L (hidden 24, pooled), T5 (d_model 32), FluxTransformer2DModel (one double
    and one single block, rope axes 4+4+8), VAE x2 with 2x2 packing. guidance: the distilled
    guidance embedding (dev) and dynamic shifting; without: schnell (no guidance, shift 1)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    path = Path(path)
    tok1 = build_clip_tokenizer(path / "tokenizer")
    tok2 = t5_tokenizer(path / "tokenizer_2")
    enc1 = _clip(len(tok1), 24, tok1.eos_token_id, None, seed + 2, "quick_gelu")
    enc2 = _t5(len(tok2), 32, seed + 3)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=24, guidance_embeds=guidance, axes_dims_rope=(4, 4, 8))
    randomize(transformer, seed)
    sched = flow_scheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=4, max_image_seq_len=64,
                           base_shift=0.5, max_shift=1.15) if guidance else flow_scheduler(shift=1.0)
    pipe = FluxPipeline(transformer=transformer.eval(), scheduler=sched, vae=_vae(seed + 1), text_encoder=enc1,
                        tokenizer=tok1, text_encoder_2=enc2, tokenizer_2=tok2)
    pipe.save_pretrained(path)
    _drop_tokenizer_json(path / "tokenizer")
    return path


@functools.lru_cache(maxsize=8)
def pipeline(cls: str, path: str) -> Any:
    import diffusers

    # an SD3 snapshot without T5 must say so to from_pretrained
    kw = {"text_encoder_3": None, "tokenizer_3": None} if cls == "StableDiffusion3Pipeline" and \
        not (Path(path) / "text_encoder_3").is_dir() else {}
    pipe = getattr(diffusers, cls).from_pretrained(path, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_class(path: Path) -> str:
    return json.loads((Path(path) / "model_index.json").read_text())["_class_name"]


def reference(path: Path, prompt: str, height: int, width: int, steps: int, guidance: float | None,
              seed: int) -> torch.Tensor:
    """diffusers' own pipeline alone on one request: image [H, W, 3] floats in [0, 1]."""
    pipe = pipeline(pipeline_class(path), str(path))
    kw: dict[str, Any] = {} if guidance is None else {"guidance_scale": guidance}
    out = pipe(prompt, height=height, width=width, num_inference_steps=steps, max_sequence_length=T5_LENGTH,
               generator=torch.Generator().manual_seed(seed), output_type="np", **kw)
    return torch.from_numpy(out.images[0])
