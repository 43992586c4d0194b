"""ExGRPO (Experiential GRPO), as a mix_src plugin: replay the model's own past successful trajectories.

Paper: Zhan et al., "ExGRPO: Learning to Reason from Experience" (arXiv 2510.02245).
Official code: github.com/ElliottYan/LUFFY, ``ExGRPO/exgrpo/verl/verl/mix_src/`` at commit 01f4ae0:
``mix_trainer_experience.py`` (fit), ``experience/experience_trainer_ops.py`` (collection, recorded
old log-probs), ``experience/experience_collate_fn.py`` + ``experience_helpers.py`` (mixing, trajectory
choice), ``experience/weighted_bucket_sampler.py`` (bucket weights), ``mix_core_alg.py`` (loss);
defaults from ``ExGRPO/exp_scripts/run_exgrpo.sh``.

Per generation batch (P prompts x n samples), rollout policy ``exgrpo``:

1. while not "mixed" (before the batch solve rate first exceeds ``start_solved_ratio``, official 0.35): all
   rows on-policy (GRPO) with the PPO clip (the rows carry ``mix_loss_remove_clip`` = 0; once mixed it is
   ``mix.loss.loss_remove_clip``, official: meta_info["loss_remove_clip"]), nothing recorded;
2. when mixed and the buffer holds prompts: ``n_exp = min(int(P * experience_ratio), #prompts in buffer)``
   prompts are drawn from the buffer's buckets (bucket k = the prompt's latest solved count; weight
   N(k; n/2, 1), "normal"), without replacement inside a bucket; for each, the stored trajectory of lowest
   mean token entropy under the current actor is chosen (``trajectory_metric=entropy``: one extra ratio-1.0
   generate pass over the candidates, scored by ``ctx.entropy``, verl's old-log-prob pass; or
   ``recorded_nll``), and the prompt's group = that trajectory (row 0, an off-policy row whose
   tokens are all ``prefix_mask``) + n-1 fresh samples. These groups replace the batch's last n_exp groups
   (the official collate function keeps the first P - n_exp prompts of the batch, too);
3. when mixed, every group with 0 < k <= rbound (official 0 < k <= 7 of 8) records its solved on-policy
   samples (token ids, the rollout's log-probs = the behaviour policy's, mean token NLL), deduplicated,
   and moves its prompt to bucket k; a group solved n/n is retired (removed, never recorded again), on
   warm-up steps too; with ``retire_from_data`` (official) it also leaves the training data at the next epoch start
   (``mix_src.trainer.stages.start_data_epoch``, run by both trainers: :data:`mix_src.trainer.stages.DATA_DROP` in ``ctx.state``).

``skip_grad_bound`` (official 500): an optimiser step whose gradient norm before clipping exceeds it is skipped
(verl 0.9.1's ``FSDPEngine.optimizer_step`` wrapped in each process that loads this plugin, :func:`_patch_engine`).

The replayed rows carry their recorded log-probs in ``behaviour_log_prob``; with
``mix.loss.off_policy_behaviour=stored_log_prob`` the core loss shapes them as f(w) = w / (w + 0.1),
w = exp(l - l_recorded) (official ``exp_is_correct=True`` + ``off_policy_reshape=p_div_p_0.1``).

The buffer is this policy's ``ctx.state`` (kept by the trainer, saved in ``mix_state.pt`` with each
checkpoint and restored on resume). Settings: ``mix.plugin_options.exgrpo`` (:data:`SETTINGS`).
Load with ``mix.plugins=[recipes/exgrpo/exgrpo.py] mix.rollout_policy=exgrpo
mix.loss.off_policy_behaviour=stored_log_prob``. Every difference from the official code: README.md.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import uuid
from typing import Sequence

import numpy as np
import torch
from omegaconf import OmegaConf, open_dict

from mix_src.worker.loss import REMOVE_CLIP
from mix_src.algo.off_policy_behaviour import BEHAVIOUR_LOG_PROB
from mix_src.extend import EntryConfigError, Setting, flag, integer, number, one_of, trainer_base
from mix_src.trainer.rollout_policy import ROLLOUT_POLICIES, RolloutContext, register_rollout_policy, solved
from mix_src.trainer.stages import DATA_DROP, prompt_data_key

NAME = "exgrpo"
WEIGHTINGS = ("linear", "normal", "sqrt", "linear_clip")
METRICS = ("entropy", "recorded_nll")
SETTINGS = {  # each checked by mix_src/extend.py resolve_settings; the rules across keys are _check's
    "experience_ratio": number(0.5, 0.0, 1.0),  # official trainer.experience_ratio=0.5
    "start_solved_ratio": Setting(0.35, lambda v: number(0).ok(v) and v < 1, "a number < 1 (the switch needs a batch "
                                  "solve rate above it; < 0 = mixed from the first step)"),  # official experience_start_sratio
    "bucket_weighting": one_of("normal", *WEIGHTINGS),  # official trainer.exp_bucket_manager=normal
    "lbound": integer(0, 0),  # official trainer.experience_lbound=0: record groups with lbound < k
    "rbound": integer(None, 1, nullable=True),  # official trainer.experience_rbound=7 (n=8): ... k <= rbound; None = n - 1
    "select_mode": one_of("argmin", "argmin", "argmax"),  # official trainer.exp_select_mode=argmin
    "trajectory_metric": one_of("entropy", *METRICS),  # official exp_metric=ent (under the current policy); or recorded_nll
    "skip_grad_bound": Setting(500.0, lambda v: number(0).ok(v) and v > 0, "a number > 0 (official 500)",
                               nullable=True),  # official actor.skip_grad_bound=500 (run_exgrpo.sh:99); null = every step
    "retire_from_data": flag(True),  # official: retired prompts leave the data at each epoch start (fit :245-250)
}
DATA_TOLERANCE = 20  # official BATCH_TOLERANCE (mix_trainer_experience.py:247): drop only while > batch + 20 are left
SKIP_GRAD_BOUND_ENV = "MIX_EXGRPO_SKIP_GRAD_BOUND"  # carries skip_grad_bound to the actor workers (set by _check)


def options(mix) -> dict:
    """The plugin's settings, ``mix.plugin_options.exgrpo`` over the defaults of :data:`SETTINGS`."""
    return ROLLOUT_POLICIES.settings(NAME, mix.plugin_options.get(NAME))


