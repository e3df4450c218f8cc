"""Workloads: each row's prompt length, true output length and max_tokens, as numpy arrays.

The policies see only what the runtime sees (prompt, max_tokens and, where a workload has one,
each row's group: the source or template a real file names in a column); the true output
length decides when the simulated row stops, as EOS would. The single-source workloads draw
prompt and output lengths independently with one max_tokens, so nothing known at admission
predicts a row's length there; a mixture's rows carry their source as their group. Synthetic shapes follow what production
traces show: reasoning outputs are heavy-tailed (log-t: most rows a few thousand tokens, a few
at the tens-of-thousands cap), summarization reads long and writes little, classification is
short both ways.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from ..errors import PlanError

Order = Literal["random", "sorted", "grouped"]
PROMPT_COLUMNS = ("prompt_tokens", "prompt_len", "input_tokens")
OUTPUT_COLUMNS = ("output_tokens", "output_len", "completion_tokens")


@dataclass(frozen=True, slots=True)
class LengthModel:
    """exp(log(median) + sigma * X), X standard normal (df None) or Student-t with df degrees,
    clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int
    df: float | None = None

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.standard_t(self.df, n) if self.df else rng.standard_normal(n)
        return np.clip(np.exp(np.log(self.median) + self.sigma * x), self.low, self.high).astype(np.int64)


@dataclass(frozen=True, slots=True)
class WorkloadKind:
    prompt: LengthModel
    output: LengthModel
    max_tokens: int  # what the job asks for: the policies' upper bound on every row


WORKLOADS: dict[str, WorkloadKind] = {
    "reasoning": WorkloadKind(LengthModel(400, 0.8, 16, 8192), LengthModel(1500, 0.85, 16, 32768, df=4), 32768),
    "summarization": WorkloadKind(LengthModel(3000, 0.6, 256, 32768), LengthModel(200, 0.5, 16, 1024), 1024),
    "classification": WorkloadKind(LengthModel(200, 0.5, 8, 2048), LengthModel(3, 0.5, 1, 8), 16),
    "chat": WorkloadKind(LengthModel(300, 0.9, 8, 8192), LengthModel(350, 0.8, 8, 4096), 4096),
}
# A batch file assembled from sources (README, "Workload statement"): (workload, share of rows), in
# file order. The shares are an assumption of this model, not measured; every row asks the
# largest source's max_tokens, so the policies still cannot tell the sources apart.
MIXTURES: dict[str, tuple[tuple[str, float], ...]] = {
    "mixed": (("reasoning", 0.3), ("chat", 0.5), ("classification", 0.2)),
}
# Adversarial for length prediction: two groups whose first finishers mislead. Group 0 is mostly
# classification rows (they finish first and teach "group 0 is short") with 15% reasoning rows
# at the 32,768-token cap among them; group 1 is chat rows. A predictor trusting group 0's early
# mean starts its longest rows last.
MISLEAD = "mislead"
WORKLOAD_NAMES = (*WORKLOADS, *MIXTURES, MISLEAD)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompt_len: np.ndarray  # [rows] int64
    output_len: np.ndarray  # [rows] int64, >= 1
    max_tokens: np.ndarray  # [rows] int64, >= output_len
    group: np.ndarray | None = None  # [rows] int64: each row's source/template; None: rows name none

    def __post_init__(self) -> None:
        n = len(self.prompt_len)
        if n == 0:
            raise PlanError(f"workload {self.name!r} has no rows")
        if len(self.output_len) != n or len(self.max_tokens) != n or (self.group is not None and len(self.group) != n):
            raise PlanError(f"workload {self.name!r}: column lengths differ")

    @property
    def rows(self) -> int:
        return len(self.prompt_len)

    @property
    def output_tokens(self) -> int:
        return int(self.output_len.sum())

    def head(self, n: int) -> Workload:
        return self.take(slice(None, n))

    def take(self, rows: slice | np.ndarray) -> Workload:
        """The rows a slice, index array or boolean mask picks, in that order."""
        return Workload(self.name, self.prompt_len[rows], self.output_len[rows], self.max_tokens[rows],
                        None if self.group is None else self.group[rows])


