"""Pass-rate control (arXiv 2605.05112), as a mix_src plugin: replayed prefixes steer each skewed group toward a 50 %
pass rate, the prefix length set per prompt by a controller (mix_src/algo/pass_rate_control.py).

Per generation batch (P prompts x n samples), rollout policy ``pass_rate_control``:

1. pass 1: all n samples of every prompt on-policy; each group's unaided pass rate p_before (``solved``);
2. a group below the band (p_before < band_low) with a demonstration gets a **head start**: its failed rows (the
   first k of them, k = ``mix.n_prefix``, -1 = all) are generated again from a prefix of the prompt's demonstration
   (:func:`demonstrations`) of ratio r_head(prompt); a group above the band (p_before > band_high), with
   ``failure_prefixes`` on and a stored failure of the prompt, gets a **handicap**: its solved rows (first k) are
   generated again from a prefix of that failure, ratio r_fail(prompt). The new rows replace the old ones (a group
   keeps n rows); groups inside the band are left as sampled;
3. each steered group's pass rate after (p_after, all n rows) is the controller's observation for its prompt and side
   (:func:`mix_src.algo.pass_rate_control.observe`); a prompt whose ratio is 0 is not regenerated and observes
   p_before;
4. with ``failure_prefixes``: each prompt's latest failed on-policy sample of pass 1 is stored (decoded) for later
   handicaps.

A prompt is keyed by its prompt token ids (both bases show them in a pass's rows). The state (ratios, recent rates,
visits, stored failures) is ``ctx.state["pass_rate_control"]``: saved in ``mix_state.pt`` with each checkpoint and
restored on resume. The replayed tokens carry ``prefix_mask``; the recipe masks them from the loss with
``mix.loss.prefix_tokens=context`` (out of the policy term, the token count, the entropy and the KL terms). An
alternative kept here, the prefix token selection ``replay_masked``, gives them advantage 0 but leaves them in the
token count and the entropy mean. Settings: ``mix.plugin_options.pass_rate_control`` (:data:`SETTINGS`).

Per-step metrics (``pass_rate_control/*``): ``pass_rate_before`` / ``pass_rate_after`` (mean over groups),
``informative_before`` / ``informative_after`` (share of groups with a pass rate in [0.25, 0.75]),
``head_start_groups`` / ``handicap_groups``, ``head_start_ratio`` / ``handicap_ratio`` (mean ratio of the steered
groups), ``guided_rows``, ``prefix_tokens`` (mean replayed tokens of a guided row), ``prompts_tracked``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from mix_src.algo.pass_rate_control import (HANDICAP, HEAD_START, ControlSettings, current_ratio, new_state, observe,
                                            side_for)  # fmt: skip
from mix_src.algo.prefix_select import register_prefix_token_select
from mix_src.extend import EntryConfigError, Setting, flag, number
from mix_src.trainer.dataset import TARGET_FIELD
from mix_src.trainer.self_guided import prompt_key as _prompt_key, response_text as _response_text
from mix_src.trainer.rollout_policy import (ROLLOUT_POLICIES, RolloutContext, register_rollout_policy, replace_rows,
                                            solved)  # fmt: skip

NAME = "pass_rate_control"
INFORMATIVE = (0.25, 0.75)  # the informative band for the metrics, whatever the controller's band
SETTINGS = {  # ControlSettings' fields (its checks across keys run in _check) + the failure side's switch
    "target": number(0.5, 0.0, 1.0),  # the paper's 50 %
    "band_low": number(0.25, 0.0, 1.0),  # steer a group whose unaided pass rate is below ...
    "band_high": number(0.75, 0.0, 1.0),  # ... or above the band
    "gain": Setting(0.5, lambda v: number(0).ok(v) and v > 0, "a number > 0"),  # ratio change per unit of error
    "init_ratio": number(0.5, 0.0, 1.0),  # a prompt's first ratio on a side
    "min_ratio": number(0.0, 0.0, 1.0),
    "max_ratio": number(1.0, 0.0, 1.0),
    "smoothing": Setting(0.0, lambda v: number(0).ok(v) and v < 1, "a number in [0, 1)"),  # EMA of the pass rate
    "pooled": flag(False),  # an unseen prompt starts from the seen prompts' mean ratio (ours; ControlSettings)
    "failure_prefixes": flag(False),  # handicaps from the model's own stored failures (the paper's other side)
}


def options(mix) -> dict:
    return ROLLOUT_POLICIES.settings(NAME, mix.plugin_options.get(NAME))


def control_settings(opts: dict) -> ControlSettings:
    return ControlSettings(**{k: bool(opts[k]) if k == "pooled" else float(opts[k])
                              for k in ControlSettings.__dataclass_fields__})


def demonstrations(ctx: RolloutContext, rows: np.ndarray) -> list:
    """The one place a head start's demonstration is drawn: the rows' ``target`` (a non-empty string, else None),
    read from ``ctx.records(rows)`` (the legacy base keeps the target with the generation inputs, not in
    ``ctx.batch``; V1 shows it in both). The several-demonstrations column (``target_lst``, issue #55) plugs in here:
    the legacy base writes each prefixed row's drawn demonstration into the row's ``target`` (the records), so a head
    start's rows take distinct demonstrations there; V1's records carry the prompt's ``target``."""
    source = ctx.batch if ctx.records is None else ctx.records(np.asarray(rows, dtype=np.int64))
    rows = np.arange(len(rows)) if ctx.records is not None else rows
    col = source.non_tensor_batch.get(TARGET_FIELD)
    if col is None:
        return [None] * len(rows)
    return [t if isinstance(t, str) and t else None for t in (col[int(r)] for r in rows)]


def _check(config) -> None:
    o, p = dict(config.mix.plugin_options[NAME]), f"mix.plugin_options.{NAME}"  # resolved by mix_src/extend.py
    try:
        control_settings(o)
    except ValueError as e:
        raise EntryConfigError(f"{p}: {e}") from e
    if int(config.mix.n_prefix) == 0:
        raise EntryConfigError(f"mix.rollout_policy={NAME!r} with mix.n_prefix=0 would steer no row: set mix.n_prefix "
                               "to the rows a steered group regenerates (-1 = every failed / solved row)")


@register_prefix_token_select("replay_masked", settings={"ratio": number(0.0, 0.0, 1.0)})  # the worker reads a ratio;
def replay_masked(view) -> torch.Tensor:  # this entry ignores it
    """The paper's masking of replayed tokens: no prefix token keeps its advantage (all get 0)."""
    return torch.zeros_like(view.prefix_mask, dtype=torch.bool)


@register_rollout_policy(NAME, check=_check, settings=SETTINGS,
                         reads=tuple(f"mix.plugin_options.{NAME}.{k}" for k in SETTINGS) + ("mix.n_prefix",))
def pass_rate_control(ctx: RolloutContext):
    n, opts = ctx.n, options(ctx.mix)
    s = control_settings(opts)
    state = ctx.state.setdefault(NAME, {**new_state(), "failures": {}})
    first = ctx.generate(np.zeros(len(ctx.batch)))  # pass 1: all on-policy
    ok = solved(first).reshape(-1, n)
    before = ok.mean(axis=1)
    keys = [_prompt_key(first, g * n) for g in range(len(before))]
    k = n if ctx.mix.n_prefix == -1 else int(ctx.mix.n_prefix)
    demos = demonstrations(ctx, np.arange(len(before)) * n)  # one per prompt (its first row)
    rows, ratios, targets, steered = [], [], [], []  # steered: (group, side, ratio)
    for g, key in enumerate(keys):
        side = side_for(float(before[g]), s)
        source = _source(side, demos[g], state["failures"].get(key), opts)
        if source is None:
            continue
        ratio = current_ratio(state, key, side, s)
        steered.append((g, side, ratio))
        if ratio <= 0:
            continue
        # a head start regenerates failed rows, a handicap solved ones: the group's other rows stay as sampled
        chosen = [g * n + j for j in range(n) if bool(ok[g, j]) == (side == HANDICAP)][:k]
        rows += chosen
        ratios += [ratio] * len(chosen)
        targets += [source] * len(chosen) if side == HANDICAP else [d or source for d in demonstrations(ctx, chosen)]
    out = first
    if rows:
        out = replace_rows(first, np.asarray(rows), ctx.generate(np.asarray(ratios), np.asarray(rows), targets=targets))
    after = solved(out).reshape(-1, n).mean(axis=1)
    for g, side, ratio in steered:
        observe(state, keys[g], side, float(after[g] if ratio > 0 else before[g]), s, ratio=ratio)
    if opts["failure_prefixes"]:
        _store_failures(ctx, state, first, ok, keys)
    ctx.metrics.update(_metrics(before, after, steered, out, rows, state))
    return out


def _source(side: Optional[str], demo: Optional[str], failure: Optional[str], opts: dict) -> Optional[str]:
    """The text a steered group's prefix comes from (None: the group is not steered)."""
    if side == HEAD_START:
        return demo
    if side == HANDICAP and opts["failure_prefixes"]:
        return failure
    return None


def _store_failures(ctx: RolloutContext, state: dict, first, ok: np.ndarray, keys: list) -> None:
    """Each prompt's latest failed on-policy sample (pass 1), decoded, for later handicaps."""
    if ctx.tokenizer is None:
        raise RuntimeError(f"mix.plugin_options.{NAME}.failure_prefixes=true decodes failed samples: the trainer gave "
                           "the rollout policy no tokenizer")
    n = ok.shape[1]
    for g, key in enumerate(keys):
        failed = np.flatnonzero(~ok[g])
        if failed.size:
            state["failures"][key] = _response_text(ctx.tokenizer, first, g * n + int(failed[-1]))


def _metrics(before: np.ndarray, after: np.ndarray, steered: list, out, rows: list, state: dict) -> dict:
    lo, hi = INFORMATIVE
    m = {f"{NAME}/pass_rate_before": float(before.mean()), f"{NAME}/pass_rate_after": float(after.mean()),
         f"{NAME}/informative_before": float(((before >= lo) & (before <= hi)).mean()),
         f"{NAME}/informative_after": float(((after >= lo) & (after <= hi)).mean()),
         f"{NAME}/guided_rows": len(rows),
         f"{NAME}/prompts_tracked": len(set(state[HEAD_START]) | set(state[HANDICAP]))}
    for side in (HEAD_START, HANDICAP):
        used = [r for _, sd, r in steered if sd == side]
        m[f"{NAME}/{side}_groups"] = len(used)
        if used:
            m[f"{NAME}/{side}_ratio"] = float(np.mean(used))
    if rows:
        m[f"{NAME}/prefix_tokens"] = float(out.batch["prefix_mask"][torch.as_tensor(rows)].sum(-1).float().mean())
    return m