# ---- the method's maths (tested against the official code in tests/test_exgrpo.py) --------------------------
def bucket_weight(k: int, n_rollout: int, method: str) -> float:
    """Sampling weight of bucket k (k solved of n_rollout), official ``WeightedBucketSampler.__init__``."""
    if method == "linear":
        return k / n_rollout
    if method == "normal":  # N(k; n/2, sigma=1)
        return float(1 / np.sqrt(2 * np.pi) * np.exp(-((k - n_rollout / 2) ** 2) / 2))
    if method == "sqrt":
        return float(np.sqrt(k / n_rollout))
    if method == "linear_clip":
        return 0.5 if k > n_rollout / 2 else k / n_rollout
    raise ValueError(f"bucket_weighting={method!r} is not one of {WEIGHTINGS}")


def sample_from_buckets(buckets: dict, n: int, n_rollout: int, method: str,
                        np_rng: np.random.RandomState, py_rng: random.Random) -> list:
    """Draw n items from ``buckets`` ({k: [items]}), official ``WeightedBucketSampler.sample`` with its global
    ``np.random`` / ``random`` replaced by the given generators (same calls, same order: with generators seeded
    like the globals it returns the same items). Multinomial counts per bucket, overflow moved one by one to
    buckets with room (by the renormalised probabilities), then without replacement inside each bucket."""
    valid = {k: v for k, v in buckets.items() if len(v) > 0}
    weights = {k: bucket_weight(k, n_rollout, method) for k in valid}
    total = sum(weights.values())
    if total == 0:
        raise ValueError("All buckets are empty or have zero weight")
    probs = {k: w / total for k, w in weights.items()}
    names = list(valid)
    counts = np_rng.multinomial(n, [probs[k] for k in names])
    adjusted, excess = [], 0
    for i, c in enumerate(counts):
        size = len(valid[names[i]])
        adjusted.append(min(int(c), size))
        excess += max(int(c) - size, 0)
    while excess > 0:
        avail = [i for i, k in enumerate(names) if adjusted[i] < len(valid[k])]
        if not avail:
            break
        p = [probs[names[i]] for i in avail]
        p = [x / sum(p) for x in p]
        adjusted[np_rng.choice(avail, p=p)] += 1
        excess -= 1
    out = []
    for i, c in enumerate(adjusted):
        if c > 0:
            data = valid[names[i]]
            out.extend(data.copy() if c >= len(data) else py_rng.sample(data, c))
    return out


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-trajectory mean of a per-token metric over its tokens: (T, L), (T, L) bool -> (T,)."""
    m = mask.to(values.dtype)
    return (values * m).sum(-1) / m.sum(-1).clamp(min=1)


def mean_entropy(entropy: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each stored trajectory's metric for ``exp_metric=ent``: its mean token entropy over its *own* response
    tokens, (T, L), (T, L) -> (T,). The official ``calculate_metrics`` (experience_helpers.py:143-146) masks with
    ``~(responses[i % BATCH_SIZE] != pad)``: the padding positions of a row of the last micro-batch (a bug, listed
    in README.md); this is the intended mask ``responses[i] != pad``."""
    return token_mean(entropy, response_mask.bool())


