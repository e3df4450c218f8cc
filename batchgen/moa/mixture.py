"""MoA: Mixture-of-Agents over a ModelPool (togethercomputer/MoA's pattern, MOSAIC's scheduling).

    job = MoA(proposers={"a": dir_a, "b": dir_b, "c": dir_c}, aggregator="a", extract="choice",
              skip_threshold=1.0, sampling={"a": {"max_tokens": 512}}, client=client)
    out = job.generate(frame)          # pandas (or a Dask DataFrame, computed first)
    job.stats                          # expert_stage_s, aggregator_stage_s, total_s, rows_skipped, ...

Each row goes to its experts (`route`: a column of names, a function of the row, or all
proposers; the first `k`). With `layers` > 1 the proposers answer again, seeing the previous
layer's answers. The last layer's answers are extracted and voted on (agreement.py); a row at
or above `skip_threshold` takes the majority and skips the aggregator, the others go to the
aggregator with the answers injected (a system message for chat models, as togethercomputer/MoA
does, else `template`). A row moves to its next stage as soon as its own stage is done, so the
aggregator stage overlaps the experts'. The experts are placed by `place` (`placement=`).
"""
from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BatchgenError
from ..io.cells import is_na
from ..policy.placement import POLICIES, ModelCost, Placement, Policy
from ..sampling_params import SamplingParams
from .agreement import Extract, make_extract, vote
from .pool import Item, ModelPool

if TYPE_CHECKING:
    import pandas as pd
    from distributed import Client

    from ..outputs import RequestOutput

# togethercomputer/MoA's aggregate-and-synthesize system prompt
SYSTEM_TEMPLATE = (
    "You have been provided with a set of responses from various open-source models to the latest user query. "
    "Your task is to synthesize these responses into a single, high-quality response. It is crucial to critically "
    "evaluate the information provided in these responses, recognizing that some of it may be biased or incorrect. "
    "Your response should not simply replicate the given answers but should offer a refined, accurate, and "
    "comprehensive reply to the instruction. Ensure your response is well-structured, coherent, and adheres to the "
    "highest standards of accuracy and reliability.\n\nResponses from models:{references}")
TEXT_TEMPLATE = "Responses from models:{references}\n\n{prompt}"
Route = str | Callable[[Mapping[str, Any]], Sequence[str]] | None


@dataclass(slots=True)
class MoAStats:
    expert_stage_s: float = 0.0  # start -> the last proposer output
    aggregator_stage_s: float = 0.0  # the first aggregator submission -> its last output
    total_s: float = 0.0
    rows: int = 0
    rows_skipped: int = 0
    rows_aggregated: int = 0
    placement: str = ""  # Placement.describe() of the experts (and the aggregator's, after ';')
    predicted_expert_stage_s: float = 0.0
    placements: list[Placement] = field(default_factory=list)
    # worker -> model -> seconds from the placement to that model's last task there (the aggregator's included)
    finished_s: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.keys()}

    # read as a mapping too: job.stats["rows_skipped"], dict(job.stats), "total_s" in job.stats;
    # keys() leaves out `placements` (Placement objects: `placement` describes them)
    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if f.name != "placements")

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return any(f.name == key for f in fields(self))


@dataclass(slots=True)
class _Row:
    experts: list[str]
    answers: dict[str, RequestOutput] = field(default_factory=dict)  # of the current layer
    previous: dict[str, RequestOutput] = field(default_factory=dict)
    layer: int = 1
    waiting: int = 0


