"""The math-verify reward (LUFFY's ``reward_impl_version=3``, arXiv 2504.14945), safe inside verl's reward threads:
``reward.custom_reward_function.path=pkg://mix_src.rewards.math_verify_reward`` (options: :class:`RewardConfig`).
Returns ``{"score", "acc", "format_ok", "ungradable"}``; grading, multiple-choice labels, ungradable rows:
mix_src/rewards/README.md. Departures from LUFFY (github.com/ElliottYan/LUFFY): the answer follows the *last*
``</think>`` (LUFFY: between the first and second); format errors can score apart from wrong answers; the last
``\\boxed{}`` outranks "the final answer is ..." (math-verify's default: the reverse); grading runs in parallel
with a real timeout instead of sequentially under math-verify's SIGALRM.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, fields
from typing import Sequence

from mix_src.rewards import answers
from mix_src.rewards.grading import grade_math
from mix_src.rewards.pool import GradingPool, Outcome, get_pool, pools

logger = logging.getLogger(__name__)

ANSWER_TYPES = ("math", "numeric", "multiple_choice")
# Words of a data source (split at non-alphanumerics, lower case) that select the kind.
_MC_WORDS = {"arc", "gpqa", "mmlu", "mcq", "multiple_choice"}
_NUMERIC_WORDS = {"gsm8k", "numeric"}
# verl's reward managers may add these call-time kwargs (naive.py: reward router); they are not options.
_VERL_CALL_KWARGS = ("reward_router_address", "reward_model_tokenizer")


@dataclass(frozen=True)
class RewardConfig:
    """Options; each can be set with ``+reward.custom_reward_function.reward_kwargs.<name>=<value>``."""

    correct_score: float = 1.0  # score of a correct answer
    wrong_score: float = 0.0  # wrong, missing or timed-out answer (LUFFY v1: -0.5)
    format_error_score: float = 0.0  # malformed response, see require_think / require_boxed (LUFFY v1: -1.0)
    starts_in_think: bool = True  # the prompt ends with "<think>": only "</think>" is required (LUFFY v3)
    require_think: bool = True  # no (well-formed) think block -> format error; False: grade the whole response
    require_boxed: bool = False  # no \boxed{} in the answer -> format error (LUFFY v1)
    answer_type: str | None = None  # force math | numeric | multiple_choice (else extra_info / data_source)
    timeout_s: float = 5.0  # hard deadline per item in a grading worker
    num_workers: int = 0  # grading processes in this process's pool; 0 = min(#usable CPUs, 8)
    memory_limit_mb: int = 4096  # address-space cap per grading worker; 0 = none

    def __post_init__(self):
        for name in _NUMBER_OPTIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"reward_kwargs.{name} must be a number, got {value!r}")
        for name in ("starts_in_think", "require_think", "require_boxed"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"reward_kwargs.{name} must be true or false, got {getattr(self, name)!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward_kwargs.timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        for name, zero in (("num_workers", "0 = auto"), ("memory_limit_mb", "0 = no limit")):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"reward_kwargs.{name} must be an integer >= 0 ({zero}), got {getattr(self, name)!r}")
        if self.answer_type is not None and self.answer_type not in ANSWER_TYPES:
            raise ValueError(f"reward_kwargs.answer_type must be one of {ANSWER_TYPES} or null, "
                             f"got {self.answer_type!r}")

    @property
    def workers(self) -> int:
        if self.num_workers:
            return self.num_workers
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # usable
        return max(1, min(cpus, 8))


_NUMBER_OPTIONS = ("correct_score", "wrong_score", "format_error_score", "timeout_s")
_OPTION_NAMES = tuple(f.name for f in fields(RewardConfig))
_CONFIGS: dict[tuple, RewardConfig] = {}


def make_config(**kwargs) -> RewardConfig:
    """Validate reward kwargs (cached: verl passes the same ones on every call); verl's call-time kwargs are dropped."""
    kwargs = {k: v for k, v in kwargs.items() if k not in _VERL_CALL_KWARGS}
    try:
        key = tuple(sorted(kwargs.items()))
        cfg = _CONFIGS.get(key)  # TypeError: an unhashable value, not cached
    except TypeError:
        key = cfg = None
    if cfg is not None:
        return cfg
    unknown = sorted(set(kwargs) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"mix_src.rewards.compute_score: unknown reward_kwargs {unknown}; "
                        f"the options are {list(_OPTION_NAMES)}")
    cfg = RewardConfig(**{k: float(v) if k in _NUMBER_OPTIONS and isinstance(v, int) and not isinstance(v, bool) else v
                          for k, v in kwargs.items()})
    if key is not None:
        _CONFIGS[key] = cfg  # no lock: a race only validates the same kwargs twice
    return cfg