def skip_step(grad_norm: float, bound) -> bool:
    """Skip the optimiser step: a non-finite norm (verl's own rule) or one above ``bound`` (None = no bound),
    official ``_optimizer_step`` (mix_actor.py:244-256): ``not isfinite(g) or g > skip_grad_bound``."""
    return not math.isfinite(grad_norm) or (bound is not None and grad_norm > float(bound))


def guarded_optimizer_step(original):
    """verl's ``FSDPEngine.optimizer_step`` (clip, step unless the norm is non-finite; returns the norm before
    clipping) with ExGRPO's bound: the optimiser's ``step`` is deferred until the norm is known, then taken
    unless :func:`skip_step`; a skipped step zeroes the gradients, as the official code does. Reads the bound
    from ``MIX_EXGRPO_SKIP_GRAD_BOUND`` (unset: verl's method unchanged)."""

    def optimizer_step(self):
        bound = os.environ.get(SKIP_GRAD_BOUND_ENV)
        if not bound:
            return original(self)
        opt, calls = self.optimizer, []
        own = opt.__dict__.get("step")  # torch's LR scheduler wraps step as an instance attribute: keep it
        opt.step = lambda *a, **k: calls.append((a, k))
        try:
            grad_norm = original(self)
        finally:
            if own is None:
                del opt.step
            else:
                opt.step = own
        if calls and not skip_step(float(grad_norm), float(bound)):
            opt.step(*calls[0][0], **calls[0][1])
        elif calls:
            print(f"WARN: exgrpo skip_grad_bound={bound}: grad_norm {float(grad_norm)} above it, step skipped")
            opt.zero_grad()
        return grad_norm

    optimizer_step._mix_exgrpo = True
    return optimizer_step


def _patch_engine(module) -> None:
    """verl 0.9.1 ``verl/workers/engine/fsdp/transformer_impl.py:788`` ``FSDPEngine.optimizer_step``."""
    if not getattr(module.FSDPEngine.optimizer_step, "_mix_exgrpo", False):
        module.FSDPEngine.optimizer_step = guarded_optimizer_step(module.FSDPEngine.optimizer_step)


def choose_trajectory(metrics: Sequence[float], select_mode: str = "argmin") -> int:
    """Index of the trajectory to replay, official ``select_best_experiences`` (argmin / argmax)."""
    if select_mode == "argmin":
        return int(np.argmin(metrics))
    if select_mode == "argmax":
        return int(np.argmax(metrics))
    raise ValueError(f"Invalid exp_select_mode: {select_mode}")


