"""Train the demo model: a tiny Mixtral-layout MoE that normalizes messy dates to ISO 8601.

    nice -n 10 python scripts/train_demo_model.py [--out batchgen/demo/model] [--steps 3000]

A tool, not part of the package: a plain torch loop over a plain torch Mixtral
(scripts/demo_model_torch.py, same tensors and arithmetic as transformers'); the checkpoint it
writes is what any Mixtral snapshot looks like, and before it finishes the script checks that
transformers' MixtralForCausalLM, loading it, gives the same logits.
Data come from batchgen.demo.dates with seed `--seed` (the accuracy checks use other seeds).
Seeded and reproducible on one machine (thread count fixed); it writes config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json and
training.json (what was run, how long it took, the dev accuracy) into --out.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
from demo_model_torch import Mixtral, load_balancing_loss
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from batchgen.demo.dates import messy_date, messy_dates
from batchgen.demo.prompt import DEMO_PROMPT, DEMO_STOP
from batchgen.demo.tokens import BOS_ID, CHAT_TEMPLATE, EOS_ID, IM_END_ID, PAD_ID, SPECIAL_TOKENS

DEV_SEED = 1_000_003  # dev set for early stopping; the package's tests use other seeds


def build_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    """Byte-level BPE with every digit its own token (the model copies digits one by one), trained
    on prompts and answers, so the fixed prompt and month names become a few tokens.

    The normalizer lowercases and collapses runs of whitespace before tokenizing (as uncased
    tokenizers do): "MARCH", "March" and "mArCh", or a tab and two spaces, reach the model as the
    same tokens. The answer (digits and "-") is unchanged by it."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(),
                                           normalizers.Replace(Regex(r"\s+"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [DEMO_PROMPT.format(text=d.text) + d.iso + DEMO_STOP for d in messy_dates(20_000, seed + 1)]
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return tok


def encode_pair(tok: Tokenizer, text: str, iso: str) -> tuple[list[int], list[int]]:
    prompt = tok.encode(DEMO_PROMPT.format(text=text)).ids
    answer = tok.encode(iso + DEMO_STOP, add_special_tokens=False).ids
    return prompt, answer


def batch(pairs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (-100 except on the answer)."""
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), PAD_ID)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100)
    for i, (p, a) in enumerate(pairs):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(a)
    return ids, mask, labels


def loss_fn(model: Mixtral, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
            aux_coef: float) -> torch.Tensor:
    logits, routers = model(ids, mask)
    vocab = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
    return loss + aux_coef * load_balancing_loss(routers, model.cfg["num_experts_per_tok"], mask.reshape(-1).bool())


@torch.no_grad()
def exact_match(model: Mixtral, data: tuple[torch.Tensor, ...], chunk: int = 250) -> float:
    """Share of rows whose every answer token is the argmax under teacher forcing: exactly the
    rows greedy decoding gets right (stop token included)."""
    model.eval()
    ids, mask, labels = data
    right = 0
    for s in range(0, len(ids), chunk):
        logits, _ = model(ids[s:s + chunk], mask[s:s + chunk])
        pred = logits[:, :-1].argmax(-1)
        gold = labels[s:s + chunk, 1:]
        ok = (pred == gold) | (gold == -100)
        right += int(ok.all(-1).sum())
    model.train()
    return right / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "batchgen/demo/model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2000, help="at most this many steps")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--target", type=float, default=0.998, help="stop once the dev exact match reaches this")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--stop-after", type=int, help="stop after this many steps (the schedule still spans --steps)")
    ap.add_argument("--init", type=Path, help="start from this checkpoint (its tokenizer too) instead of from scratch")
    ap.add_argument("--dev", type=int, default=300, help="dev rows for the stop check")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy machine)")
    args = ap.parse_args()

    started = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(args.init / "tokenizer.json")) if args.init else build_tokenizer(args.vocab, args.seed)
    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": tok.get_vocab_size(),
        "hidden_size": args.hidden, "intermediate_size": args.inter, "num_hidden_layers": args.layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": args.hidden // 4, "hidden_act": "silu",
        "max_position_embeddings": 256, "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "sliding_window": None, "attention_dropout": 0.0,
        "num_experts_per_tok": 2, "num_local_experts": args.experts, "output_router_logits": False,
        "router_aux_loss_coef": 0.01, "router_jitter_noise": 0.0, "torch_dtype": "float32",
    }
    model = load_checkpoint(args.init) if args.init else Mixtral(config)
    config = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,} ({4 * n_params / 2**20:.1f} MiB fp32), vocab {config['vocab_size']}", flush=True)

    dev = batch([encode_pair(tok, d.text, d.iso) for d in messy_dates(args.dev, DEV_SEED)])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    rng = random.Random(args.seed)
    history: list[dict] = []
    best = -1.0
    model.train()
    hits = 0
    last = min(args.steps, args.stop_after or args.steps)
    for step in range(1, last + 1):
        ids, mask, labels = batch([encode_pair(tok, d.text, d.iso)
                                   for d in (messy_date(rng) for _ in range(args.batch))])
        loss = loss_fn(model, ids, mask, labels, config["router_aux_loss_coef"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == last:
            acc = exact_match(model, dev)
            history.append({"step": step, "loss": round(loss.item(), 4), "dev_exact_match": acc,
                            "elapsed_s": round(time.time() - started, 1)})
            print(json.dumps(history[-1]), flush=True)
            if acc > best:  # the best so far is always on disk: a stopped run still leaves a model
                best = acc
                write_checkpoint(args, model, tok, config, history, step, time.time() - started)
            hits = hits + 1 if acc >= args.target else 0
            if hits >= 2:  # twice in a row: not a lucky check
                break
    check_against_transformers(args.out, tok)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB) in {time.time() - started:.0f} s, best dev {best}", flush=True)


def write_checkpoint(args: argparse.Namespace, model: Mixtral, tok: Tokenizer, config: dict,
                     history: list[dict], step: int, elapsed: float) -> None:
    out_dir: Path = args.out
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(model.state_dict_hf(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID}
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tok.save(str(tmp / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID], "pad_token": SPECIAL_TOKENS[PAD_ID], "unk_token": None,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"], "chat_template": CHAT_TEMPLATE,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    record = {"script": "scripts/train_demo_model.py",
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
              "params": sum(p.numel() for p in model.parameters()), "steps": step,
              "train_examples": step * args.batch, "train_seconds": round(elapsed, 1),
              "torch_threads": args.threads, "history": history}
    if args.init:  # the stage this one continued from, with its own record
        record["init"] = json.loads((args.init / "training.json").read_text())
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the package may be installed for other users
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def load_checkpoint(path: Path) -> Mixtral:
    """A checkpoint this script wrote, back into the plain-torch model (experts re-stacked)."""
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    ours = Mixtral(config)
    state = load_file(str(path / "model.safetensors"))
    stacked = {}
    for name, t in state.items():
        key = name.removeprefix("model.")
        if ".experts." in key:
            base, e, w, _ = key.rsplit(".", 3)
            stacked.setdefault(f"{base}.{w}", {})[int(e)] = t
        else:
            ours.state_dict()[key].copy_(t)
    for key, parts in stacked.items():
        ours.state_dict()[key].copy_(torch.stack([parts[e] for e in sorted(parts)]))
    return ours


def check_against_transformers(out_dir: Path, tok: Tokenizer) -> None:
    """transformers' MixtralForCausalLM on the written checkpoint gives our logits (else raise)."""
    from transformers import MixtralForCausalLM

    ours = load_checkpoint(out_dir)
    ref = MixtralForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ids, mask, _ = batch([encode_pair(tok, d.text, d.iso) for d in messy_dates(16, DEV_SEED + 1)])
    with torch.no_grad():
        a = ours.eval()(ids, mask)[0]
        b = ref(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    diff = (a - b)[keep].abs().max().item()
    print(f"max |logit difference| vs transformers: {diff:.2e}", flush=True)
    if diff > 1e-3:
        raise SystemExit(f"the plain-torch model disagrees with transformers (max diff {diff})")


if __name__ == "__main__":
    main()
