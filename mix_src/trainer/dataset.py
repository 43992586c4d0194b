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
from mix_src.config.data_check import is_episode, normalize_target, row_problem  # noqa: F401 (normalize_target re-exported)
from mix_src.config.mix_config import DataConfig
from mix_src.trainer.stages import prompt_data_key

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

THINK_OPEN = "<think>\n"
# The rows carry their normalised target under this name whatever ``mix.data.target_key`` says: the agent
# loop and the trainer read it from here.
TARGET_FIELD = "target"


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
        key = self.target_cfg.target_key
        files = list(self.original_data_files)
        if key not in self.dataframe.column_names:
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
        texts: list[Optional[str]] = [normalize_target(v) for v in self.dataframe[key]]
        n_rows = len(texts)
        n_invalid = sum(t is None for t in texts)

        # strip a leading "<think>\n" when the templated prompt already ends with it (LUFFY's 16k-think models)
        n_think = 0
        for i, text in enumerate(texts):
            if text is not None and text.startswith(THINK_OPEN) and self._prompt_ends_with_think(prompts[i]):
                texts[i] = text[len(THINK_OPEN) :]
                n_think += 1

        # sample_target_ratio: keep each target with this probability, drawn once per row (seeded)
        n_unsampled = 0
        if self.target_cfg.sample_target_ratio < 1.0:
            seed = self.config.get("seed", None)
            keep = np.random.default_rng(0 if seed is None else int(seed)).random(n_rows) < self.target_cfg.sample_target_ratio
            for i in np.flatnonzero(~keep):
                if texts[i] is not None:
                    texts[i] = None
                    n_unsampled += 1

        # length check under the policy's tokenizer
        max_len = self.target_cfg.target_limit(self.config.get("max_response_length"))  # default: response - 1
        idx = [i for i, t in enumerate(texts) if t is not None and not is_episode(t)]  # episodes: the tool loop's
        enc = {"input_ids": [], "offset_mapping": []}  # no target left (sample_target_ratio=0, all null): on-policy only
        if idx:
            enc = self.tokenizer([texts[i] for i in idx], add_special_tokens=False,
                                 return_offsets_mapping=self.target_cfg.truncate_targets)
        too_long = [j for j, ids in enumerate(enc["input_ids"]) if len(ids) > max_len]
        n_truncated, drop_rows = 0, set()
        if self.target_cfg.truncate_targets:
            for j in too_long:  # cut after the max_len-th token's last character
                texts[idx[j]] = texts[idx[j]][: enc["offset_mapping"][j][max_len - 1][1]]
            n_truncated = len(too_long)
        else:
            drop_rows = {idx[j] for j in too_long}

        final = ["" if t is None else t for t in texts]
        stale = [c for c in {key, TARGET_FIELD} if c in self.dataframe.column_names]
        self.dataframe = self.dataframe.remove_columns(stale).add_column(TARGET_FIELD, final)
        if drop_rows:
            self.dataframe = self.dataframe.select([i for i in range(n_rows) if i not in drop_rows])

        self.target_stats = {"rows": n_rows, "with_target": sum(1 for i, t in enumerate(final) if t and i not in drop_rows),
                             "invalid_target": n_invalid, "unsampled_target": n_unsampled,
                             "think_prefix_stripped": n_think, "dropped_too_long": len(drop_rows),
                             "truncated": n_truncated}  # fmt: skip
        msg = (
            f"[mix_src.trainer.dataset] {files}: {n_rows} rows; {self.target_stats['with_target']} with a target; "
            f"{n_invalid} empty/non-string targets -> on-policy only; {n_unsampled} targets not sampled "
            f"(mix.data.sample_target_ratio={self.target_cfg.sample_target_ratio}); "
            f"{len(drop_rows)} rows dropped for targets over mix.data.max_target_length={max_len} tokens; "
            f"{n_truncated} targets truncated to it; '<think>\\n' stripped from {n_think}"
        )
        print(msg, flush=True)
        logger.info(msg)

    def _prompt_ends_with_think(self, messages) -> bool:
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                                  **self.apply_chat_template_kwargs)
        return isinstance(text, str) and text.endswith(THINK_OPEN)