# ---- the buffer ---------------------------------------------------------------------------------------------
def _buffer(ctx: RolloutContext) -> dict:
    """The policy's state: mixed flag, pool {key: {"record": 1-row DataProto, "trajs": [...]}}, bucket
    {key: k}, retired keys."""
    return ctx.state.setdefault(NAME, {"mixed": False, "pool": {}, "bucket": {}, "retired": set()})


def _prompt_key(rows, row: int) -> str:
    """A prompt's identity across steps: a hash of its token ids (the generated row's ``prompts`` tensor)."""
    ids = rows.batch["prompts"][row]
    mask = rows.batch["attention_mask"][row, : ids.shape[-1]].bool()
    return hashlib.sha1(ids[mask].numpy().astype(np.int64).tobytes()).hexdigest()


def _record(ctx: RolloutContext, buf: dict, out, keys: list, records_of, opts: dict) -> None:
    """Step 3 (official ``collect_experience_entries`` + ``cleanup_experience_buckets``)."""
    n = ctx.n
    ok = solved(out).reshape(-1, n)
    off = out.batch["prefix_mask"].any(-1).numpy().reshape(-1, n)
    rbound = n - 1 if opts["rbound"] is None else int(opts["rbound"])
    if "rollout_log_probs" not in out.batch.keys():
        raise KeyError("exgrpo records the rollout's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true")
    for g, key in enumerate(keys):
        k = int(ok[g].sum())
        if k == n:  # solved by every sample: retired (official skip_uid_set)
            if key not in buf["retired"]:  # (a prompt both drawn from the data and replayed is retired once)
                _retire_from_data(ctx, buf["pool"][key]["record"] if key in buf["pool"] else records_of(g), opts)
            buf["pool"].pop(key, None), buf["bucket"].pop(key, None)
            buf["retired"].add(key)
            continue
        if key in buf["retired"] or k > rbound or k <= int(opts["lbound"]):
            continue
        entry = buf["pool"].get(key)
        if entry is None:
            entry = buf["pool"][key] = {"record": records_of(g), "trajs": []}
        buf["bucket"][key] = k
        for j in range(n):
            r = g * n + j
            if not ok[g, j] or off[g, j]:
                continue
            m = out.batch["response_mask"][r].bool()
            ids = out.batch["responses"][r][m].clone()
            if any(torch.equal(ids, t["ids"]) for t in entry["trajs"]):
                continue
            lp = out.batch["rollout_log_probs"][r][m].float().clone()
            entry["trajs"].append({"ids": ids, "log_prob": lp, "metric": float(-lp.mean()) if len(lp) else 0.0})


def _choose(ctx: RolloutContext, entries: list, opts: dict) -> list:
    """The trajectory to replay for each drawn prompt (official ``select_best_experiences``). ``entropy``:
    :func:`mean_entropy` of each stored trajectory under the current actor (official ``calculate_metrics``,
    experience_helpers.py:100-146: an actor forward pass over the re-tokenised stored texts): one ratio-1.0
    ``generate`` pass turns the candidates into rows (the stored text as the whole response), ``ctx.entropy``
    scores them; a prompt with one trajectory needs no score. ``recorded_nll``: the NLL recorded at sampling."""
    mode = opts["select_mode"]
    if opts["trajectory_metric"] == "recorded_nll":
        return [e["trajs"][choose_trajectory([t["metric"] for t in e["trajs"]], mode)] for e in entries]
    cands = [(i, t) for i, e in enumerate(entries) if len(e["trajs"]) > 1 for t in e["trajs"]]
    metrics: dict = {}
    if cands:
        if ctx.entropy is None:
            raise RuntimeError(f"mix.plugin_options.{NAME}.trajectory_metric=entropy needs the actor's entropy "
                               "(RolloutContext.entropy), which this trainer base does not offer; use recorded_nll")
        from verl import DataProto

        recs = []
        for i, _ in cands:
            rec = entries[i]["record"][np.arange(1)]
            rec.non_tensor_batch["uid"] = np.array([f"exgrpo-{uuid.uuid4()}"], dtype=object)
            recs.append(rec)
        rows = ctx.generate(np.ones(len(cands)), targets=[_target_text(ctx.tokenizer, t["ids"]) for _, t in cands],
                            prompts=DataProto.concat(recs))
        ent = mean_entropy(ctx.entropy(rows), rows.batch["response_mask"])
        print(f"[exgrpo] step {ctx.global_step}: scored {len(cands)} stored trajectories of "
              f"{len({i for i, _ in cands})} prompts by their entropy under the current actor")
        for (i, _), value in zip(cands, ent.tolist()):
            metrics.setdefault(i, []).append(value)
    return [e["trajs"][choose_trajectory(metrics[i], mode) if i in metrics else 0] for i, e in enumerate(entries)]