# --------------------------------------------------------------------------------- ungradable rows
class Ungradable(Exception):
    """A row that cannot be graded; ``kind`` groups the log lines (e.g. "ground truth", "response")."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


_LOG_EVERY_S = 60.0  # at most one warning a minute per (data_source, kind) after the first
_ungradable_lock = threading.Lock()
_ungradable_counts: dict[str, int] = {}  # per data_source, this process
_ungradable_log: dict[tuple[str, str], list] = {}  # (data_source, kind) -> [last log time, rows since]


def ungradable_counts() -> dict[str, int]:
    """Rows that could not be graded in this process, per data_source."""
    with _ungradable_lock:
        return dict(_ungradable_counts)


def _ungradable(cfg: RewardConfig, data_source, exc: Exception, format_ok: bool = False) -> dict:
    """Count the row, log it (rate-limited per data_source and kind) and score it as wrong."""
    if isinstance(exc, Ungradable):
        kind, reason = exc.kind, str(exc)
    else:  # a bug or an input nobody foresaw: still one row, never the run
        kind, reason = "error", f"{type(exc).__name__}: {exc}"
    source, now, since = str(data_source), time.monotonic(), 0
    with _ungradable_lock:
        _ungradable_counts[source] = _ungradable_counts.get(source, 0) + 1
        state = _ungradable_log.setdefault((source, kind), [None, 0])
        state[1] += 1
        if state[0] is None or now - state[0] >= _LOG_EVERY_S:
            since, state[0], state[1] = state[1], now, 0
    if since:
        more = f" ({since - 1} more such rows since the last message)" if since > 1 else ""
        logger.warning("reward: ungradable row, scored as wrong (data_source %r, %s): %s%s", source, kind,
                       reason[:300], more)
    return _row(cfg.wrong_score, False, format_ok, ungradable=True)


# ---------------------------------------------------------------------------------------- dispatch
def answer_type_for(data_source: str | None, extra_info: dict | None, cfg: RewardConfig) -> str:
    """``extra_info["answer_type"]`` > ``cfg.answer_type`` > words of the data source > ``math``."""
    if isinstance(extra_info, dict) and extra_info.get("answer_type") is not None:
        kind = extra_info["answer_type"]
        if kind not in ANSWER_TYPES:
            raise Ungradable("answer_type", f"extra_info.answer_type must be one of {ANSWER_TYPES}, got {kind!r}")
        return kind
    if cfg.answer_type is not None:
        return cfg.answer_type
    source = str(data_source or "").lower()
    words = set(re.split(r"[^a-z0-9]+", source))
    if words & _MC_WORDS or "multiple_choice" in source:
        return "multiple_choice"
    if words & _NUMERIC_WORDS:
        return "numeric"
    return "math"


@dataclass(frozen=True)
class _Pending:
    """A math-verify job for a worker, plus what to return for each outcome."""

    answer: str
    ground_truth: str
    format_ok: bool


def _row(score: float, correct: bool = False, format_ok: bool = False, ungradable: bool = False) -> dict:
    return {"score": float(score), "acc": bool(correct), "format_ok": bool(format_ok), "ungradable": ungradable}


def _result(cfg: RewardConfig, correct: bool, format_ok: bool) -> dict:
    return _row(cfg.correct_score if correct else cfg.wrong_score, correct, format_ok)


def _prepare(data_source, solution_str, ground_truth, extra_info, cfg: RewardConfig) -> dict | _Pending:
    """Everything that does not need sympy: a final result, or a job for a worker."""
    if not isinstance(solution_str, str):
        raise Ungradable("response", f"solution_str must be a str, got {type(solution_str).__name__}")
    problem = answers.ground_truth_problem(ground_truth)  # missing, empty, NaN/inf: never graded correct, counted
    if problem is not None:
        raise Ungradable("ground truth", f"reward_model.ground_truth {problem}; fix the data file "
                         "(the data check before Ray drops such rows)")
    gt = str(answers.unwrap(ground_truth))
    answer, format_ok = answers.split_response(solution_str, cfg.starts_in_think)
    if answer is None:
        if cfg.require_think:
            return _row(cfg.format_error_score)  # a format error
        answer = solution_str  # graded anyway; format_ok still says the think block is missing
    boxed = answers.last_boxed(answer)
    if cfg.require_boxed and boxed is None:
        return _row(cfg.format_error_score)  # a format error
    kind = answer_type_for(data_source, extra_info, cfg)

    if kind == "multiple_choice":
        gold = answers.gold_choice(gt)
        if gold is None:
            raise Ungradable("ground truth", f"a multiple-choice ground truth must be an option label (a letter "
                             f"such as 'B' or a number 1-{answers.MAX_NUMBER_LABEL}), got {gt[:80]!r}; fix "
                             "reward_model.ground_truth or set extra_info.answer_type")
        return _result(cfg, answers.choice_correct(answer, gold), format_ok)

    if kind == "numeric":
        gold_value = answers.parse_number(gt)
        candidates = [boxed] if boxed is not None else answers.NUMBER.findall(answer)  # \boxed{} > last number
        if not candidates:
            return _result(cfg, False, format_ok)
        value = answers.parse_number(candidates[-1])
        if gold_value is not None and value is not None:
            return _result(cfg, answers.numbers_equal(value, gold_value), format_ok)
        # not plain numbers (e.g. \frac{7}{2}): fall through to math-verify

    if boxed is not None:
        if answers.normalize_latex(boxed) == answers.normalize_latex(gt) != "":
            return _result(cfg, True, format_ok)  # exact match: no need for a worker
        gold_int, boxed_int = answers.plain_int(gt), answers.plain_int(boxed)
        if gold_int is not None and boxed_int is not None:
            return _result(cfg, gold_int == boxed_int, format_ok)  # two integers: math-verify compares them exactly too
    return _Pending(answer, gt, format_ok)


def _finish(cfg: RewardConfig, data_source, job: _Pending, outcome: Outcome) -> dict:
    if outcome.status == "ok":
        return _result(cfg, bool(outcome.value), job.format_ok)
    snippet = job.answer[:120].replace("\n", " ")
    if outcome.status == "timeout":
        reason = (f"math-verify timed out after {outcome.seconds:.1f}s on answer {snippet!r}... "
                  f"({len(job.answer)} chars), ground truth {job.ground_truth[:80]!r}")
    else:
        reason = f"math-verify {outcome.status}: {outcome.error}; answer {snippet!r}..."
    return _ungradable(cfg, data_source, Ungradable(f"grader {outcome.status}", reason), job.format_ok)


def _pool(cfg: RewardConfig) -> GradingPool:
    return get_pool(cfg.workers, cfg.memory_limit_mb, preload="mix_src.rewards.grading:warmup")


# -------------------------------------------------------------------------------------------- API
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl custom-reward entry point; see the module docstring. Thread-safe."""
    return compute_score_batch([data_source], [solution_str], [ground_truth], [extra_info], **kwargs)[0]


