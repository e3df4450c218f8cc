"""Tiny random diffusers pipelines (DiT, PixArt-alpha with a tiny T5) written with save_pretrained.

Built by diffusers / transformers config classes themselves, so the directory layout, weight names
and configs are what a real snapshot has; weights are re-drawn with a wide spread so that every
parameter changes the image. No downloads.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DIT_LABELS = {i: f"class{i}" for i in range(10)}
T5_MAX_LENGTH = 32  # PixArt pads prompts to max_sequence_length; tests pass it explicitly


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    # diffusers zero-initialises adaLN-Zero modulations and output projections: a DiT straight
    # from its constructor predicts 0 everywhere, which would hide most mistakes.
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if p.ndim == 1 and "norm" in name and "weight" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(scale * torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.25)


def _vae(seed: int) -> Any:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=16)
    randomize(vae, seed, scale=0.5)
    return vae.eval()


def scheduler(name: str = "ddim", **kw: Any) -> Any:
    import diffusers

    cls = {"ddim": "DDIMScheduler", "dpm": "DPMSolverMultistepScheduler", "euler": "EulerDiscreteScheduler",
           "ddpm": "DDPMScheduler"}.get(name, name)
    return getattr(diffusers, cls)(num_train_timesteps=1000, **kw)


def build_dit(path: str | os.PathLike, *, sched: str = "ddim", sample_size: int = 8, layers: int = 2,
              heads: int = 2, head_dim: int = 8, seed: int = 0, **sched_kw: Any) -> Path:
    """A class-conditional DiTPipeline: latents [4, sample_size, sample_size], patch 2, VAE x2."""
    from diffusers import DiTPipeline, DiTTransformer2DModel

    transformer = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4,
                                        out_channels=8, num_layers=layers, sample_size=sample_size, patch_size=2,
                                        num_embeds_ada_norm=1000, norm_type="ada_norm_zero")
    randomize(transformer, seed)
    pipe = DiTPipeline(transformer=transformer.eval(), vae=_vae(seed + 1), scheduler=scheduler(sched, **sched_kw),
                       id2label=DIT_LABELS)
    pipe.save_pretrained(path)
    # Real DiT snapshots list their labels in model_index.json; save_pretrained leaves them out.
    index_file = Path(path) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["id2label"] = {str(k): v for k, v in DIT_LABELS.items()}
    index_file.write_text(json.dumps(index, indent=2))
    return Path(path)


def build_t5_tokenizer(path: str | os.PathLike) -> Any:
    """A unigram T5-style tokenizer (<pad>=0, </s>=1, <unk>=2, '</s>' appended) trained on
    Python's own documentation strings."""
    from demo_builder import corpus
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import T5Tokenizer

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(list(corpus()), trainers.UnigramTrainer(vocab_size=200, unk_token="<unk>",
                                                                    special_tokens=["<pad>", "</s>", "<unk>"]))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    hf = T5Tokenizer(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0)
    hf.save_pretrained(path)
    return hf


def build_pixart(path: str | os.PathLike, *, sched: str = "dpm", sample_size: int = 8, layers: int = 2,
                 heads: int = 2, head_dim: int = 8, seed: int = 0, **sched_kw: Any) -> Path:
    """A PixArtAlphaPipeline: tiny T5 encoder (d_model 32), PixArtTransformer2DModel, VAE x2."""
    from diffusers import PixArtAlphaPipeline, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    path = Path(path)
    tokenizer = build_t5_tokenizer(path / "tokenizer")
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=8))
    randomize(t5, seed + 2, scale=1.0)
    transformer = PixArtTransformer2DModel(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4,
                                           out_channels=8, num_layers=layers, sample_size=sample_size, patch_size=2,
                                           cross_attention_dim=heads * head_dim, caption_channels=32,
                                           norm_type="ada_norm_single", num_embeds_ada_norm=1000)
    randomize(transformer, seed)
    pipe = PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=t5.eval(), transformer=transformer.eval(),
                               vae=_vae(seed + 1), scheduler=scheduler(sched, **sched_kw))
    pipe.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=8)
def _pipeline(cls: str, path: str) -> Any:
    import diffusers

    pipe = getattr(diffusers, cls).from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def with_scheduler(src: Path, dst: Path, sched: str, **kw: Any) -> Path:
    """A copy of the pipeline at `src` with another scheduler (same weights)."""
    import shutil

    shutil.copytree(src, dst)
    scheduler(sched, **kw).save_pretrained(dst / "scheduler")
    index = json.loads((dst / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", type(scheduler(sched)).__name__]
    (dst / "model_index.json").write_text(json.dumps(index, indent=2))
    _pipeline.cache_clear()
    return dst


def reference_dit(path: str | os.PathLike, class_label: int, steps: int, guidance: float, seed: int) -> torch.Tensor:
    """diffusers' DiTPipeline alone on one request: image [H, W, 3] floats in [0, 1]."""
    pipe = _pipeline("DiTPipeline", str(path))
    out = pipe([class_label], guidance_scale=guidance, num_inference_steps=steps,
               generator=torch.Generator().manual_seed(seed), output_type="np")
    return torch.from_numpy(out.images[0])


def reference_pixart(path: str | os.PathLike, prompt: str, height: int, width: int, steps: int, guidance: float,
                     seed: int) -> torch.Tensor:
    pipe = _pipeline("PixArtAlphaPipeline", str(path))
    out = pipe(prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
               generator=torch.Generator().manual_seed(seed), output_type="np", use_resolution_binning=False,
               clean_caption=False, max_sequence_length=T5_MAX_LENGTH)
    return torch.from_numpy(out.images[0])


def run_resumed(engine: Any, data: bytes) -> list[Any]:
    """Resume the suspended trajectory `data` on `engine`, run everything there -> each request's
    array ([H, W, 3], a video's [F, H, W, 3]) by engine id."""
    engine.resume(data)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return [o.array for o in sorted(outs, key=lambda o: o.index)]


def suspended_in_company(make_engine: Callable[[], Any], req: Any, company: Any) -> tuple[Any, bytes]:
    """`req` takes a step alone, then one beside `company` (another shape: packed, one forward),
    which then leaves -> (req's array on an engine where it kept going, req suspended at step 2 on
    another engine after the same two steps)."""
    def two_steps(engine: Any) -> int:
        tid = engine.add_request(req)
        engine.step()
        # joins at step 1 (admitted alone: prompts encoded in one batch differ in the last bits)
        other = engine.add_request(company)
        engine.step()
        engine.suspend(other)
        return tid

    kept = make_engine()
    two_steps(kept)
    outs = []
    while kept.has_unfinished():
        outs += kept.step()
    first = make_engine()
    return outs[0].array, first.suspend(two_steps(first))