class MoA:
    def __init__(self, proposers: Mapping[str, str | Path], aggregator: str, *, route: Route = None,
                 k: int = 3, layers: int = 1, skip_threshold: float = 1.0, extract: str | Extract | None = None,
                 sampling: Mapping[str, SamplingParams | Mapping[str, Any]] | None = None,
                 default_sampling: SamplingParams | Mapping[str, Any] | None = None,
                 models: Mapping[str, str | Path] | None = None, prompt_column: str = "prompt",
                 chat: bool | None = None, template: str | None = None, client: Client | None = None,
                 placement: Policy = "ilp", engine_options: Mapping[str, Any] | None = None,
                 costs: Mapping[str, ModelCost] | None = None, rows_per_task: int | None = None,
                 time_limit_s: float = 5.0) -> None:
        """proposers: name -> model directory; aggregator: a proposer's name or one of `models`
        (extra name -> directory). k: experts per row (the first k its route names). sampling:
        per model, over `default_sampling` (both SamplingParams or dicts of its fields).
        chat: render prompts with the models' chat templates (None: each model that has one; True:
        every model, each must have one; False: plain text). template: the aggregator's text
        around the answers ({references}, {prompt})."""
        if not isinstance(proposers, Mapping) or not proposers:
            raise BatchgenError("MoA needs proposers: a non-empty mapping of name -> model directory")
        proposers = {str(n): d for n, d in proposers.items()}  # names are matched as text (routes, columns)
        models = {str(n): d for n, d in (models or {}).items()}
        clash = {n for n in proposers if n in models and Path(models[n]) != Path(proposers[n])}
        if clash:
            raise BatchgenError(f"names {sorted(clash)} are both proposers and models, with different directories")
        if "final" in proposers:  # its columns would be final_text and final_answer, the job's own
            raise BatchgenError("a proposer may not be named 'final' (final_text/final_answer are the output's)")
        self.dirs = {**models, **proposers}
        aggregator = str(aggregator)
        if aggregator not in self.dirs:
            raise BatchgenError(f"aggregator {aggregator!r} is neither a proposer nor in models: {sorted(self.dirs)}")
        for name, value in (("k", k), ("layers", layers)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise BatchgenError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, numbers.Real) or \
                not (0.0 <= skip_threshold <= 1.0 or skip_threshold == float("inf")):
            raise BatchgenError(f"skip_threshold must be a number in [0, 1] (or inf: never skip), got {skip_threshold!r}")
        if not (route is None or isinstance(route, str) or callable(route)):
            raise BatchgenError(f"route must be a column name, a function of the row or None, got {type(route).__name__}")
        if placement not in POLICIES:
            raise BatchgenError(f"placement {placement!r} unknown; use one of {', '.join(POLICIES)}")
        self.proposers, self.aggregator = list(proposers), aggregator
        self.route, self.k, self.layers, self.skip_threshold = route, int(k), int(layers), float(skip_threshold)
        try:
            self.extract = make_extract(extract)
        except (TypeError, ValueError) as exc:
            raise BatchgenError(str(exc)) from None
        base = _params(default_sampling or {}, "default_sampling")
        self.sampling = {name: base for name in self.dirs}
        for name, value in (sampling or {}).items():
            name = str(name)
            if name not in self.dirs:
                raise BatchgenError(f"sampling names {name!r}, which is not a model of this job: {sorted(self.dirs)}")
            self.sampling[name] = _params(value, f"sampling[{name!r}]", base)
        if template is not None:
            try:
                template.format(references="", prompt="")
            except (KeyError, IndexError, ValueError) as exc:
                raise BatchgenError(f"template: {exc!r}; it may name only {{references}} and {{prompt}} "
                                    "(double other braces: {{ }})") from None
        self.prompt_column, self.template = prompt_column, template
        self.pool = ModelPool(self.dirs, client=client, placement=placement, engine_options=engine_options,
                              costs=costs, rows_per_task=rows_per_task, time_limit_s=time_limit_s)
        # chat: per model, by its own chat template (None), or every model (True: each must have one)
        self.chat = {name: self._has_chat(name) if chat is None else bool(chat) for name in self.dirs}
        if chat:
            plain = sorted(n for n in self.dirs if not self._has_chat(n))
            if plain:
                raise BatchgenError(f"chat=True, but models {plain} have no chat template (chat=None: each model "
                                    "by its own template)")
        self.stats = MoAStats()

    # -- prompts ----------------------------------------------------------------------------------
    def _tokenizer(self, name: str) -> Any:
        return self.pool.infos[name].tokenizer

    def _has_chat(self, name: str) -> bool:
        tok = self._tokenizer(name)
        return tok is not None and bool(getattr(tok, "chat_template", None))

    def _prompt(self, name: str, prompt: str, references: Sequence[str]) -> Any:
        """The text (or, for chat, token ids) model `name` gets for a row; references: earlier answers."""
        refs = "".join(f"\n{i}. {r}" for i, r in enumerate(references, start=1))
        if self.chat[name]:
            tok = self._tokenizer(name)
            messages = [{"role": "user", "content": prompt}]
            if references:
                messages.insert(0, {"role": "system", "content": (self.template or SYSTEM_TEMPLATE).format(
                    references=refs, prompt=prompt)})
            return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        if not references:
            return prompt
        return (self.template or TEXT_TEMPLATE).format(references=refs, prompt=prompt)

    def _experts(self, row: Mapping[str, Any]) -> list[str]:
        if self.route is None:
            value: Any = list(self.proposers)
        elif callable(self.route):
            value = self.route(row)
        else:
            value = row[self.route]
        if isinstance(value, str):
            value = [value]
        elif value is None or (not hasattr(value, "__len__") and is_na(value)):
            raise BatchgenError("route gave no experts (None/NA)")
        elif not hasattr(value, "__iter__"):
            raise BatchgenError(f"route must give a proposer name or a list of them, got {value!r}")
        names = [str(n) for n in value]
        unknown = [n for n in names if n not in self.proposers]
        if unknown:
            raise BatchgenError(f"route names {unknown}, not proposers of this job: {self.proposers}")
        if not names:
            raise BatchgenError("route gave no experts")
        return list(dict.fromkeys(names))[: self.k]

    # -- the job ----------------------------------------------------------------------------------
    def generate(self, frame: pd.DataFrame | Any) -> pd.DataFrame:
        """Run every row; -> the frame plus `<proposer>_text`, `<proposer>_answer`, `confidence`,
        `aggregated`, `final_text`, `final_answer`, `error` (a row-level message or NA)."""
        import pandas as pd

        if hasattr(frame, "compute") and not isinstance(frame, pd.DataFrame):
            frame = frame.compute()
        if self.prompt_column not in frame.columns:
            raise KeyError(f"prompt_column {self.prompt_column!r} is not a column; columns: {list(frame.columns)}")
        if isinstance(self.route, str) and self.route not in frame.columns:
            raise KeyError(f"route {self.route!r} is not a column; columns: {list(frame.columns)}")
        self.stats = stats = MoAStats(rows=len(frame))
        start = time.perf_counter()
        records = frame.to_dict("records")
        prompts = [r[self.prompt_column] for r in records]
        out = _Columns(len(records), self.proposers)
        rows: dict[int, _Row] = {}
        first: list[Item] = []
        for i, rec in enumerate(records):
            if not isinstance(prompts[i], str) or not prompts[i]:
                out.error[i] = f"row {frame.index[i]!r}: {self.prompt_column}={prompts[i]!r}: must be a non-empty string"
                continue
            try:
                rows[i] = _Row(self._experts(rec))
            except Exception as exc:  # noqa: BLE001 - a bad route value or a failing route function: this row's
                out.error[i] = f"row {frame.index[i]!r}: route: {exc}"
                continue
            try:
                first += self._layer_items(i, rows[i], prompts[i])
            except Exception as exc:  # noqa: BLE001 - its prompt cannot be rendered (chat template): this row's
                del rows[i]
                out.error[i] = f"row {frame.index[i]!r}: prompt: {exc}"
        expert_plan = self.pool.plan(first) if first else None
        stats.placements = [expert_plan] if expert_plan else []
        stats.placement = expert_plan.describe() if expert_plan else ""
        stats.predicted_expert_stage_s = expert_plan.makespan_s if expert_plan else 0.0
        agg_plan: Placement | None = None
        agg_first = agg_last = expert_last = None
        try:
            if first:
                self.pool.submit(first, expert_plan)
            for finished in self.pool.results_by_task():
                now = time.perf_counter()
                next_layer: list[Item] = []
                to_aggregate: list[Item] = []
                for key, output in finished:
                    i, stage = key  # type: ignore[misc]
                    if stage == "agg":
                        agg_last = now
                        out.final(i, output, self.extract)
                        continue
                    expert_last = now
                    row = rows[i]
                    row.answers[stage[1]] = output
                    row.waiting -= 1
                    if row.waiting:
                        continue
                    try:
                        if row.layer < self.layers:
                            row.previous, row.answers, row.layer = row.answers, {}, row.layer + 1
                            next_layer += self._layer_items(i, row, prompts[i])
                            continue
                        if not self._decide(i, row, out):
                            refs = [row.answers[n].text for n in row.experts if row.answers[n].error is None]
                            to_aggregate.append(Item((i, "agg"), self.aggregator,
                                                     self._prompt(self.aggregator, prompts[i], refs),
                                                     self.sampling[self.aggregator]))
                    except Exception as exc:  # noqa: BLE001 - a prompt that cannot be rendered: this row's
                        out.add_error(i, f"row {frame.index[i]!r}: prompt: {exc}")
                # the rows this task completed go on together (one task per model and worker, not per row)
                if next_layer:
                    self.pool.submit(next_layer, expert_plan)
                if to_aggregate:
                    if agg_plan is None:
                        agg_plan = self._aggregator_plan(expert_plan, len(records), prompts)
                        if agg_plan is not expert_plan:
                            stats.placements.append(agg_plan)
                            stats.placement += "; aggregator " + agg_plan.describe()
                        agg_first = now
                    self.pool.submit(to_aggregate, agg_plan)
        finally:
            stats.finished_s = {w: dict(m) for w, m in self.pool.finished_s.items()}
            self.pool.close()
        end = time.perf_counter()
        stats.total_s = end - start
        stats.expert_stage_s = (expert_last - start) if expert_last else 0.0
        stats.aggregator_stage_s = (agg_last - agg_first) if agg_first and agg_last else 0.0
        stats.rows_aggregated = int(sum(out.aggregated))
        stats.rows_skipped = sum(out.skipped)
        return out.frame(frame)

    def _layer_items(self, i: int, row: _Row, prompt: str) -> list[Item]:
        refs = [row.previous[n].text for n in row.experts if n in row.previous and row.previous[n].error is None]
        row.waiting = len(row.experts)
        return [Item((i, (row.layer, name)), name, self._prompt(name, prompt, refs), self.sampling[name])
                for name in row.experts]

    def _decide(self, i: int, row: _Row, out: _Columns) -> bool:
        """Record the row's answers and vote; True when it is final (skips the aggregator)."""
        answers: list[str | None] = []
        for name in row.experts:
            o = row.answers[name]
            if o.error is not None:
                out.add_error(i, f"{name}: {o.error}")
                answers.append(None)
                continue
            answer, problem = _extract(self.extract, o.text)
            if problem:
                out.add_error(i, f"{name}: {problem}")
            out.text[name][i], out.answer[name][i] = o.text, answer
            answers.append(answer)
        v = vote(answers, len(row.experts))
        out.confidence[i] = v.confidence
        if v.majority is not None and v.confidence >= self.skip_threshold:
            winner = next(n for n, a in zip(row.experts, answers) if a is not None and _same(a, v.majority))
            out.final_text[i], out.final_answer[i] = row.answers[winner].text, v.majority
            out.skipped[i] = True
            return True
        return False

    def _aggregator_plan(self, expert_plan: Placement | None, n_rows: int, prompts: list[str]) -> Placement:
        """The aggregator's replicas: where the expert placement put it, else placed alone over
        every row (the upper bound of its demand)."""
        if expert_plan is not None and self.aggregator in expert_plan.replicas:
            return expert_plan
        items = [Item((i, "agg"), self.aggregator, prompts[i], self.sampling[self.aggregator]) for i in range(n_rows)]
        plan = self.pool.plan(items, fresh=False)
        # rows go to the least loaded replica as they come (not the rows planned here)
        return replace(plan, rows={w: {} for w in plan.rows})


