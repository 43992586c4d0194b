"""Rollout policies with several generation passes on verl's V1 trainer (``trainer.use_v1=true``): every policy of
:data:`mix_src.trainer.rollout_policy.ROLLOUT_POLICIES` but a streamed one (``v1_stream=True``) runs here, pass by pass
(mix_src/README.md "Two trainer bases", row "rollout policies"). :class:`V1PolicyRunner` stands in for verl's
agent-loop manager in ``_submit_batch_to_rollout`` (``verl/trainer/ppo/v1/trainer_base.py``; verl writes each scored
row back as ``{uid}_{session}_0``, ``agent_loop_tq.py`` ``_run_prompt``): each ``ctx.generate`` submits one
single-session scratch prompt per row (``__rollout_n__=1``) and waits; the rows the policy returns are copied under
their group's keys ``{uid}_{j}_0``, the scratch keys cleared and the prompt key marked ``finished``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl import DataProto
from verl.utils import tensordict_utils as tu

from mix_src.trainer.dataset import TARGET_FIELD
from mix_src.trainer.stages import pass_arguments, prefix_mask_tensor
from mix_src.trainer.v1_replay import extra_fields, tag_lengths

__all__ = ["TQ_KEY", "V1PolicyRunner"]

TQ_KEY = "__tq_key__"  # non-tensor column of a pass's rows: the row's TransferQueue key
PROMPT_RECORD = "__v1_prompt__"  # non-tensor column of ctx.records(): the row's prompt (a one-row TensorDict)
PARTITION = "train"
# with mix.data.use_target_lst: a prompt's n drawn demonstrations, one per session (mix_src/rollout/agent_loop.py
# row_target); a pass's single-session rows get their own row's
PREFIX_TARGETS = "prefix_targets"
# the tensors of a pass's rows (V1PolicyRunner._view); any other tensor of the rows a policy returns is its own
VIEW_TENSORS = {"response_mask", "token_level_scores", "prefix_mask", "responses", "prompts", "attention_mask",
                "rollout_log_probs"}


class V1PolicyRunner:
    """An agent-loop manager stand-in for one ``_submit_batch_to_rollout`` call: ``manager`` is verl's, ``gen_index``
    the fetch index of the batch's ratios and seeds, ``metrics`` gets the pass counts."""

    def __init__(self, trainer: Any, manager: Any, gen_index: int, metrics: dict, poll_s: float = 0.2):
        self.trainer, self.manager, self.gen_index, self.metrics, self.poll_s = trainer, manager, gen_index, metrics, poll_s
        self._scratch: list[str] = []  # scratch uids of this call's passes
        self._passes = 0

    # ---- the agent-loop manager's one method that _submit_batch_to_rollout calls ------------------------
    def generate_sequences(self, batch) -> None:
        n, P = self.trainer.n, len(batch)
        uids = [str(u) for u in _column(batch, "uid")]
        base_seeds = np.asarray(_column(batch, "rollout_seeds"), dtype=np.int64).reshape(-1)  # (P*n,)
        ratios = np.asarray(_column(batch, "prefix_ratios"), dtype=np.float64).reshape(-1)
        row_uid = np.array([u for u in uids for _ in range(n)], dtype=object)
        view = {"uid": row_uid}
        if TARGET_FIELD in batch.keys():
            view[TARGET_FIELD] = np.array([t for t in _column(batch, TARGET_FIELD) for _ in range(n)], dtype=object)
        drawn = PREFIX_TARGETS in batch.keys()  # each row's own demonstration: passed to every pass explicitly
        if drawn:
            view[TARGET_FIELD] = np.array([t for ts in _column(batch, PREFIX_TARGETS) for t in ts], dtype=object)
        prompt_rows = np.repeat(np.arange(P), n)

        def records(rows) -> Any:
            rows = np.asarray(rows, dtype=np.int64)
            prompts = np.empty(len(rows), dtype=object)
            for k, r in enumerate(rows):
                prompts[k] = tu.index_select_tensor_dict(batch, [int(prompt_rows[r])])
            cols = {k: v[rows] for k, v in view.items()}
            return DataProto(non_tensor_batch={**cols, PROMPT_RECORD: prompts, "rollout_seed": base_seeds[rows]})

        def generate(pass_ratios, rows=None, targets=None, prompts=None):
            if prompts is not None:
                tds = list(prompts.non_tensor_batch[PROMPT_RECORD])
                seeds, group_uids = prompts.non_tensor_batch["rollout_seed"], list(prompts.non_tensor_batch["uid"])
            else:
                idx = np.arange(n * P) if rows is None else np.asarray(rows, dtype=np.int64)
                tds = [tu.index_select_tensor_dict(batch, [int(prompt_rows[r])]) for r in idx]
                seeds, group_uids = base_seeds[idx], list(row_uid[idx])
            if targets is None and drawn:
                targets = (prompts.non_tensor_batch[TARGET_FIELD] if prompts is not None else view[TARGET_FIELD][idx])
            pass_ratios, targets, seeds = pass_arguments(pass_ratios, targets, seeds, self.trainer.global_steps,
                                                         self._passes, rows is not None, prompts is not None)
            out = self._run_pass(tds, pass_ratios, seeds, targets)
            out.non_tensor_batch["uid"] = np.asarray(group_uids, dtype=object)
            return out

        try:
            out = self.trainer._run_rollout_policy(DataProto(non_tensor_batch=view), self.gen_index, generate=generate,
                                                   prefix_ratios=lambda: ratios.copy(), records=records)  # fmt: skip
            self._commit(out, uids)
        finally:
            self._clear_scratch()
        self.metrics["rollout_policy/passes"] = self.metrics.get("rollout_policy/passes", 0) + self._passes

    # ---- one pass: one single-session scratch prompt per row ----------------------------------------------
    def _run_pass(self, tds: list, ratios: np.ndarray, seeds: np.ndarray, targets: Optional[list]):
        scratch = [str(uuid.uuid4()) for _ in tds]
        self._scratch += scratch
        self._passes += 1
        self.metrics["rollout_policy/rows_generated"] = self.metrics.get("rollout_policy/rows_generated", 0) + len(tds)
        sub = tds[0] if len(tds) == 1 else tu.concat_tensordict(tds)
        tu.assign_non_tensor_stack(sub, "uid", scratch)
        tu.assign_non_tensor_stack(sub, "prefix_ratios", [[float(r)] for r in ratios])
        tu.assign_non_tensor_stack(sub, "rollout_seeds", [[int(s)] for s in seeds])
        if targets is not None:
            tu.assign_non_tensor_stack(sub, TARGET_FIELD, [str(t) for t in targets])
            if PREFIX_TARGETS in sub.keys():  # the prompt's n draws: this single-session row reads its own
                tu.assign_non_tensor_stack(sub, PREFIX_TARGETS, [[str(t)] for t in targets])
        tu.assign_non_tensor_data(sub, "__rollout_n__", 1)
        tu.assign_non_tensor_data(sub, "global_steps", int(self.trainer.global_steps))
        self.manager.generate_sequences(sub)
        keys, tags = self._wait(scratch)
        p, r = tag_lengths([tags[k] for k in keys])  # the rows' prompt and response lengths (agent_loop_tq.py 204)
        view = self._view(keys, torch.from_numpy(p), torch.from_numpy(r))
        if hasattr(self.trainer, "add_rollout_flops"):  # every row the pass generated, kept or not
            self.trainer.add_rollout_flops(p, r, r - view.batch["prefix_mask"].long().sum(-1).numpy())
        return view

    def _wait(self, scratch: list[str]) -> tuple[list[str], dict]:
        """Wait until every scratch group is terminal; return the row keys, one per scratch uid, in order, and the
        partition's tags."""
        pending = set(scratch)
        while True:
            tags = (tq.kv_list(PARTITION) or {}).get(PARTITION, {})
            pending = {u for u in pending if tags.get(u, {}).get("status") not in ("finished", "failure")}
            if not pending:
                break
            time.sleep(self.poll_s)
        by_uid: dict[str, list[str]] = {}
        for key in tags:
            by_uid.setdefault(key.split("_")[0], []).append(key)
        keys = []
        for u in scratch:
            rows = [k for k in by_uid.get(u, []) if k != u]
            if tags[u].get("status") == "failure" or len(rows) != 1:
                raise RuntimeError(
                    f"rollout policy {self.trainer.mix.rollout_policy!r} on V1: a generation pass's sample {u} ended "
                    f"with status {tags[u].get('status')!r} and {len(rows)} trajectories (one expected; an agent loop "
                    "with several outputs per sample cannot take part in a multi-pass rollout policy)"
                )
            keys.append(rows[0])
        return keys, tags

    def _view(self, keys: list[str], prompt_lens: torch.Tensor, response_lens: torch.Tensor):
        """The pass's rows as a DataProto a rollout policy reads: :data:`VIEW_TENSORS` right-padded to
        ``rollout.response_length`` (``prompts`` to ``data.max_prompt_length``; ``attention_mask`` over ``prompts``
        then ``responses``, unlike the legacy batch's left-padded prompts), the reward's extra keys and :data:`TQ_KEY`."""
        fields = ["rm_scores", "response_mask", "extra_fields", "prompts", "responses"]
        if self.trainer.config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
            fields.append("rollout_log_probs")
        data = tq.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=fields)
        extra = extra_fields(data.pop("extra_fields"))
        padded, rollout = data.to_padded_tensor(), self.trainer.config.actor_rollout_ref.rollout
        width = max(int(rollout.response_length), padded["response_mask"].shape[-1], padded["responses"].shape[-1])
        p_width = max(int(self.trainer.config.data.max_prompt_length), padded["prompts"].shape[-1])

        def pad(t, w=width):
            return torch.nn.functional.pad(t, (0, w - t.shape[-1]))

        response_mask = pad(padded["response_mask"])
        tensors = {"response_mask": response_mask, "token_level_scores": pad(padded["rm_scores"].float()),
                   "prefix_mask": prefix_mask_tensor([e.get("prefix_token_mask") for e in extra], response_mask),
                   "responses": pad(padded["responses"]), "prompts": pad(padded["prompts"], p_width),
                   "attention_mask": torch.cat([torch.arange(p_width)[None] < prompt_lens[:, None],
                                                torch.arange(width)[None] < response_lens[:, None]], dim=-1).long()}
        if "rollout_log_probs" in padded.keys():
            tensors["rollout_log_probs"] = pad(padded["rollout_log_probs"].float())
        non_tensor = {TQ_KEY: np.asarray(keys, dtype=object),
                      "prefix_ratio": np.asarray([float(e.get("prefix_ratio", 0.0) or 0.0) for e in extra])}  # fmt: skip
        infos = [e.get("reward_extra_info", {}) or {} for e in extra]
        non_tensor.update({key: np.asarray([i[key] for i in infos]) for key in set().union(*infos)
                           if all(key in i for i in infos)})  # the reward's extra keys every row has
        return DataProto(batch=TensorDict(tensors, batch_size=[len(keys)]), non_tensor_batch=non_tensor)

    # ---- the chosen rows become the groups' rows -----------------------------------------------------------
    def _commit(self, out, uids: list[str]) -> None:
        n = self.trainer.n
        if TQ_KEY not in out.non_tensor_batch or any(k is None for k in out.non_tensor_batch[TQ_KEY]):
            raise ValueError(f"rollout policy {self.trainer.mix.rollout_policy!r} returned rows that no ctx.generate "
                             "call produced (on V1 every returned row must come from a generation pass)")  # fmt: skip
        src = [str(k) for k in out.non_tensor_batch[TQ_KEY]]
        tags_all = (tq.kv_list(PARTITION) or {}).get(PARTITION, {})
        data = tq.kv_batch_get(keys=src, partition_id=PARTITION)
        rows = len(src)
        group = [uids[r // n] for r in range(rows)]
        tu.assign_non_tensor_stack(data, "uid", group)
        tu.assign_non_tensor_stack(data, "session_id", [r % n for r in range(rows)])
        keys = [f"{group[r]}_{r % n}_0" for r in range(rows)]
        tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=data, tags=[dict(tags_all[k]) for k in src])
        added = self._added_fields(out, [int(tags_all[k]["response_len"]) for k in src])
        if added is not None:  # before the groups are marked finished: the replay buffer samples them with these
            tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=added)
        tq.kv_batch_put(keys=list(uids), partition_id=PARTITION, tags=[{"status": "finished"} for _ in uids])

    def _added_fields(self, out, response_lens: list[int]):
        """The per-row tensors the policy added to its rows (e.g. HPT's ``sft_row`` (rows,), ExGRPO's
        ``behaviour_log_prob`` (rows, L)) as TransferQueue fields for the worker loss: (rows,) as is, (rows, L)
        nested like ``response_mask``; None when the policy added none."""
        width = out.batch["response_mask"].shape[-1]
        fields = {}
        for key in sorted(set(out.batch.keys()) - VIEW_TENSORS):
            value = out.batch[key]
            if value.dim() == 1:
                fields[key] = value
            elif value.dim() == 2 and value.shape[-1] == width:
                fields[key] = torch.nested.as_nested_tensor([value[i, :n] for i, n in enumerate(response_lens)],
                                                            layout=torch.jagged)  # fmt: skip
            else:
                raise ValueError(f"rollout policy {self.trainer.mix.rollout_policy!r} added the per-row tensor {key!r} "
                                 f"of shape {tuple(value.shape)}; on V1 a policy's own tensor is (rows,) or (rows, "
                                 f"{width}) over the response, as ctx.generate returns them")  # fmt: skip
        return TensorDict(fields, batch_size=[len(out)]) if fields else None

    def _clear_scratch(self) -> None:
        if not self._scratch:
            return
        scratch = set(self._scratch)
        tags = (tq.kv_list(PARTITION) or {}).get(PARTITION, {})
        keys = [k for k in tags if k.split("_")[0] in scratch]
        if keys:
            tq.kv_clear(keys=keys, partition_id=PARTITION)
        self._scratch = []


def _column(batch, key: str) -> list:
    """A per-prompt column of verl's prompt TensorDict as a list."""
    value = batch.get(key)
    return list(value.tolist()) if hasattr(value, "tolist") else list(value)