def _target_text(tokenizer, ids: torch.Tensor) -> str:
    """The stored ids as the target string the agent loop re-tokenises (it appends EOS itself)."""
    ids = ids.tolist()
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def _behaviour(rows, chosen: list) -> torch.Tensor:
    """(rows, L) recorded log-probs on each replayed row's prefix tokens (0 elsewhere, and on a row whose
    re-tokenised target differs from the recorded ids: then the loss weighs it like LUFFY, p_b = 1)."""
    pm = rows.batch["prefix_mask"].bool()
    beh = torch.zeros(pm.shape, dtype=torch.float32)
    for r, traj in chosen:
        ids = rows.batch["responses"][r][pm[r]]
        k = min(len(ids), len(traj["ids"]))
        if k and torch.equal(ids[:k], traj["ids"][:k]):
            pos = pm[r].nonzero().squeeze(-1)[:k]
            beh[r, pos] = traj["log_prob"][:k]
    return beh


def _concat(parts: list):
    from verl import DataProto

    keys = set().union(*(p.non_tensor_batch.keys() for p in parts))
    fixed = []
    for p in parts:
        nt = dict(p.non_tensor_batch)
        for k in keys - nt.keys():
            nt[k] = np.full(len(p), None, dtype=object)
        fixed.append(DataProto(batch=p.batch, non_tensor_batch=nt, meta_info=p.meta_info))
    return DataProto.concat(fixed)


def warmup_remove_clip(mixed: bool, loss_remove_clip: bool) -> bool:
    """The step's loss_remove_clip: mix.loss.loss_remove_clip once mixed, False (PPO clip) during the warm-up, as the
    official trainer sets ``batch.meta_info["loss_remove_clip"]`` (mix_trainer_experience.py:429-436)."""
    return bool(loss_remove_clip) if mixed else False


def _export_bound(config, bound) -> None:
    """skip_grad_bound to the actor workers: this process's environment (inherited by a local Ray cluster) and
    ``ray_kwargs.ray_init.runtime_env.env_vars`` (as mix_src/config/preflight.py ``export_plugins`` does)."""
    value = "" if bound is None else repr(float(bound))
    os.environ[SKIP_GRAD_BOUND_ENV] = value
    with open_dict(config):
        OmegaConf.update(config, f"ray_kwargs.ray_init.runtime_env.env_vars.{SKIP_GRAD_BOUND_ENV}", value,
                         force_add=True)