def synthetic(kind: str, rows: int, seed: int = 0, order: Order = "random") -> Workload:
    """`rows` rows of a named workload (WORKLOADS or MIXTURES). `order`: random (a mixture's
    sources shuffled together), sorted (longest outputs last), grouped (a mixture's sources one
    after another, as concatenating them leaves a file; one source: as random)."""
    if kind not in WORKLOAD_NAMES:
        raise PlanError(f"--workload {kind!r}: unknown; choose from {', '.join(WORKLOAD_NAMES)}")
    if rows < 1:
        raise PlanError(f"--rows must be >= 1, got {rows}")
    if order not in ("random", "sorted", "grouped"):
        raise PlanError(f"--order {order!r}: unknown; choose from random, sorted, grouped")
    rng = np.random.default_rng(seed)
    if kind in MIXTURES:
        return _mixture(kind, rows, rng, order)
    if kind == MISLEAD:
        return _mislead(rows, rng, order)
    w = WORKLOADS[kind]
    prompt, output = w.prompt.draw(rng, rows), w.output.draw(rng, rows)
    if order == "sorted":
        idx = np.argsort(output, kind="stable")
        prompt, output = prompt[idx], output[idx]
    return Workload(kind, prompt, output, np.full(rows, max(w.max_tokens, int(output.max())), dtype=np.int64))


def _mixture(kind: str, rows: int, rng: np.random.Generator, order: Order) -> Workload:
    sources = MIXTURES[kind]
    total = sum(share for _, share in sources)
    counts = [int(rows * share / total) for _, share in sources]
    counts[0] += rows - sum(counts)
    prompt = np.concatenate([WORKLOADS[name].prompt.draw(rng, n) for (name, _), n in zip(sources, counts)])
    output = np.concatenate([WORKLOADS[name].output.draw(rng, n) for (name, _), n in zip(sources, counts)])
    if order == "random":
        idx = rng.permutation(rows)
    elif order == "sorted":
        idx = np.argsort(output, kind="stable")
    else:
        idx = np.arange(rows)
    cap = max(max(WORKLOADS[name].max_tokens for name, _ in sources), int(output.max()))
    group = np.repeat(np.arange(len(sources), dtype=np.int64), counts)
    return Workload(kind, prompt[idx], output[idx], np.full(rows, cap, dtype=np.int64), group[idx])


def _mislead(rows: int, rng: np.random.Generator, order: Order) -> Workload:
    """MISLEAD's rows: half group 0 (85% classification, 15% at the reasoning cap), half chat."""
    cls, chat, cap = WORKLOADS["classification"], WORKLOADS["chat"], WORKLOADS["reasoning"].max_tokens
    half = rows // 2
    prompt = np.concatenate([cls.prompt.draw(rng, half), chat.prompt.draw(rng, rows - half)])
    output = np.concatenate([cls.output.draw(rng, half), chat.output.draw(rng, rows - half)])
    output[:half][rng.random(half) < 0.15] = cap
    group = np.repeat(np.array([0, 1], dtype=np.int64), [half, rows - half])
    idx = rng.permutation(rows) if order == "random" else \
        np.argsort(output, kind="stable") if order == "sorted" else np.arange(rows)
    return Workload(MISLEAD, prompt[idx], output[idx], np.full(rows, cap, dtype=np.int64), group[idx])


def _pick(columns: list[str], names: tuple[str, ...], path: Path) -> str:
    found = [c for c in names if c in columns]
    if not found:
        raise PlanError(f"--lengths {path}: needs a column named one of {', '.join(names)}; "
                        f"it has {', '.join(map(str, columns)) or 'none'}")
    return found[0]


def _checked(values: object, column: str, path: Path, low: int) -> np.ndarray:
    import pandas as pd

    s = pd.Series(values).reset_index(drop=True)
    numeric = pd.to_numeric(s, errors="coerce")
    # True is not a token count of 1: a boolean column, or booleans among other values
    if s.dtype == bool:
        flags = pd.Series(True, index=s.index)
    elif s.dtype == object:
        flags = s.map(lambda v: isinstance(v, (bool, np.bool_))).astype(bool)
    else:
        flags = pd.Series(False, index=s.index)
    bad = s.index[numeric.isna() | (numeric < low) | (numeric != numeric.round()) | flags]
    if len(bad):
        row = int(bad[0])
        value = s.iloc[row]
        value = value.item() if hasattr(value, "item") else value  # 3.5, not np.float64(3.5)
        raise PlanError(f"--lengths {path}: row {row}, column {column}: expected an integer >= {low}, "
                        f"got {value!r}")
    return numeric.to_numpy(dtype=np.int64)


