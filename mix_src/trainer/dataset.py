"""``RLHFDatasetWithTarget``: verl's RLHFDataset for rows that carry an off-policy target (expert solution).

Selected with ``data.custom_cls`` (the MIX config does this); its settings come from ``data.mix`` (the validated
``mix:`` section, copied there for the training set only). Each row's ``target`` is normalised once, at load, into
a plain string that travels with the row to the agent loop (which tokenises it, appends EOS and cuts the prefix):

* accepted forms: LUFFY's ``[{"role": "assistant", "content": str}]``, a ``{"content": str}`` dict, or a string;
* a missing ``target`` column is an error when ``mix.n_prefix != 0``;
* an empty or non-string target makes that prompt on-policy only (target ``""``);
* a target that starts with ``<think>\\n`` loses it when the templated prompt already ends with it;
* ``mix.data.sample_target_ratio``: each row keeps its target with this probability, drawn once per row (seeded
  with ``data.seed``; LUFFY drew again at every access);
* a target over ``mix.data.max_target_length`` tokens drops its row, or is truncated with
  ``mix.data.truncate_targets=true`` (a multi-turn expert episode, :func:`~mix_src.config.data_check.is_episode`,
  is measured by the tool loop instead).
* ``mix.data.use_target_lst``: the row's demonstrations, ``target`` first then ``target_lst`` in order (at most
  ``mix.data.max_num_targets``; :func:`~mix_src.config.data_check.demonstrations` says what is left out), travel as
  ``target_lst``; an item over the length cap is dropped (or cut), a row only when all of them are.

Every case is counted in the load's log line.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf

from verl.utils.dataset.rl_dataset import RLHFDataset

# verl's AgentLoopWorker loads this class (data.custom_cls) before it runs any agent loop: importing the
# agent loop here registers "prefix_guided" in that process, on every node, wherever mix_src is installed.
from mix_src.rollout import agent_loop  # noqa: F401
from mix_src.rollout import agent_loop_tools  # noqa: F401  (registers prefix_guided_tool, the multi-turn tool loop)
from mix_src.config.data_check import demonstrations, is_episode, normalize_target, row_problem  # noqa: F401 (normalize_target re-exported)
from mix_src.config.mix_config import DataConfig
from mix_src.trainer.stages import prompt_data_key

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

THINK_OPEN = "<think>\n"
# The rows carry their normalised target under this name whatever ``mix.data.target_key`` says: the agent
# loop and the trainer read it from here.
TARGET_FIELD = "target"
# With mix.data.use_target_lst: every row's demonstrations (a list of strings, target first; TARGET_FIELD is the
# first), under this name whatever mix.data.target_lst_key says; the trainers draw one per row from it.
TARGET_LST_FIELD = "target_lst"


class RLHFDatasetWithTarget(RLHFDataset):
    """RLHFDataset whose rows carry ``target`` (str, ``""`` = no target), read from ``mix.data.target_key``."""

    def __init__(self, data_files, tokenizer, config: DictConfig, processor=None, max_samples: int = -1):
        mix = config.get("mix", None)
        mix = OmegaConf.to_container(mix, resolve=True) if isinstance(mix, DictConfig) else (mix or None)
        self.with_targets = mix is not None
        self.target_cfg = DataConfig(**dict((mix or {}).get("data") or {}))
        self.require_target = bool(mix) and int(mix.get("n_prefix", 0)) != 0
        self.target_stats: dict[str, int] = {}
        self._rows: Optional[list[int]] = None  # the rows trained on this epoch (leave_out); None = all
        self._data_keys: Optional[list[str]] = None  # prompt_data_key of every row, made on the first leave_out
        super().__init__(data_files, tokenizer, config, processor=processor, max_samples=max_samples)

    # -- prompts left out of an epoch (mix_src.trainer.stages.start_data_epoch) ----------------------------------------
    def leave_out(self, keys: set) -> int:
        """Train only on the rows whose prompt (:func:`~mix_src.trainer.stages.prompt_data_key`) is not in ``keys`` (empty:
        every row). Returns the number of rows left."""
        if self._data_keys is None:
            self._data_keys = [prompt_data_key(m) for m in self.dataframe[self.prompt_key]]
        self._rows = [i for i, k in enumerate(self._data_keys) if k not in keys] if keys else None
        return len(self)

    def __len__(self):
        return super().__len__() if self._rows is None else len(self._rows)

    def __getitem__(self, item):
        return super().__getitem__(item if self._rows is None else self._rows[item])

    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()
        self._drop_bad_rows()
        if self.with_targets:
            self._prepare_targets()

    def _drop_bad_rows(self) -> None:
        """Drop the rows the driver's data check counted (:func:`~mix_src.config.data_check.row_problem`)."""
        cols = self.dataframe.column_names
        if self.prompt_key not in cols or "reward_model" not in cols:
            return  # refused before Ray by check_data; a direct user of the class keeps verl's behaviour
        prompts, rms = self.dataframe[self.prompt_key], self.dataframe["reward_model"]
        keep = [i for i, (p, rm) in enumerate(zip(prompts, rms)) if row_problem(p, rm) is None]
        if len(keep) < len(self.dataframe):
            msg = (f"[mix_src.trainer.dataset] {list(self.original_data_files)}: dropped {len(self.dataframe) - len(keep)} "
                   f"of {len(self.dataframe)} rows that fail the data check (mix_src/config/data_check.py row_problem)")
            print(msg, flush=True)
            logger.info(msg)
            self.dataframe = self.dataframe.select(keep)

    # -- target normalisation, once per load ------------------------------------------------------------
    def _prepare_targets(self) -> None:
        key, cfg = self.target_cfg.target_key, self.target_cfg
        lst_key = cfg.target_lst_key if cfg.use_target_lst else None
        files, cols = list(self.original_data_files), self.dataframe.column_names
        if lst_key is not None and lst_key not in cols:
            raise ValueError(f"{files}: mix.data.use_target_lst=true but no '{lst_key}' column (a list of demonstrations "
                             f"per row); set mix.data.target_lst_key or mix.data.use_target_lst=false. Columns present: "
                             f"{cols}")
        if key not in cols and lst_key is None:
            if self.require_target:
                raise ValueError(
                    f"{files}: no '{key}' column, but mix.n_prefix != 0 needs an off-policy target per row. "
                    f"Add the column (see data/README.md), point mix.data.target_key at the right column, "
                    f"or set mix.n_prefix=0 for on-policy training. Columns present: {self.dataframe.column_names}"
                )
            if TARGET_FIELD in self.dataframe.column_names:
                self.dataframe = self.dataframe.remove_columns([TARGET_FIELD])
            self.dataframe = self.dataframe.add_column(TARGET_FIELD, [""] * len(self.dataframe))
            return

        prompts = list(self.dataframe[self.prompt_key])
        n_rows = len(prompts)
        texts: list[Optional[str]] = ([normalize_target(v) for v in self.dataframe[key]] if key in cols
                                      else [None] * n_rows)
        lst_counts: dict[str, int] = {}
        if lst_key is None:  # one demonstration per row: its target
            sets = [[t] if t is not None else [] for t in texts]
        else:  # target first, then the list (mix_src.config.data_check.demonstrations)
            sets = []
            for text, items in zip(texts, self.dataframe[lst_key]):
                one, why = demonstrations(text, items, cfg.max_num_targets)
                sets.append(one)
                for reason, k in why.items():
                    lst_counts[reason] = lst_counts.get(reason, 0) + k
        n_invalid = sum(not one for one in sets)

        # strip a leading "<think>\n" when the templated prompt already ends with it (LUFFY's 16k-think models)
        n_think = 0
        for i, one in enumerate(sets):
            if any(t.startswith(THINK_OPEN) for t in one) and self._prompt_ends_with_think(prompts[i]):
                n_think += sum(t.startswith(THINK_OPEN) for t in one)
                sets[i] = [t[len(THINK_OPEN):] if t.startswith(THINK_OPEN) else t for t in one]

        # sample_target_ratio: each row keeps its demonstrations with this probability, drawn once per row (seeded)
        n_unsampled = 0
        if cfg.sample_target_ratio < 1.0:
            seed = self.config.get("seed", None)
            keep = np.random.default_rng(0 if seed is None else int(seed)).random(n_rows) < cfg.sample_target_ratio
            for i in np.flatnonzero(~keep):
                if sets[i]:
                    sets[i] = []
                    n_unsampled += 1

        # length check under the policy's tokenizer: an item over the cap is dropped (or cut); a row whose every
        # demonstration is over it is dropped
        max_len = cfg.target_limit(self.config.get("max_response_length"))  # default: response - 1
        idx = [(i, k) for i, one in enumerate(sets) for k, t in enumerate(one) if not is_episode(t)]  # episodes: the tool loop's
        enc = {"input_ids": [], "offset_mapping": []}  # no target left (sample_target_ratio=0, all null): on-policy only
        if idx:
            enc = self.tokenizer([sets[i][k] for i, k in idx], add_special_tokens=False,
                                 return_offsets_mapping=cfg.truncate_targets)
        too_long = [j for j, ids in enumerate(enc["input_ids"]) if len(ids) > max_len]
        n_truncated, drop_rows, n_items_dropped = 0, set(), 0
        if cfg.truncate_targets:
            for j in too_long:  # cut after the max_len-th token's last character
                i, k = idx[j]
                sets[i][k] = sets[i][k][: enc["offset_mapping"][j][max_len - 1][1]]
            n_truncated = len(too_long)
        else:
            over = {idx[j] for j in too_long}
            for i in {i for i, _ in over}:
                kept = [t for k, t in enumerate(sets[i]) if (i, k) not in over]
                n_items_dropped += len(sets[i]) - len(kept)
                if not kept:
                    drop_rows.add(i)
                sets[i] = kept

        final = [one[0] if one else "" for one in sets]
        stale = [c for c in {key, TARGET_FIELD, *([lst_key, TARGET_LST_FIELD] if lst_key else [])}
                 if c in self.dataframe.column_names]
        self.dataframe = self.dataframe.remove_columns(stale).add_column(TARGET_FIELD, final)
        if lst_key is not None:
            self.dataframe = self.dataframe.add_column(TARGET_LST_FIELD, [list(one) for one in sets])
        if drop_rows:
            self.dataframe = self.dataframe.select([i for i in range(n_rows) if i not in drop_rows])

        self.target_stats = {"rows": n_rows, "with_target": sum(1 for i, t in enumerate(final) if t and i not in drop_rows),
                             "invalid_target": n_invalid, "unsampled_target": n_unsampled,
                             "think_prefix_stripped": n_think, "dropped_too_long": len(drop_rows),
                             "truncated": n_truncated}  # fmt: skip
        msg = (
            f"[mix_src.trainer.dataset] {files}: {n_rows} rows; {self.target_stats['with_target']} with a target; "
            f"{n_invalid} empty/non-string targets -> on-policy only; {n_unsampled} targets not sampled "
            f"(mix.data.sample_target_ratio={cfg.sample_target_ratio}); "
            f"{len(drop_rows)} rows dropped for targets over mix.data.max_target_length={max_len} tokens; "
            f"{n_truncated} targets truncated to it; '<think>\\n' stripped from {n_think}"
        )
        if lst_key is not None:
            kept_sets = [one for i, one in enumerate(sets) if i not in drop_rows]
            self.target_stats.update({"demonstrations": sum(map(len, kept_sets)), "items_too_long": n_items_dropped,
                                      **{f"lst: {why}": k for why, k in lst_counts.items()}})
            msg += (f"; target_lst ({lst_key}, target first, at most mix.data.max_num_targets={cfg.max_num_targets}): "
                    f"{self.target_stats['demonstrations']} demonstrations, {n_items_dropped} over the length dropped, "
                    + ", ".join(f"{k} {why}" for why, k in lst_counts.items()))
        print(msg, flush=True)
        logger.info(msg)

    def _prompt_ends_with_think(self, messages) -> bool:
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                                  **self.apply_chat_template_kwargs)
        return isinstance(text, str) and text.endswith(THINK_OPEN)