def _extract(extract: Extract, text: str) -> tuple[str | None, str | None]:
    """-> (answer, problem): a user's extract function that raises fails that answer alone;
    a non-string answer is taken as its str()."""
    try:
        answer = extract(text)
    except Exception as exc:  # noqa: BLE001
        return None, f"extract: {type(exc).__name__}: {exc}"
    return (None if answer is None else answer if isinstance(answer, str) else str(answer)), None


def _same(a: str, b: str) -> bool:
    from .agreement import normalize

    return normalize(a) == normalize(b)


def _params(value: SamplingParams | Mapping[str, Any], what: str, base: SamplingParams | None = None) -> SamplingParams:
    if isinstance(value, SamplingParams):
        params = value
    elif isinstance(value, Mapping):
        try:
            params = SamplingParams.from_mapping(value)  # unknown keys and aliases as a request body's
            if base is not None:  # the fields this dict sets, over the job-wide default
                given = {"max_tokens" if k == "max_completion_tokens" else "logprobs" if k == "top_logprobs" else k
                         for k, v in value.items() if v is not None}
                params = replace(base, **{k: getattr(params, k) for k in given})
        except TypeError as exc:
            raise BatchgenError(f"{what}: {exc}") from None
    else:
        raise BatchgenError(f"{what} must be SamplingParams or a dict of its fields, got {type(value).__name__}")
    problem = params.validate()
    if problem:
        raise BatchgenError(f"{what}: {problem}")
    return params


