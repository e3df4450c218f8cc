"""A loaded model as a list of stages the runtime can call one at a time.

Per layer l there are two stages on a flat batch of tokens:
  attention_stage(l): h += attn(norm(h))   needs the KV cache and the batch's block tables
  ffn_stage(l):       h += ffn(norm(h))    per-token; for MoE layers this is the yield point
                                           where the runtime combines micro-batches
so any set of tokens parked before ffn_stage(l) may be concatenated and run together.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from batchgen_kernels.expert_tiles import tile_experts, tiles_supported
from batchgen_kernels.tiled_linear import TiledWeight, linear, tile_weight, weight_tiles_supported

from ..errors import ModelLoadError
from ..offload import ExpertStore, HostExperts, StoreOptions, build_store, expert_tier_plan
from . import hub
from .attention import AttentionBatch, OutputRows, gqa_attention
from .dtype import resolve_dtype
from .layers import mlp, rms_norm
from .loader import load_spec, load_weights, to_device
from .mla import mla_attention
from .moe import moe, route
from .rope import RotaryEmbedding
from .spec import GQASpec, ModelSpec, MoESpec
from .weights import GQAWeights, MLAWeights, MLPWeights, ModelWeights, MoEWeights


class Model:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                 config: dict, experts: ExpertStore | None = None) -> None:
        self.spec, self.weights, self.device, self.dtype, self.config = spec, weights, device, dtype, config
        self.experts = experts  # routed experts tiered over device / host / disk; None: all resident
        self.rotary = RotaryEmbedding(spec.rope, spec.max_position_embeddings, device)
        # set by attention_on_host(): per layer (input norm, attention weights) and the rotary
        # tables in host memory, for a KV pool that lives there
        self._host_attention: list[tuple[torch.Tensor, GQAWeights | MLAWeights]] | None = None
        self._host_rotary: RotaryEmbedding | None = None

    def attention_on_host(self) -> torch.device:
        """Run attention in host memory from now on (where a host-resident KV pool is); -> the
        host device. On a CPU device the weights are shared, elsewhere copied once."""
        host = torch.device("cpu")
        layers = []
        for w in self.weights.layers:
            attn = w.attention if self.device.type == "cpu" else to_device(copy.copy(w.attention), host)
            layers.append((w.input_norm.to(host), attn))
        self._host_attention = layers
        self._host_rotary = RotaryEmbedding(self.spec.rope, self.spec.max_position_embeddings, host)
        return host

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str | torch.dtype = "auto",
             device: str | torch.device | None = None, expert_memory_bytes: int | None = None,
             expert_host_memory_bytes: int | None = None, expert_options: StoreOptions | None = None) -> Model:
        """expert_memory_bytes / expert_host_memory_bytes: device and host bytes for routed
        experts; what does not fit stays in the tier below (host memory, then the checkpoint on
        disk) and streams through the store (batchgen/offload)."""
        path = hub.model_dir(model_dir)  # a hub id becomes its cached snapshot
        cfg, spec = load_spec(path)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = resolve_dtype(dtype, cfg, dev)
        moe_specs = {i: ls.ffn for i, ls in enumerate(spec.layers) if isinstance(ls.ffn, MoESpec)}
        num_experts = {i: f.router.num_experts for i, f in moe_specs.items()}
        widths = {f.intermediate_size for f in moe_specs.values()}
        plan = None
        if moe_specs and (expert_memory_bytes is not None or expert_host_memory_bytes is not None):
            if len(widths) != 1:
                raise ModelLoadError(f"expert offload needs one expert shape across MoE layers, found {sorted(widths)}")
            n, h = widths.pop(), spec.hidden_size
            shapes = (2 * n, h), (h, n)
            plan = expert_tier_plan(num_experts, *shapes, torch_dtype, dev, expert_memory_bytes,
                                    expert_host_memory_bytes)
        host = torch.device("cpu")
        try:
            weights = load_weights(path, spec, torch_dtype, host if plan is not None else dev,
                                   routed_experts=plan is None or not plan.from_disk)
        except RuntimeError as exc:  # shape mismatches surface as torch errors
            raise ModelLoadError(f"weights in {str(path)!r} do not match config.json: {exc}") from exc
        experts = None
        if plan is not None:
            host_experts = None
            if not plan.from_disk:
                host_experts = {}
                pin = dev.type == "cuda"
                for i in moe_specs:  # one layer at a time: the host never holds two copies of more
                    f = weights.layers[i].ffn
                    assert isinstance(f, MoEWeights) and f.w13 is not None and f.w2 is not None
                    w13, w2 = f.w13, f.w2
                    f.w13 = f.w2 = None  # the store's host copy is the only one from here on
                    host_experts[i] = HostExperts(w13.pin_memory() if pin else w13, w2.pin_memory() if pin else w2)
            if dev.type != "cpu":
                weights = to_device(weights, dev)
            prefixes = {i: f"model.layers.{i}.{spec.ffn_prefix}" for i in moe_specs}
            experts = build_store(plan, path, num_experts, prefixes, spec.expert_names, *shapes, torch_dtype, dev,
                                  host_experts, expert_options or StoreOptions(),
                                  lambda layer, x: cls._route_ids(weights, moe_specs, layer, x))
        elif dev.type == "cpu":
            cls._tile_experts(weights, moe_specs)
        if dev.type == "cpu":
            cls._tile_dense(weights)
        return cls(spec, weights, dev, torch_dtype, cfg, experts)

    @staticmethod
    def _tile_experts(weights: ModelWeights, moe_specs: dict[int, MoESpec]) -> None:
        """Resident fp32 experts on the CPU are kept in tiles for the CPU kernel (batchgen_kernels.
        expert_tiles), one layer at a time: the tiles replace the plain copy, so memory grows by
        one layer's experts at most, briefly."""
        for i in moe_specs:
            f = weights.layers[i].ffn
            assert isinstance(f, MoEWeights)
            if f.w13 is not None and f.w2 is not None and tiles_supported(f.w13, f.w2):
                f.tiles = tile_experts(f.w13, f.w2)
                f.w13 = f.w2 = None

    @staticmethod
    def _tile_dense(weights: ModelWeights) -> None:
        """Dense fp32 weights on the CPU of tiled_linear.TILE_BYTES or more (GQA's qkv and o, dense
        and shared-expert MLPs, an untied lm_head) are kept in tiles for the CPU kernel
        (batchgen_kernels.tiled_linear), one matrix at a time; the tiles replace the plain copy.
        MLA's projections and a tied lm_head (it is the embedding table) stay plain."""
        def tiled(w: torch.Tensor | TiledWeight) -> torch.Tensor | TiledWeight:
            return tile_weight(w) if isinstance(w, torch.Tensor) and weight_tiles_supported(w) else w

        for layer in weights.layers:
            a, f = layer.attention, layer.ffn
            if isinstance(a, GQAWeights):
                a.qkv, a.o = tiled(a.qkv), tiled(a.o)
            mlp_weights = f if isinstance(f, MLPWeights) else f.shared  # a dense FFN, or an MoE's shared expert
            if mlp_weights is not None:
                mlp_weights.gate_up, mlp_weights.down = tiled(mlp_weights.gate_up), tiled(mlp_weights.down)
        if weights.lm_head is not weights.embed:
            weights.lm_head = tiled(weights.lm_head)

    @staticmethod
    def _route_ids(weights: ModelWeights, moe_specs: dict[int, MoESpec], layer: int, x: torch.Tensor) -> list[int]:
        """Experts `layer`'s router picks for hidden states x [T, H] (the store's early-router
        prefetch predictor: run on the stage before, it guesses what `layer` will need)."""
        f = weights.layers[layer].ffn
        assert isinstance(f, MoEWeights)
        _, ids = route(x, f.router, moe_specs[layer].router, f.correction_bias)
        return torch.unique(ids).tolist()

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def is_moe_layer(self, layer: int) -> bool:
        return self.spec.layers[layer].is_moe

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] -> hidden [T, H]."""
        return F.embedding(token_ids, self.weights.embed)

    def attention_stage(self, layer: int, hidden: torch.Tensor, batch: AttentionBatch,
                        cache: torch.Tensor, rows: OutputRows | None = None) -> torch.Tensor:
        """hidden: [T, H] -> [T, H], or [R, H] of the R `rows` alone (every row's KV is still
        written); cache: this layer's [slots, W]. With attention on the host, the rows go to host
        memory, attend the KV there and come back."""
        a = self.spec.layers[layer].attention
        fn = gqa_attention if isinstance(a, GQASpec) else mla_attention
        if self._host_attention is not None:
            assert self._host_rotary is not None
            norm, weights = self._host_attention[layer]
            h = hidden.to(cache.device)
            x = rms_norm(h, norm, self.spec.rms_norm_eps)
            out = (h if rows is None else h[rows.index]) + fn(x, weights, a, self._host_rotary, batch,  # type: ignore[arg-type]
                                                               cache, self.spec.rms_norm_eps, rows)
            return out.to(hidden.device)
        w = self.weights.layers[layer]
        x = rms_norm(hidden, w.input_norm, self.spec.rms_norm_eps)
        return (hidden if rows is None else hidden[rows.index]) + fn(x, w.attention, a, self.rotary, batch, cache,  # type: ignore[arg-type]
                                                                self.spec.rms_norm_eps, rows)

    def ffn_stage(self, layer: int, hidden: torch.Tensor, on_route: Callable[[torch.Tensor], None] | None = None,
                  next_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [T, H] -> [T, H]; rows are independent, so any tokens may be combined here.
        next_rows: the rows the next MoE stage will run (None: all), from which an expert store
        guesses the experts to fetch for it."""
        w, spec = self.weights.layers[layer], self.spec.layers[layer].ffn
        x = rms_norm(hidden, w.post_norm, self.spec.rms_norm_eps)
        if isinstance(spec, MoESpec):
            cache = self.experts
            ahead = x if next_rows is None else x[next_rows]
            fetch = (lambda ids: cache.fetch_parts(layer, ahead, ids)) if cache is not None else None
            return hidden + moe(x, w.ffn, spec, on_route, fetch)  # type: ignore[arg-type]
        assert isinstance(w.ffn, MLPWeights)
        return hidden + mlp(x, w.ffn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> fp32 logits [N, V]."""
        x = rms_norm(hidden, self.weights.norm, self.spec.rms_norm_eps)
        return linear(x, self.weights.lm_head).float()

    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.spec.kv_width * self.dtype.itemsize
