"""Load a diffusers-format pipeline directory (model_index.json + one folder per component).

What is ours and what is diffusers' (the `batchgen[diffusion]` extra), part by part:
- transformer, VAE: diffusers' modules hold the weights and compute the blocks; the forward
  around them (token sharding, per-sample timesteps, CFG halves) is ours (forward.py), because
  sequence parallelism needs the token axis between patch embedding and unpatchify.
- schedulers: diffusers' (dozens of numerically fussy variants; exact agreement matters more
  than owning them); their state is read out and put back by schedulers.py.
- text encoders and tokenizers: ours (t5.py, clip.py: plain torch over the safetensors, `tokenizers`
  over tokenizer.json or vocab.json + merges.txt); transformers is the test oracle, not a runtime
  dependency. SD3's and Flux's three / two encoders are put together by mmdit_text.py; Wan's UMT5
  is t5.py with a bias table per layer.
- Wan 2.1 (text-to-video): latents [C, F', h, w] of F = 4(F' - 1) + 1 frames; wan.py has its
  forward, prompt cleaning and VAE decode.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError, UnsupportedModelError
from .diffusers_modules import load_module
from .schedulers import FLOW, Timing, calculate_shift, check_scheduler, make_scheduler

# pipeline class -> (family, components it must have)
PIPELINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "DiTPipeline": ("dit", ("transformer", "vae", "scheduler")),
    "PixArtAlphaPipeline": ("pixart", ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")),
    "PixArtSigmaPipeline": ("pixart", ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")),
    # text_encoder_3 / tokenizer_3 (T5) are optional for SD3: without them diffusers feeds zeros
    "StableDiffusion3Pipeline": ("sd3", ("transformer", "vae", "scheduler", "text_encoder", "tokenizer",
                                         "text_encoder_2", "tokenizer_2")),
    "FluxPipeline": ("flux", ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2",
                              "tokenizer_2")),
    # Wan 2.1 text-to-video; Wan 2.2 A14B adds transformer_2 (the low-noise expert) and boundary_ratio
    "WanPipeline": ("wan", ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")),
}
TRANSFORMERS = {"dit": "DiTTransformer2DModel", "pixart": "PixArtTransformer2DModel",
                "sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel", "wan": "WanTransformer3DModel"}
VAES = {"wan": "AutoencoderKLWan"}  # the others: AutoencoderKL
MMDIT = ("sd3", "flux")  # joint text-image attention, flow matching, pooled text conditioning
FLOW_FAMILIES = ("sd3", "flux", "wan")  # flow matching: no input scaling, velocity out
VIDEO = ("wan",)  # latents [C, F', h, w]: requests may give num_frames
# The pipelines' own defaults (diffusers' __call__): T5 tokens a prompt is padded to.
MAX_SEQUENCE_LENGTH = {"PixArtAlphaPipeline": 120, "PixArtSigmaPipeline": 300, "StableDiffusion3Pipeline": 256,
                       "FluxPipeline": 512, "WanPipeline": 512}
# guidance_scale when a request gives none: diffusers' SD3 (7.0), Flux-dev (3.5) and Wan (5.0) defaults;
# DiT and PixArt keep batchgen's earlier 4.0 (diffusers: DiT 4.0, PixArt 4.5) so their images stay the same
DEFAULT_GUIDANCE = {"dit": 4.0, "pixart": 4.0, "sd3": 7.0, "flux": 3.5, "wan": 5.0}
# WanPipeline's defaults for a request that gives no size or frame count: 480 x 832 px, 81 frames
WAN_SIZE, WAN_FRAMES = (480, 832), 81


@dataclass
class Pipeline:
    """The loaded components plus what the runtime needs to know about their shapes."""

    path: Path
    pipeline_class: str
    family: str                      # "dit" | "pixart" | "sd3" | "flux" | "wan"
    transformer: Any
    vae: Any
    scheduler_class: str
    scheduler_config: dict[str, Any]
    scheduler_options: dict[str, Any] = field(default_factory=dict)  # its config with the class defaults filled in
    text_encoder: Any = None
    tokenizer: Any = None
    id2label: dict[int, str] = field(default_factory=dict)
    max_sequence_length: int = 0     # text pipelines: prompts are padded to this many tokens
    packs: bool = False              # degree-1 forwards run token-packed (packed.py): set at load
    transformer_2: Any = None        # Wan 2.2's low-noise expert: it runs the steps below the boundary
    boundary_ratio: float | None = None  # ... timestep boundary_ratio x num_train_timesteps (WanPipeline's)

    @property
    def latent_channels(self) -> int:
        # Flux's transformer takes 2x2 patches of the latents packed into its channels
        return int(self.transformer.config.in_channels) // (4 if self.family == "flux" else 1)

    @property
    def patch_size(self) -> int:
        """Latent pixels per image token side (Flux: the pipeline's 2x2 packing; its config says 1;
        Wan: its (frames, height, width) patch's height)."""
        if self.family == "wan":
            return int(self.transformer.config.patch_size[1])
        return 2 if self.family == "flux" else int(self.transformer.config.patch_size)

    @property
    def vae_scale_factor(self) -> int:
        if self.family == "wan":
            return int(self.vae.config.scale_factor_spatial)
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def is_video(self) -> bool:
        return self.family in VIDEO

    @property
    def temporal_factor(self) -> int:
        """Video frames per latent frame after the first (Wan's VAE: 4)."""
        return int(self.vae.config.scale_factor_temporal) if self.is_video else 1

    def latent_frames(self, num_frames: int | None) -> int:
        """Latent frames of a video of `num_frames` frames (1 for an image)."""
        return 1 if num_frames is None else (num_frames - 1) // self.temporal_factor + 1

    @property
    def native_size(self) -> int:
        """An image request's default side (square); a video model's is native_hw."""
        # FluxPipeline's default_sample_size is 128 latent pixels; its transformer config has none
        sample = 128 if self.family == "flux" else int(self.transformer.config.sample_size)
        return sample * self.vae_scale_factor

    @property
    def native_hw(self) -> tuple[int, int]:
        """(height, width) of a request that gives neither."""
        return WAN_SIZE if self.family == "wan" else (self.native_size, self.native_size)

    @property
    def default_frames(self) -> int | None:
        """num_frames of a video request that gives none; None for an image model."""
        return WAN_FRAMES if self.is_video else None

    @property
    def pixel_multiple(self) -> int:
        return self.patch_size * self.vae_scale_factor

    def tokens(self, height: int, width: int, num_frames: int | None = None) -> int:
        """Transformer tokens of one request's latents (every latent frame's patches)."""
        m = self.pixel_multiple
        return (height // m) * (width // m) * self.latent_frames(num_frames)

    @property
    def native_tokens(self) -> int:
        return self.tokens(*self.native_hw, self.default_frames)

    @property
    def learned_sigma(self) -> bool:
        if self.family in FLOW_FAMILIES:
            return False
        return int(self.transformer.config.out_channels) // 2 == self.latent_channels

    @property
    def guidance_embeds(self) -> bool:
        """Flux-dev: guidance is an input of the transformer (distilled), not a second row."""
        return self.family == "flux" and bool(self.transformer.config.guidance_embeds)

    @property
    def has_guidance(self) -> bool:
        """Whether guidance_scale means anything here (Flux-schnell has none)."""
        return self.family != "flux" or self.guidance_embeds

    def guidance(self, guidance_scale: float | None) -> float:
        """A request's guidance_scale, or this family's default when it gives none."""
        return DEFAULT_GUIDANCE[self.family] if guidance_scale is None else float(guidance_scale)

    def cfg_scale(self, guidance_scale: float | None) -> float:
        """The classifier-free guidance scale (> 1: an unconditional row joins each forward);
        1.0 for Flux, whose guidance is embedded or absent."""
        return 1.0 if self.family == "flux" else self.guidance(guidance_scale)

    @property
    def micro_conditions(self) -> bool:
        # PixArt-alpha 1024px checkpoints condition on resolution and aspect ratio (diffusers'
        # test: sample_size == 128); sigma never does.
        return self.pipeline_class == "PixArtAlphaPipeline" and int(self.transformer.config.sample_size) == 128

    @property
    def text_length(self) -> int:
        """Tokens in a prompt's embeddings (SD3: CLIP's and T5's)."""
        return self.text_encoder.text_length if self.family in MMDIT else self.max_sequence_length

    def timing(self, height: int, width: int, steps: int) -> Timing:
        """set_timesteps' extra arguments for one request, as the SD3 / Flux pipeline passes them."""
        if self.family not in MMDIT:
            return Timing()
        cfg = self.scheduler_options
        m = self.pixel_multiple
        tokens = (height // m) * (width // m)
        # SD3 computes mu only with dynamic shifting, Flux always (ignored without); their
        # defaults for a key missing from the scheduler's config differ (max_shift 1.16 / 1.15)
        mu = None
        if self.family == "flux" or cfg.get("use_dynamic_shifting"):
            mu = calculate_shift(tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                                 cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16 if self.family == "sd3" else 1.15))
        sigmas = None
        if self.family == "flux" and not cfg.get("use_flow_sigmas"):
            import numpy as np

            sigmas = tuple(np.linspace(1.0, 1 / steps, steps).tolist())
        return Timing(mu, sigmas)

    @property
    def null_class(self) -> int:
        return int(self.transformer.config.num_embeds_ada_norm)  # DiT's unconditional label


def read_index(path: str | os.PathLike) -> tuple[Path, dict[str, Any], str]:
    """model_index.json -> (dir, index, pipeline class); raises ModelLoadError / UnsupportedModelError."""
    root = Path(path)
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise ModelLoadError(f"{root}: no model_index.json (not a diffusers pipeline directory)")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{index_file}: unreadable ({exc})") from exc
    if not isinstance(index, dict):
        raise ModelLoadError(f"{index_file}: not a JSON object")
    cls = index.get("_class_name")
    if cls not in PIPELINES:
        raise UnsupportedModelError(f"{root}: pipeline class {cls!r} is not supported "
                                    f"(supported: {', '.join(sorted(PIPELINES))})")
    family, needed = PIPELINES[cls]
    for name in needed:
        entry = index.get(name)
        if entry is not None and not (isinstance(entry, list) and len(entry) == 2):
            raise ModelLoadError(f"{root}: model_index.json entry {name!r} must be [library, class], got {entry!r}")
        if not entry or entry[1] is None or not (root / name).is_dir():
            raise ModelLoadError(f"{root}: {cls} needs a {name!r} component (model_index.json entry and {name}/ folder)")
    for name in ("text_encoder_3", "tokenizer_3") if family == "sd3" else ():
        entry = index.get(name)
        if entry and entry[1] is not None and not (root / name).is_dir():
            raise ModelLoadError(f"{root}: model_index.json names {name!r} but there is no {name}/ folder")
    if index["transformer"][1] != TRANSFORMERS[family]:
        raise UnsupportedModelError(f"{root}: transformer class {index['transformer'][1]!r} is not supported "
                                    f"for {cls} (expected {TRANSFORMERS[family]})")
    vae = VAES.get(family, "AutoencoderKL")
    if index["vae"][1] != vae:
        raise UnsupportedModelError(f"{root}: VAE class {index['vae'][1]!r} is not supported (expected {vae})")
    extra = index.get("transformer_2")
    if family == "wan" and extra and extra[1] is not None:
        if extra[1] != TRANSFORMERS[family] or not (root / "transformer_2").is_dir():
            raise ModelLoadError(f"{root}: model_index.json entry 'transformer_2' must be a WanTransformer3DModel "
                                 f"with a transformer_2/ folder, got {extra!r}")
        ratio = index.get("boundary_ratio")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1):
            raise ModelLoadError(f"{root}: model_index.json boundary_ratio must be a number in (0, 1), got {ratio!r}")
    if family == "wan" and index.get("expand_timesteps"):
        raise UnsupportedModelError(f"{root}: a WanPipeline with expand_timesteps (Wan 2.2 TI2V: a timestep per "
                                    "token) is not supported")
    return root, index, cls


def load_pipeline(path: str | os.PathLike, dtype: str = "float32", device: str = "cpu",
                  max_sequence_length: int | None = None) -> Pipeline:
    """Load every component; an unsupported pipeline class, transformer or scheduler fails here."""
    root, index, cls = read_index(path)
    family = PIPELINES[cls][0]
    torch_dtype = _torch_dtype(dtype)
    sched_file = root / "scheduler" / "scheduler_config.json"
    try:
        sched_config = json.loads(sched_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{sched_file}: unreadable ({exc})") from exc
    sched_class = index["scheduler"][1]
    check_scheduler(sched_class, sched_config, where=str(root), family=family)
    try:  # a bad config value fails here, not at the first request
        built = make_scheduler(sched_class, sched_config, 1, timing=Timing(mu=1.0) if sched_class == FLOW else Timing())
    except Exception as exc:  # noqa: BLE001 - diffusers raises ValueError, NotImplementedError, ...
        raise ModelLoadError(f"{sched_file}: cannot build {sched_class} ({type(exc).__name__}: {exc})") from exc

    import diffusers

    from .packed import packable

    missing = [name for name in (TRANSFORMERS[family], VAES.get(family, "AutoencoderKL")) if not hasattr(diffusers, name)]
    if missing:  # Wan's classes came with diffusers 0.33, SD3's and Flux's with 0.29-0.30
        raise UnsupportedModelError(f"{root}: {cls} needs diffusers' {', '.join(missing)}, which diffusers "
                                    f"{diffusers.__version__} lacks; upgrade diffusers")
    transformer = load_module(getattr(diffusers, TRANSFORMERS[family]), root / "transformer", torch_dtype)
    vae = load_module(getattr(diffusers, VAES.get(family, "AutoencoderKL")), root / "vae", torch_dtype)
    pipe = Pipeline(path=root, pipeline_class=cls, family=family, transformer=transformer.to(device).eval(),
                    vae=vae.to(device).eval(), scheduler_class=sched_class, scheduler_config=sched_config,
                    scheduler_options=dict(built.config),
                    packs=packable(transformer) is None)
    extra = index.get("transformer_2")
    if family == "wan" and extra and extra[1] is not None and index.get("boundary_ratio") is not None:
        # (without a boundary WanPipeline runs `transformer` alone: transformer_2 is not loaded)
        second = load_module(getattr(diffusers, TRANSFORMERS[family]), root / "transformer_2", torch_dtype)
        pipe.transformer_2, pipe.boundary_ratio = second.to(device).eval(), float(index["boundary_ratio"])
        pipe.packs = pipe.packs and packable(second) is None
    pipe.max_sequence_length = int(max_sequence_length or MAX_SEQUENCE_LENGTH.get(cls, 0))
    if family == "dit":
        pipe.id2label = {int(k): v for k, v in (index.get("id2label") or {}).items()}
    elif family in MMDIT:
        from .mmdit_text import MMDiTText

        joint = int(transformer.config.joint_attention_dim)
        pipe.text_encoder = _loading_text(root, lambda: MMDiTText.load(family, root, index, torch_dtype, device,
                                                                       pipe.max_sequence_length, joint))
    else:
        _load_text(pipe, root, index, torch_dtype, device)
    return pipe


def _torch_dtype(dtype: Any) -> Any:
    """"auto" / None -> float32 (the exact one; diffusers configs name no dtype); a name or torch dtype."""
    import torch

    if dtype is None or dtype == "auto":
        return torch.float32
    value = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported (auto, float32, bfloat16, float16)")
    return value


def _load_text(pipe: Pipeline, root: Path, index: dict[str, Any], torch_dtype: Any, device: str) -> None:
    from .t5 import T5Encoder, T5Tokens

    enc_class = index["text_encoder"][1]
    # Wan's is a UMT5 (t5.py reads which from its config.json); diffusers' own Wan tests save a T5
    allowed = ("UMT5EncoderModel", "T5EncoderModel") if pipe.family == "wan" else ("T5EncoderModel",)
    if enc_class not in allowed:
        raise UnsupportedModelError(f"{root}: text encoder class {enc_class!r} is not supported "
                                    f"(expected {' or '.join(allowed)})")
    pipe.text_encoder = _loading_text(root, lambda: T5Encoder(root / "text_encoder", torch_dtype, device))
    pipe.tokenizer = _loading_text(root, lambda: T5Tokens(root / "tokenizer"))


def _loading_text(root: Path, load: Any) -> Any:
    """load(); any failure but ours -> ModelLoadError naming the pipeline."""
    try:
        return load()
    except (ModelLoadError, UnsupportedModelError):
        raise
    except Exception as exc:  # noqa: BLE001 - OSError, JSON, SafetensorError, tokenizers' Exception, ...
        raise ModelLoadError(f"{root}: cannot load text encoder/tokenizer ({type(exc).__name__}: {exc})") from exc