class _Columns:
    """The output columns being filled, one slot per row."""

    def __init__(self, n: int, proposers: Sequence[str]) -> None:
        self.text: dict[str, list[str | None]] = {p: [None] * n for p in proposers}
        self.answer: dict[str, list[str | None]] = {p: [None] * n for p in proposers}
        self.confidence: list[float | None] = [None] * n
        self.aggregated: list[bool] = [False] * n
        self.skipped: list[bool] = [False] * n  # took the majority (at or above skip_threshold)
        self.final_text: list[str | None] = [None] * n
        self.final_answer: list[str | None] = [None] * n
        self.error: list[str | None] = [None] * n

    def add_error(self, i: int, message: str) -> None:
        self.error[i] = message if self.error[i] is None else f"{self.error[i]}; {message}"

    def final(self, i: int, output: RequestOutput, extract: Extract) -> None:
        self.aggregated[i] = True
        if output.error is not None:
            self.add_error(i, f"aggregator: {output.error}")
            return
        answer, problem = _extract(extract, output.text)
        if problem:
            self.add_error(i, f"aggregator: {problem}")
        self.final_text[i], self.final_answer[i] = output.text, answer

    def frame(self, frame: pd.DataFrame) -> pd.DataFrame:
        import pandas as pd

        from ..cluster.frame import text_dtype

        dtype = text_dtype()
        cols: dict[str, pd.Series] = {}
        for p in self.text:
            cols[f"{p}_text"] = pd.Series(self.text[p], index=frame.index, dtype=dtype)
            cols[f"{p}_answer"] = pd.Series(self.answer[p], index=frame.index, dtype=dtype)
        cols["confidence"] = pd.Series(self.confidence, index=frame.index, dtype="Float64")
        cols["aggregated"] = pd.Series(self.aggregated, index=frame.index, dtype=bool)
        cols["final_text"] = pd.Series(self.final_text, index=frame.index, dtype=dtype)
        cols["final_answer"] = pd.Series(self.final_answer, index=frame.index, dtype=dtype)
        cols["error"] = pd.Series(self.error, index=frame.index, dtype=dtype)
        return frame.assign(**cols)
