"""GPU parity (run by gpu_check.sh on a CUDA machine): batchgen on CUDA against transformers on
the tiny test checkpoints of every supported family.

fp32: greedy tokens must be identical to transformers' (fp32, on CPU, each prompt alone).
bf16: batchgen (dtype="auto" on a bf16 checkpoint) against transformers in bf16 on the same GPU;
bf16 greedy paths may part after a near-tie, so reported: first-token agreement, the fraction of
tokens agreeing before the first difference, and the max |logit| difference of the prompt's
next-token distribution. Prints one JSON line per family, then a summary line; exits 1 when an
fp32 family differs.

    python benchmarks/gpu_parity.py [--archs mixtral,deepseek_v3] [--tokens 16]
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import tiny_models  # noqa: E402

from batchgen import Engine, SamplingParams  # noqa: E402

DEVICE = "cuda"


def bf16_checkpoint(src: Path, dst: Path) -> Path:
    """The same weights saved in bf16 by transformers (config.json then says bfloat16)."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@functools.lru_cache(maxsize=2)
def hf_bf16(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()


def hf_bf16_greedy(model_dir: Path, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers bf16 on CUDA: (greedy tokens, the prompt's next-token logits fp32)."""
    model = hf_bf16(model_dir)
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad():
        first = model(ids).logits[0, -1].float()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist(), first


def agree_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=",".join(sorted(tiny_models.ARCHS)))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cpu: check this script itself without a GPU (bf16 forced)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    bf16 = {} if DEVICE == "cuda" else {"dtype": "bfloat16"}  # auto is float32 on CPU
    fp32_ok, rows = True, []
    with tempfile.TemporaryDirectory() as tmp:
        tok = tiny_models.build_tokenizer(Path(tmp) / "tok")
        prompts = tiny_models.mixed_prompts(tok)
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        for arch in args.archs.split(","):
            src = tiny_models.build_checkpoint(arch, Path(tmp) / arch)
            engine = Engine(src, dtype="float32", device=DEVICE, block_size=16, kv_cache_bytes=64 << 20)
            outs = engine.generate(prompts, params)
            same = sum(o.token_ids == tiny_models.reference_generate(src, p, args.tokens, ignore_eos=True)
                       for p, o in zip(prompts, outs))
            fp32_ok &= same == len(prompts)
            graph_steps = engine.stats.graph_steps
            del engine
            bf = bf16_checkpoint(src, Path(tmp) / f"{arch}-bf16")
            engine = Engine(bf, device=DEVICE, block_size=16, kv_cache_bytes=64 << 20, **bf16)  # auto -> bf16
            assert engine.model.dtype in (torch.bfloat16, torch.float16), engine.model.dtype
            outs = engine.generate(prompts, params)
            first_ok, prefix, dmax = 0, 0, 0.0
            for p, o in zip(prompts, outs):
                ref, ref_logits = hf_bf16_greedy(bf, p, args.tokens)
                first_ok += o.token_ids[0] == ref[0]
                prefix += agree_prefix(o.token_ids, ref)
            lp = Engine(bf, device=DEVICE, block_size=16, kv_cache_bytes=64 << 20, **bf16).generate(
                prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
            for p, o in zip(prompts, lp):
                _, ref_logits = hf_bf16_greedy(bf, p, 1)
                ref_lp = ref_logits.log_softmax(-1)
                for tid, value in (o.logprobs or [{}])[0].items():
                    dmax = max(dmax, abs(float(value) - float(ref_lp[tid])))
            row = {"arch": arch, "fp32_identical_rows": f"{same}/{len(prompts)}", "fp32_graph_steps": graph_steps,
                   "bf16_dtype": str(engine.model.dtype), "bf16_first_token_agree": f"{first_ok}/{len(prompts)}",
                   "bf16_tokens_agreeing_before_first_difference": round(prefix / (len(prompts) * args.tokens), 3),
                   "bf16_top5_logprob_max_abs_diff": round(dmax, 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"PARITY fp32 {'identical' if fp32_ok else 'DIFFERS'} on {len(rows)} families; bf16 first-token "
          f"agreement {sum(int(r['bf16_first_token_agree'].split('/')[0]) for r in rows)}/"
          f"{sum(int(r['bf16_first_token_agree'].split('/')[1]) for r in rows)}")
    return 0 if fp32_ok else 1


if __name__ == "__main__":
    sys.exit(main())