def _check(config) -> None:
    mix, n = config.mix, int(config.actor_rollout_ref.rollout.n)
    o = dict(mix.plugin_options[NAME])  # resolved (defaults filled in) by mix_src/extend.py resolve_settings
    p = f"mix.plugin_options.{NAME}"
    loop = OmegaConf.select(config, "actor_rollout_ref.rollout.agent.default_agent_loop", default=None)
    if loop == "prefix_guided_tool":
        raise EntryConfigError("mix.rollout_policy=exgrpo with actor_rollout_ref.rollout.agent.default_agent_loop="
                               "prefix_guided_tool: ExGRPO replays decoded single-turn samples as plain-text targets, "
                               "and the tool loop's targets are JSON episodes; use the prefix_guided agent loop")
    if o["trajectory_metric"] == "entropy" and trainer_base(config) == "v1":
        raise EntryConfigError(f"{p}.trajectory_metric=entropy scores the stored trajectories with the actor "
                               "(RolloutContext.entropy), which the V1 trainer base (trainer.use_v1=true) does not "
                               f"offer yet: set {p}.trajectory_metric=recorded_nll there")
    if o["retire_from_data"] and trainer_base(config) == "v1":
        raise EntryConfigError(f"{p}.retire_from_data=true drops retired prompts from the data by their chat messages "
                               "(raw_prompt), which the V1 trainer base (trainer.use_v1=true) does not show a rollout "
                               f"policy: set {p}.retire_from_data=false there (retired prompts then stay in the data)")
    rb = n - 1 if o["rbound"] is None else o["rbound"]
    if not o["lbound"] < rb <= n - 1:
        raise EntryConfigError(f"{p}: need integers 0 <= lbound < rbound <= rollout.n - 1 = {n - 1} (got lbound="
                               f"{o['lbound']!r}, rbound={o['rbound']!r})")
    bound = o["skip_grad_bound"]
    strategy = OmegaConf.select(config, "actor_rollout_ref.actor.strategy", default="fsdp")
    if bound is not None and strategy not in ("fsdp", "fsdp2"):
        raise EntryConfigError(f"{p}.skip_grad_bound={bound!r} wraps verl's FSDP engine's optimizer_step, and "
                               f"actor_rollout_ref.actor.strategy={strategy!r}: set skip_grad_bound=null")
    _export_bound(config, bound)
    if mix.loss.get("off_policy_behaviour") != "stored_log_prob":
        raise EntryConfigError(f"mix.rollout_policy={NAME!r} replays rows with recorded log-probs for "
                               f"mix.loss.off_policy_behaviour=stored_log_prob (got "
                               f"{mix.loss.get('off_policy_behaviour')!r}); set it")
    if not config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
        raise EntryConfigError(f"mix.rollout_policy={NAME!r} records the rollout's log-probs of each sample: set "
                               "actor_rollout_ref.rollout.calculate_log_probs=true")
    if n < 2:
        raise EntryConfigError(f"mix.rollout_policy={NAME!r} mixes a replayed row into a group of fresh samples: "
                               f"actor_rollout_ref.rollout.n={n} must be >= 2")


