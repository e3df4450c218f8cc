"""A plain-torch Mixtral for training the demo model fast on a CPU.

Same parameters (names, shapes) and the same arithmetic as transformers' MixtralForCausalLM,
so its state dict is a Mixtral checkpoint; the training script checks its logits against
transformers' on the trained weights before saving. It exists because transformers' forward
carries per-call overhead that dominates at this size on a shared 2-core CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), -1)  # [S, D] (rotate-half layout)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o_proj = nn.Linear(heads * self.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # x: [B, S, H]; mask: [B, 1, S, S] bool (True: attend)
        q = self.q_proj(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Experts(nn.Module):
    """`experts.{e}.w1/w2/w3` as one stacked parameter each; `state_dict_hf` unstacks them."""

    def __init__(self, hidden: int, inter: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, inter, hidden))  # gate  [E, N, H]
        self.w3 = nn.Parameter(torch.empty(experts, inter, hidden))  # up    [E, N, H]
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))  # down  [E, H, N]
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; top_i, top_w: [T, K] -> [T, H], each token through its K experts only."""
        out = torch.zeros_like(x)
        flat_e = top_i.reshape(-1)
        order = flat_e.argsort(stable=True)
        counts = torch.bincount(flat_e, minlength=self.w1.shape[0]).tolist()
        tokens = order // top_i.shape[1]
        weights = top_w.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = tokens[start:start + n]
                xe = x[idx]
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                out.index_add_(0, idx, (h @ self.w2[e].T) * weights[start:start + n, None])
            start += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(hidden, inter, experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.gate(flat)  # [T, E]
        probs = logits.softmax(-1, dtype=torch.float32)
        top_w, top_i = probs.topk(self.top_k, -1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        out = self.experts(flat, top_i, top_w.to(x.dtype))
        return out.view(b, s, h), logits


class Layer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.input_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.self_attn = Attention(h, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        self.block_sparse_moe = SparseMoE(h, cfg["intermediate_size"], cfg["num_local_experts"],
                                          cfg["num_experts_per_tok"])

    def forward(self, x, cos, sin, mask):  # noqa: ANN001, ANN201 - internal
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        moe, logits = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + moe, logits


class Mixtral(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["vocab_size"], bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        cos, sin = rope_tables(cfg["max_position_embeddings"], h // cfg["num_attention_heads"],
                               cfg["rope_theta"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids, attention_mask: [B, S] (right padding) -> logits [B, S, V], router logits per layer."""
        s = ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed_tokens(ids)
        routers = []
        for layer in self.layers:
            x, logits = layer(x, cos, sin, mask)
            routers.append(logits)
        return self.lm_head(self.norm(x)), routers

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Tensor names and shapes of a Mixtral snapshot (per-expert w1/w2/w3)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self.state_dict().items():
            prefix = "" if name.startswith("lm_head") else "model."
            if ".experts." in name:
                base, w = name.rsplit(".", 1)
                for e in range(t.shape[0]):
                    out[f"model.{base}.{e}.{w}.weight"] = t[e].detach().clone().contiguous()
            else:
                out[prefix + name] = t.detach().clone().contiguous()
        return out


def load_balancing_loss(routers: list[torch.Tensor], top_k: int, keep: torch.Tensor) -> torch.Tensor:
    """Switch-transformer auxiliary loss as transformers computes it for Mixtral (padding excluded).
    routers: per layer [T, E]; keep: [T] bool."""
    logits = torch.cat([r[keep] for r in routers], 0)
    probs = logits.softmax(-1, dtype=torch.float32)
    _, sel = probs.topk(top_k, -1)
    mask = F.one_hot(sel, probs.shape[-1]).float()  # [T, K, E]
    tokens_per_expert = mask.mean(0)
    prob_per_expert = probs.mean(0)
    return (tokens_per_expert * prob_per_expert[None]).sum() * probs.shape[-1]
