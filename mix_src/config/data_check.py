"""Data contents, checked on the driver before Ray starts (preflight slot 4; cost: scripts/data/README.md).

:func:`check_data` opens each ``data.train_files`` / ``data.val_files`` file as verl's ``RLHFDataset`` reads it
(verl/utils/dataset/rl_dataset.py ``_read_files_and_tokenize``), refuses a bad file (:func:`check_file`, naming the
file, the column and what to do), drops and counts bad rows (:func:`row_problem`, the rule
:class:`mix_src.trainer.dataset.RLHFDatasetWithTarget` drops them by on the workers; with another
``data.custom_cls`` a bad row is refused instead), and counts the prompts and targets the dataset drops for length,
so that a file left with fewer usable rows than one batch is refused here rather than found empty inside Ray.
"""

from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, ListConfig

from mix_src.config.mix_config import MixConfigError
from mix_src.rewards.answers import ground_truth_problem

READABLE = (".parquet", ".json", ".jsonl")  # what verl's RLHFDataset reads (rl_dataset.py _read_files_and_tokenize)
OUR_DATASET = "RLHFDatasetWithTarget"  # the class that drops bad rows with row_problem (mix_src/trainer/dataset.py)
EXACT_TARGETS = 5000  # targets longer in bytes than the cap: tokenised all when at most this many
SAMPLED_TARGETS = 2000  # ... else a seeded sample of this many, for an estimate