@register_rollout_policy(
    NAME,
    check=_check,
    settings=SETTINGS,
    reads=tuple(f"mix.plugin_options.{NAME}.{k}" for k in SETTINGS) + (
        "mix.loss.off_policy_behaviour", "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.rollout.calculate_log_probs"),
)  # fmt: skip
def exgrpo(ctx: RolloutContext):
    n, opts, buf = ctx.n, options(ctx.mix), _buffer(ctx)
    num_prompts = len(ctx.batch) // n
    if not buf["mixed"] and float(opts["start_solved_ratio"]) < 0:
        buf["mixed"] = True  # a negative ratio: mixed (recording) from the first step
    mixed = buf["mixed"]
    replay_keys: list = []
    if mixed and buf["pool"]:
        n_exp = min(len(buf["pool"]), int(num_prompts * float(opts["experience_ratio"])))
        if n_exp > 0:
            buckets: dict = {}
            for key in buf["pool"]:  # insertion order: as the official pool/bucket lists
                buckets.setdefault(buf["bucket"][key], []).append(key)
            seeds = ctx.rng.integers(0, 2**31 - 1, size=2)
            replay_keys = sample_from_buckets(buckets, n_exp, n, opts["bucket_weighting"],
                                              np.random.RandomState(int(seeds[0])), random.Random(int(seeds[1])))
    n_keep = num_prompts - len(replay_keys)
    parts, chosen = [], []
    if n_keep:
        parts.append(ctx.generate(np.zeros(n_keep * n), rows=np.arange(n_keep * n)))
    if replay_keys:
        picks = _choose(ctx, [buf["pool"][key] for key in replay_keys], opts)
        prompts, targets, ratios = [], [], []
        for j, key in enumerate(replay_keys):
            entry, traj = buf["pool"][key], picks[j]
            rec = entry["record"].repeat(repeat_times=n, interleave=True)
            rec.non_tensor_batch["uid"] = np.array([f"exgrpo-{uuid.uuid4()}"] * n, dtype=object)  # unique across gen batches
            prompts.append(rec)
            text = _target_text(ctx.tokenizer, traj["ids"])
            targets += [text] * n
            ratios += [1.0] + [0.0] * (n - 1)  # official n_prefix=1, prefix ratio 1.0: row 0 is the replay
            chosen.append((n_keep * n + j * n, traj))
        from verl import DataProto

        parts.append(ctx.generate(np.asarray(ratios), targets=targets, prompts=DataProto.concat(prompts)))
    out = _concat(parts) if len(parts) > 1 else parts[0]
    out.batch[BEHAVIOUR_LOG_PROB] = _behaviour(out, chosen)
    out.batch[REMOVE_CLIP] = torch.full((len(out),), float(warmup_remove_clip(mixed, ctx.mix.loss.loss_remove_clip)))
    if mixed:
        all_keys = [_prompt_key(out, g * n) for g in range(n_keep)] + list(replay_keys)
        records_of = lambda g: (ctx.records([g * n]) if g < n_keep else buf["pool"][all_keys[g]]["record"])  # noqa: E731
        _record(ctx, buf, out, all_keys, records_of, opts)
    else:
        _retire_solved(buf, out, [_prompt_key(out, g * n) for g in range(n_keep)], n)
        for g in np.flatnonzero(solved(out).reshape(-1, n).all(axis=1)):  # warm-up: every group is a batch prompt
            _retire_from_data(ctx, ctx.records([int(g) * n]), opts)
        if float(solved(out).mean()) > float(opts["start_solved_ratio"]):
            buf["mixed"] = True  # official: switch after the step whose batch/solved exceeds the ratio
    return out


def _retire_solved(buf: dict, out, keys: list, n: int) -> None:
    """Warm-up steps: a prompt solved n/n is retired as on mixed steps (official ``fit``
    mix_trainer_experience.py:370-388 runs on every step: ``skip_uid_set.add``)."""
    ok = solved(out).reshape(-1, n)
    for g, key in enumerate(keys):
        if ok[g].all():
            buf["retired"].add(key)


def _retire_from_data(ctx: RolloutContext, record, opts: dict) -> None:
    """The prompt of ``record`` (its ``ctx.records`` row) leaves the data from the next epoch start on (official
    ``skip_uid_set.add``, mix_trainer_experience.py:388, applied by ``set_skip_uid_set`` at :250; here
    mix_src.trainer.stages.start_data_epoch), while more than one generation batch + DATA_TOLERANCE prompts are left.
    Keyed by the prompt's chat messages (``raw_prompt``, verl's RLHFDataset field)."""
    if not opts["retire_from_data"]:
        return
    if "raw_prompt" not in record.non_tensor_batch:
        raise KeyError("exgrpo retire_from_data: the prompt record carries no 'raw_prompt' (verl's RLHFDataset "
                       "messages); set mix.plugin_options.exgrpo.retire_from_data=false")
    drop = ctx.state.setdefault(DATA_DROP, {"keys": set(), "min_left": 0})
    drop["keys"].add(prompt_data_key(record.non_tensor_batch["raw_prompt"][0]))
    drop["min_left"] = len(ctx.batch) // ctx.n + DATA_TOLERANCE


# verl 0.9.1's FSDP engine, wrapped in every process that loads this plugin (the actor workers among them); the
# wrapper is verl's method unchanged while MIX_EXGRPO_SKIP_GRAD_BOUND is empty or unset
from mix_src.cpu import after_import  # noqa: E402

after_import("verl.workers.engine.fsdp.transformer_impl", _patch_engine, written_for={"verl": "0.9.1"}, required_in=())