def _prepare_or_ungradable(data_source, solution_str, ground_truth, extra_info, cfg: RewardConfig) -> dict | _Pending:
    try:
        return _prepare(data_source, solution_str, ground_truth, extra_info, cfg)
    except Exception as exc:  # noqa: BLE001 - one bad row scores as wrong, never ends the run
        format_ok = isinstance(solution_str, str) and answers.split_response(solution_str, cfg.starts_in_think)[1]
        return _ungradable(cfg, data_source, exc, format_ok)


def compute_score_batch(data_sources: Sequence, solution_strs: Sequence[str], ground_truths: Sequence,
                        extra_infos: Sequence | None = None, **kwargs) -> list[dict]:
    """Grade many responses at once (same options for all) in parallel worker processes; verl's batch reward
    signature, results in input order."""
    n = len(solution_strs)
    if not (len(data_sources) == len(ground_truths) == n) or (extra_infos is not None and len(extra_infos) != n):
        raise ValueError(f"compute_score_batch: lengths differ: data_sources {len(data_sources)}, solution_strs {n}, "
                         f"ground_truths {len(ground_truths)}, extra_infos "
                         f"{None if extra_infos is None else len(extra_infos)}")
    cfg = make_config(**kwargs)  # bad options are configuration errors: they raise
    extra_infos = extra_infos if extra_infos is not None else [None] * n
    jobs = [_prepare_or_ungradable(d, s, g, e, cfg)
            for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]
    pending = [i for i, job in enumerate(jobs) if isinstance(job, _Pending)]
    if pending:
        outcomes = _pool(cfg).map([(grade_math, (jobs[i].answer, jobs[i].ground_truth)) for i in pending],
                                  cfg.timeout_s)
        for i, outcome in zip(pending, outcomes):
            jobs[i] = _finish(cfg, data_sources[i], jobs[i], outcome)
    return jobs


def warmup(**kwargs) -> None:
    """Start the grading processes now (first use otherwise pays ~0.5-2 s of start-up)."""
    _pool(make_config(**kwargs)).warmup()


def grading_stats() -> dict:
    """Outcome counts of this process's grading pools: ok / error / timeout / crashed / workers_started."""
    total: Counter = Counter()
    for p in pools():
        total.update(p.stats)
    return dict(total)