# ------------------------------------------------------------------------------------------ one row
def _as_list(value) -> Any:
    """A numpy array (as parquet gives) as a list; anything else unchanged."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def normalize_target(value: Any) -> Optional[str]:
    """The target text of one row (LUFFY's list-of-one-message form, a message dict, or a plain string), or None
    when it is missing, empty or not text."""
    value = _as_list(value)  # numpy arrays from parquet
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value.strip() else None


# why a row's target_lst loses an item (or, for the first, gives none): counted by check_data and the dataset
LST_NONE, LST_NOT_TEXT, LST_DUPLICATE, LST_OVER_CAP = ("null, empty or non-list target_lst", "non-text target_lst item",
                                                       "duplicate target_lst item", "target_lst item beyond max_num_targets")


def demonstrations(target: Optional[str], items: Any, max_num_targets: int) -> tuple[list[str], dict[str, int]]:
    """The demonstrations a prefixed row of this prompt draws from, and why items were left out: ``target`` (already
    :func:`normalize_target`-ed; None: none) first, then each item of the row's ``target_lst`` in order (a string, a
    ``{content: str}`` message or LUFFY's one-message list). Non-text or blank items and repeats of an earlier item are
    dropped and counted (an item equal to ``target`` is merged silently: OpenR1-style rows list their target again);
    the first ``max_num_targets`` are kept (LUFFY keeps the first ``max_num_targets``,
    luffy/verl/verl/mix_src/rl_dataset_with_target.py:166-169). A null, empty or non-list ``target_lst`` leaves the
    row with ``target`` alone (counted). Length is not checked here (the caller's tokenizer: item dropped; a row whose
    every item is too long: dropped)."""
    out, why = ([target] if target else []), {}
    items = _as_list(items)
    if not isinstance(items, (list, tuple)) or not items:
        why[LST_NONE] = 1
        items = []
    for item in items:
        text = normalize_target(item)
        if text is None:
            why[LST_NOT_TEXT] = why.get(LST_NOT_TEXT, 0) + 1
        elif text in out:
            if text != target:
                why[LST_DUPLICATE] = why.get(LST_DUPLICATE, 0) + 1
        else:
            out.append(text)
    if len(out) > max_num_targets:
        why[LST_OVER_CAP] = len(out) - max_num_targets
    return out[:max_num_targets], why


def is_episode(text: Optional[str]) -> bool:
    """A multi-turn expert episode (the tool loop's target: a JSON list of ``{role, content}`` messages,
    mix_src/rollout/agent_loop_tools.py ``parse_episode``), whose length the tool loop measures, not this check."""
    if not text or not text.lstrip().startswith("["):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def row_problem(prompt, reward_model) -> Optional[str]:
    """Why a row cannot train or be graded (a prompt that is not a non-empty chat list of ``{role: str, content:
    str}`` messages, a ground truth missing or ungradable), or ``None``: THE row rule, shared by :func:`check_data`
    (driver) and :class:`mix_src.trainer.dataset.RLHFDatasetWithTarget` (workers) so both see the same rows."""
    prompt, reward_model = _as_list(prompt), _as_list(reward_model)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return "prompt is not a non-empty list of {role, content} messages"
    if any(not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str)
           for m in prompt):
        return "a prompt message is not {role: str, content: str}"
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        return "reward_model has no ground_truth"
    why = ground_truth_problem(reward_model["ground_truth"])
    return None if why is None else "reward_model.ground_truth " + why.split(";")[0].split(" (")[0]


# ------------------------------------------------------------------------------------------ one file
@dataclass
class FileReport:
    """What :func:`check_file` found in one file."""

    path: str
    rows: int
    kept: list[int]  # row indices that pass row_problem
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    first_bad: dict[str, int] = field(default_factory=dict)  # reason -> first row index
    prompts: list = field(default_factory=list)  # the kept rows' prompts (for the length check)
    targets: list = field(default_factory=list)  # the kept rows' targets as text (None: no target)
    target_sets: Optional[list] = None  # with mix.data.use_target_lst: the kept rows' demonstrations (demonstrations)
    lst_counts: dict = field(default_factory=dict)  # reason -> count of the target_lst items (rows) left out

    def summary(self, role: str) -> str:
        drops = "; ".join(f"{n} {why} (first: row {self.first_bad[why]})" for why, n in self.dropped.items())
        lst = "; ".join(f"{n} {why}" for why, n in self.lst_counts.items())
        return (f"[mix_src.data_check] {role} {self.path}: {self.rows} rows, {len(self.kept)} kept"
                + (f", {self.rows - len(self.kept)} dropped: {drops}" if self.dropped else ", none dropped")
                + ("" if self.target_sets is None else
                   f"; target_lst: {sum(len(t) for t in self.target_sets)} demonstrations in {len(self.target_sets)} "
                   f"rows (target first when present), left out: {lst or 'none'}"))


def _refuse(path: str, key: str, what: str) -> MixConfigError:
    return MixConfigError(f"{key}: {path}: {what}")


def read_columns(path: str, columns: Iterable[str], key: str) -> tuple[dict[str, list], dict[str, str]]:
    """``({column: values}, {column: type})`` for the wanted columns that exist (types of all columns), read the
    way verl reads the file. Raises naming the file for what verl's dataset could not read."""
    if os.path.isdir(path):
        raise _refuse(path, key, "is a directory; verl's RLHFDataset reads one .parquet/.json/.jsonl file per entry "
                                 "(list the files, e.g. data.train_files=[a.parquet,b.parquet])")
    if not path.lower().endswith(READABLE):
        raise _refuse(path, key, f"unsupported file type; verl's RLHFDataset reads {', '.join(READABLE)}")
    if os.path.getsize(path) == 0:
        raise _refuse(path, key, "is empty (0 bytes); rebuild it (scripts/data/README.md)")
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
            types = {f.name: str(f.type) for f in pf.schema_arrow}
            table = pf.read(columns=[c for c in columns if c in types])
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a broken file
            raise _refuse(path, key, f"is not a readable parquet file ({type(e).__name__}: {str(e)[:200]})") from e
        return {c: table.column(c).to_pylist() for c in table.column_names}, types
    try:
        records = json_records(path)
    except JsonLinesError as e:
        what = f"line {e.line} is not JSON ({e.error.msg})" if e.line else f"is not JSON ({e.error.msg}, line {e.error.lineno})"
        raise _refuse(path, key, what) from e
    if not all(isinstance(r, dict) for r in records):
        raise _refuse(path, key, "holds something other than one JSON object per row")
    names = list(dict.fromkeys(k for r in records for k in r))
    types = {c: ("string" if all(isinstance(r.get(c), str) for r in records if r.get(c) is not None) else "object")
             for c in names}
    return {c: [r.get(c) for r in records] for c in columns if c in names}, types


class JsonLinesError(ValueError):
    """A file :func:`json_records` could not read: ``line`` is the JSONL line (1-based), or None when the file is
    one JSON array (``error.lineno`` is then where it broke); ``error`` is json's own exception."""

    def __init__(self, line: Optional[int], error: json.JSONDecodeError):
        super().__init__(error.msg)
        self.line, self.error = line, error


def json_records(path: str) -> list:
    """The records of a JSON array or JSON-lines file, values as written (no type inference), the way verl's
    dataset reads ``.json``/``.jsonl``; raises :class:`JsonLinesError` naming the broken line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    n, records = None, []  # n: the JSONL line being read; None for a JSON array
    try:
        if text.lstrip()[:1] == "[":
            return json.loads(text)
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                records.append(json.loads(line))
        return records
    except json.JSONDecodeError as e:
        raise JsonLinesError(n, e) from e


def check_file(path: str, key: str, prompt_key: str, target_key: Optional[str], lst_key: Optional[str] = None,
               max_num_targets: int = 5) -> FileReport:
    """Open one data file, refuse it when it is unusable, and sort its rows with :func:`row_problem`; ``lst_key``
    (``mix.data.use_target_lst``): the rows' demonstrations too (:func:`demonstrations`), the column required."""
    wanted = [prompt_key, "reward_model", *([target_key] if target_key else []), *([lst_key] if lst_key else [])]
    cols, types = read_columns(path, wanted, key)
    n = len(next(iter(cols.values()))) if cols else 0
    if prompt_key not in types:
        raise _refuse(path, f"{key} (data.prompt_key={prompt_key})",
                      f"no '{prompt_key}' column; its columns are {sorted(types)}. Rebuild it with scripts/data "
                      "(prepare_openr1 / prepare_eval), or set data.prompt_key")
    if types[prompt_key] in ("string", "large_string"):
        raise _refuse(path, key, f"column '{prompt_key}' holds strings; verl's chat-template path needs a list of "
                                 "{role, content} messages per row, e.g. [{'role': 'user', 'content': '...'}]")
    if "reward_model" not in types:
        raise _refuse(path, key, f"no 'reward_model' column (a {{style, ground_truth}} struct the reward grades "
                                 f"against); its columns are {sorted(types)}")
    if target_key and target_key in types and not _text_like(types[target_key]):
        raise _refuse(path, f"{key} (mix.data.target_key={target_key})",
                      f"column '{target_key}' has type {types[target_key]}; a target is a string or LUFFY's "
                      "[{role: assistant, content: str}]")
    if lst_key and lst_key not in types:
        raise _refuse(path, f"{key} (mix.data.use_target_lst=true)",
                      f"no '{lst_key}' column (a list of demonstrations per row); its columns are {sorted(types)}. "
                      "Rebuild it with scripts/data/prepare_openr1.py, set mix.data.target_lst_key, or set "
                      "mix.data.use_target_lst=false")
    if lst_key and not _list_like(types[lst_key]):
        raise _refuse(path, f"{key} (mix.data.target_lst_key={lst_key})",
                      f"column '{lst_key}' has type {types[lst_key]}; target_lst is a list of strings or of "
                      "{role: assistant, content: str} messages per row")
    if n == 0:
        raise _refuse(path, key, "has no rows")
    report = FileReport(path, n, [], target_sets=[] if lst_key else None)
    targets = cols.get(target_key) if target_key else None
    lists = cols.get(lst_key) if lst_key else None
    for i, (prompt, rm) in enumerate(zip(cols[prompt_key], cols["reward_model"])):
        why = row_problem(prompt, rm)
        if why is None:
            report.kept.append(i)
            report.prompts.append(prompt)
            report.targets.append(normalize_target(targets[i]) if targets is not None else None)
            if lists is not None:
                texts, why_lst = demonstrations(report.targets[-1], lists[i], max_num_targets)
                report.target_sets.append(texts)
                for why, k in why_lst.items():
                    report.lst_counts[why] = report.lst_counts.get(why, 0) + k
        else:
            report.dropped[why] = report.dropped.get(why, 0) + 1
            report.first_bad.setdefault(why, i)
    return report


def _text_like(arrow_type: str) -> bool:
    """A target column LUFFY's or our loader reads: strings, a message list/struct, or all nulls."""
    return arrow_type in ("string", "large_string", "null", "object") or "struct<" in arrow_type \
        or arrow_type.startswith(("list<element: string", "large_list<element: string"))


def _list_like(arrow_type: str) -> bool:
    """A target_lst column: a list (of strings or messages), all nulls, or JSON objects."""
    return arrow_type in ("null", "object") or arrow_type.startswith(("list<", "large_list<"))


# --------------------------------------------------------------------------------------- prompt length
def _tokenizer(config: DictConfig):
    """The policy's tokenizer (``model.tokenizer_path`` or ``model.path``), loaded once for all files."""
    model = config.actor_rollout_ref.model
    return _load_tokenizer(os.path.expanduser(str(model.get("tokenizer_path") or model.path)),
                           bool(model.get("trust_remote_code", False)))


@functools.lru_cache(maxsize=2)
def _load_tokenizer(path: str, trust_remote_code: bool):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(path, trust_remote_code=trust_remote_code)


def check_prompt_lengths(config: DictConfig, key: str, report: FileReport) -> set[int]:
    """Apply ``data.truncation`` / ``data.filter_overlong_prompts`` to one file (verl's count: the chat template
    with the generation prompt). Returns the rows verl's dataset will filter out; raises for ``truncation=error``,
    ``right`` and ``middle`` (verl's agent loop left-truncates whatever it says; ``left`` is not checked)."""
    limit, tok = int(config.data.max_prompt_length), _tokenizer(config)
    kwargs = {k: v for k, v in (config.data.get("apply_chat_template_kwargs") or {}).items()
              if k not in ("tokenize", "return_dict", "return_tensors")}
    texts = [tok.apply_chat_template(list(_as_list(p)), add_generation_prompt=True, tokenize=False, **kwargs)
             for p in report.prompts]  # counted as verl's maybe_filter_out_long_prompts counts them
    lengths = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    over = [report.kept[j] for j, n in enumerate(lengths) if n > limit]
    if not over:
        return set()
    longest = max(lengths)
    if bool(config.data.get("filter_overlong_prompts", False)):
        print(f"[mix_src.data_check] {key} {report.path}: {len(over)} prompts longer than data.max_prompt_length="
              f"{limit} tokens (longest {longest}) are dropped by data.filter_overlong_prompts=true", flush=True)
        return set(over)
    truncation = str(config.data.get("truncation", "error"))
    if truncation == "error":
        raise _refuse(report.path, key, f"{len(over)} of {len(report.kept)} prompts are longer than "
                      f"data.max_prompt_length={limit} tokens (first: row {over[0]}, longest {longest}) and "
                      "data.truncation=error; raise data.max_prompt_length, set data.filter_overlong_prompts=true "
                      "to drop them, or data.truncation=left to cut them from the left (what verl's agent loop does)")
    # left is not tokenised here (check_data skips it): it is what the agent loop does anyway
    raise _refuse(report.path, key, f"{len(over)} prompts are longer than data.max_prompt_length={limit} tokens "
                  f"(first: row {over[0]}) and data.truncation={truncation}, but verl's agent loop cuts long prompts "
                  "from the left whatever data.truncation says (agent_loop.py _cap_text_prompt_length); set "
                  "data.truncation=left, data.filter_overlong_prompts=true, or raise data.max_prompt_length")


# --------------------------------------------------------------------------------------- target length
def check_target_lengths(config: DictConfig, key: str, report: FileReport) -> set[int]:
    """Rows the dataset (mix_src/trainer/dataset.py) will drop for a target over ``mix.data.max_target_length``
    tokens: only targets longer in UTF-8 bytes are tokenised, exactly up to :data:`EXACT_TARGETS` of them, else a
    seeded sample of :data:`SAMPLED_TARGETS` gives a printed estimate and none. None with ``truncate_targets=true``
    or when ``sample_target_ratio < 1`` (the dataset drops only sampled targets; an upper bound would refuse
    wrongly). Multi-turn episodes are the tool loop's to measure (:func:`is_episode`)."""
    target_cfg = (config.get("mix") or {}).get("data") or {}
    cap = target_cfg.get("max_target_length")
    if cap is None or bool(target_cfg.get("truncate_targets", False)):
        return set()
    cap = int(cap)
    sets = report.target_sets if report.target_sets is not None else [[t] if t else [] for t in report.targets]
    candidates = [(j, k) for j, texts in enumerate(sets) for k, t in enumerate(texts)  # may not fit (a token
                  if len(t.encode("utf-8")) > cap and not is_episode(t)]  # covers at least one byte)
    if not candidates:
        return set()
    exact = len(candidates) <= EXACT_TARGETS
    longer = candidates if exact else random.Random(0).sample(candidates, SAMPLED_TARGETS)
    ids = _tokenizer(config)([sets[j][k] for j, k in longer], add_special_tokens=False)["input_ids"]
    over_items = {jk for jk, t in zip(longer, ids) if len(t) > cap}
    # a row is dropped when every one of its demonstrations is over the cap; an item over it alone is dropped
    over = [report.kept[j] for j in sorted({j for j, _ in over_items}) if all((j, k) in over_items
                                                                           for k in range(len(sets[j])))]
    if report.target_sets is not None and over_items and exact:
        print(f"[mix_src.data_check] {key} {report.path}: {len(over_items)} target_lst demonstrations are longer "
              f"than mix.data.max_target_length={cap} tokens; the dataset drops each such item, and a row only when "
              f"all its demonstrations are: {len(over)} rows", flush=True)
    if not over:
        return set()
    ratio = float(target_cfg.get("sample_target_ratio", 1.0))
    if exact:
        print(f"[mix_src.data_check] {key} {report.path}: {len(over)} rows have a target longer than "
              f"mix.data.max_target_length={cap} tokens (first: row {over[0]}); the dataset drops them at load "
              "(mix.data.truncate_targets=true cuts them instead)", flush=True)
        return set(over) if ratio >= 1.0 else set()
    share = len(over) / len(longer) * len(candidates)
    print(f"[mix_src.data_check] {key} {report.path}: about {share:.0f} rows have a target longer than "
          f"mix.data.max_target_length={cap} tokens (estimated from {len(longer)} sampled); the dataset drops "
          "and counts them at load", flush=True)
    return set()


# ----------------------------------------------------------------------------------------- the stage
def data_files(value, remote: bool = False) -> list[str]:
    """The local files of a ``data.*_files`` value (``remote=True``: all of them; verl copies hdfs:// ones itself)."""
    values = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    return [os.path.expanduser(str(v)) for v in values if v is not None and (remote or "://" not in str(v))]


def check_data(config: DictConfig) -> dict[str, FileReport]:
    """Preflight slot 4: every train/val file checked; one summary line per file. Returns the reports."""
    data = config.data
    prompt_key = str(data.get("prompt_key", "prompt"))
    mix = config.get("mix") or {}
    target_key = (mix.get("data") or {}).get("target_key", "target") if mix else None
    mix_data = (mix.get("data") or {}) if mix else {}
    lst_key = str(mix_data.get("target_lst_key", "target_lst")) if mix_data.get("use_target_lst") else None
    max_num = int(mix_data.get("max_num_targets", 5) or 5)
    ours = str((data.get("custom_cls") or {}).get("name") or "") == OUR_DATASET
    check_length = bool(data.get("filter_overlong_prompts", False)) or str(data.get("truncation", "error")) != "left"
    reports: dict[str, FileReport] = {}
    for key, role in (("data.train_files", "train"), ("data.val_files", "val")):
        usable, paths = 0, data_files(data.get(key.split(".")[1]))
        for path in paths:
            train = role == "train"
            report = check_file(path, key, prompt_key, target_key if train else None, lst_key if train else None, max_num)
            print(report.summary(role), flush=True)
            if report.dropped and not ours:
                why, n = next(iter(report.dropped.items()))
                raise _refuse(path, key, f"{n} rows with {why} (first: row {report.first_bad[why]}); data.custom_cls "
                              f"is not {OUR_DATASET}, which drops such rows, so fix the file")
            filtered = check_prompt_lengths(config, key, report) if check_length and report.kept else set()
            if role == "train":
                filtered |= check_target_lengths(config, key, report)
            usable += len(report.kept) - len(filtered)
            reports[path] = report
        if not paths or len(paths) < len(data_files(data.get(key.split(".")[1]), remote=True)):
            continue  # a remote file: not counted
        limit = int(data.get(f"{role}_max_samples", -1) or -1)
        usable = min(usable, limit) if limit > 0 else usable
        # one training batch and, unless evaluating only, one of the loader's (verl/trainer/ppo/ray_trainer.py 404-411)
        need, batch_key = int(data.train_batch_size) if role == "train" else 1, "data.train_batch_size"
        if role == "train" and int(data.get("gen_batch_size") or 0) > need and not config.trainer.get("val_only"):
            need, batch_key = int(data.gen_batch_size), "data.gen_batch_size"
        if usable < need:
            what = f"{batch_key}={need}" if role == "train" else "one row"
            raise MixConfigError(f"{key}: {usable} usable rows after the drops above, fewer than {what}; verl's "
                                 "dataloader drops the last incomplete batch, so nothing would train. Add rows or "
                                 f"lower {batch_key}")
    return reports