def from_table(path: Path) -> Workload:
    """Parquet, CSV or JSONL of prompt and output lengths (token counts), one row each; an
    optional max_tokens column (else each row's output length is its max_tokens) and an optional
    group column (a row's source or template)."""
    import pandas as pd

    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            df = pd.read_parquet(path)
        elif suffix == ".csv":
            df = pd.read_csv(path)
        else:  # JSON Lines; a .json file may also hold one array of row objects
            array = suffix == ".json" and path.read_text(encoding="utf-8").lstrip().startswith("[")
            df = pd.read_json(path, lines=not array)
    except (OSError, ValueError) as exc:
        raise PlanError(f"--lengths {path}: cannot read it: {exc}") from exc
    if not len(df):
        raise PlanError(f"--lengths {path}: no rows in it")
    columns = [str(c) for c in df.columns]
    prompt_col, output_col = _pick(columns, PROMPT_COLUMNS, path), _pick(columns, OUTPUT_COLUMNS, path)
    prompt = _checked(df[prompt_col], prompt_col, path, 1)
    output = _checked(df[output_col], output_col, path, 1)
    max_tokens = _checked(df["max_tokens"], "max_tokens", path, 1) if "max_tokens" in columns else output
    short = np.flatnonzero(max_tokens < output)
    if len(short):
        r = int(short[0])
        raise PlanError(f"--lengths {path}: row {r}: max_tokens {max_tokens[r]} is below output_tokens {output[r]}")
    # a group column (source, template): what length-aware admission learns per group
    group = pd.factorize(df["group"])[0].astype(np.int64) if "group" in columns else None
    return Workload(path.stem, prompt, output, np.maximum(max_tokens, output), group)


def _is_openai_batch(path: Path) -> bool:
    if path.suffix.lower() != ".jsonl":
        return False
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except ValueError:
                    return False
                return isinstance(first, dict) and "custom_id" in first and "body" in first
    return False


def from_openai_batch(path: Path, model_dir: Path, kind: str, seed: int) -> Workload:
    """An OpenAI batch input file: prompts tokenized by the model's tokenizer; each row's
    max_tokens from its body; output lengths drawn from workload `kind`, capped at max_tokens
    (a batch file says what may be generated, not what will be)."""
    from ..io.openai_batch import OpenAIBatchReader
    from ..io.rows import RowContext
    from ..models.info import ModelInfo

    info = ModelInfo.load(model_dir)  # ModelLoadError names what is missing
    if info.tokenizer is None:
        raise PlanError(f"--lengths {path}: the model {model_dir} has no tokenizer to measure prompts with")
    reader = OpenAIBatchReader(path, RowContext(info.tokenizer, info.vocab_size, info.max_model_len))
    if kind not in WORKLOAD_NAMES:
        raise PlanError(f"--workload {kind!r}: unknown; choose from {', '.join(WORKLOAD_NAMES)}")
    prompt, max_tokens, invalid = [], [], []
    for req in reader.requests():
        if req.is_valid and req.prompt_token_ids is not None and req.params is not None:
            prompt.append(len(req.prompt_token_ids))
            max_tokens.append(int(req.params.max_tokens))
        else:
            invalid.append(req)
    if invalid:  # the runtime answers these with an error line; they cost no GPU time
        first = invalid[0]
        why = first.error.message if first.error is not None else f"line {first.number}: invalid"
        print(f"batchgen plan: {len(invalid)} invalid request(s) in {path} left out ({why})",
              file=sys.stderr)
    if not prompt:
        raise PlanError(f"--lengths {path}: no valid requests in it")
    cap = np.array(max_tokens, dtype=np.int64)
    if kind in MIXTURES:  # each row's source drawn at the mixture's shares
        drawn = synthetic(kind, len(prompt), seed).output_len
    else:
        drawn = WORKLOADS[kind].output.draw(np.random.default_rng(seed), len(prompt))
    output = np.minimum(drawn, cap)
    return Workload(path.stem, np.array(prompt, dtype=np.int64), np.maximum(output, 1), np.maximum(cap, 1))


def load_lengths(path: Path, model_dir: Path | None = None, kind: str = "reasoning", seed: int = 0) -> Workload:
    if not path.is_file():
        raise PlanError(f"--lengths {path}: no such file")
    if path.suffix.lower() not in (".parquet", ".csv", ".jsonl", ".json"):
        raise PlanError(f"--lengths {path}: expected .parquet, .csv or .jsonl")
    if _is_openai_batch(path):
        if model_dir is None or not Path(model_dir).is_dir():
            raise PlanError(f"--lengths {path} is an OpenAI batch file: its prompts are tokenized, so "
                            "--model must be a model directory with a tokenizer")
        return from_openai_batch(path, Path(model_dir), kind, seed)
    return from_table(path)
