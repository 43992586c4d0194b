"""recipes/prefix_rl trains 2 steps on both trainer bases (issue #55 item 4), as runs of the legacy and V1 batches
(tests/conftest.py ``legacy_batch``, ``v1_batch``): the recipe's own composed config supplies every ``mix.*`` and
``algorithm.*`` value and the actor's loss keys (:func:`recipe_overrides`); the tiny assets supply the sizes, the
CPU backend and a ``target_lst`` file (tests/test_target_lst_e2e.py ``_lst_file``: 3 demonstrations on even rows, 1
on odd ones); the reward is the response length's parity (the random tiny model earns it about half the time, so
advantages are non-zero and the continuation really updates).

These two runs are also CI's 2-step runs of a ``target_lst`` file on both bases (one shared draw per prompt); the
per-row distinct draws on both bases are tests/test_target_lst_e2e.py's opt-in runs. What the runs show: every group shares one prefix (``prefix_share_across_samples``: one demonstration per prompt, no
repeat counted), prefixes are used (``batch/prefix_token_frac > 0``), and no prefix token reaches the loss
(``actor/off_policy_prob == 0``: the worker saw no prefix token, tests/test_prefix_rl.py checks the count by hand)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import composed
from e2e import MIX_CPU, batch_result, batch_run, tiny_overrides
from test_target_lst_e2e import _lst_file

pytestmark = pytest.mark.ray

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "prefix_rl"
ACTOR_LOSS_KEYS = ("loss_agg_mode", "loss_scale_factor", "entropy_coeff", "clip_ratio_low", "clip_ratio_high",
                   "clip_ratio_c")  # fmt: skip
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    score = float(len(solution_str) % 2)
    return {"score": score, "acc": score}
"""


def _leaves(prefix: str, node) -> list[str]:
    if isinstance(node, dict) and node:
        return [o for k, v in node.items() for o in _leaves(f"{prefix}.{k}", v)]
    value = "null" if node is None else ("{}" if node == {} else node)
    if isinstance(value, bool):
        value = str(value).lower()
    if isinstance(value, list):
        value = "[" + ",".join(map(str, value)) + "]"
    return [f"{prefix}={value}"]


def recipe_overrides() -> list[str]:
    """The recipe's composed ``mix`` and ``algorithm`` sections and its actor loss keys, as Hydra overrides."""
    cfg = composed.compose("config", [], config_dir=RECIPE)
    OmegaConf.resolve(cfg)
    out = [o for key in ("mix", "algorithm") for o in _leaves(key, OmegaConf.to_container(cfg[key]))
           if o != "mix.plugins=[]"]  # a Ray-level key (tests/e2e.py RAY_LEVEL): given, it would restart the cluster
    actor = cfg.actor_rollout_ref.actor
    return out + [o for k in ACTOR_LOSS_KEYS for o in _leaves(f"actor_rollout_ref.actor.{k}", actor[k])]


def _run(assets: dict, batch_dir: Path, *extra: str) -> list[str]:
    reward = batch_dir / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    sizes = tiny_overrides(assets, steps=2, n=4, batch_size=4, response_length=24,
                           reward=[f"reward.custom_reward_function.path={reward}",
                                   "reward.custom_reward_function.name=compute_score"])  # fmt: skip
    return [*MIX_CPU, *sizes, *recipe_overrides(), "data.shuffle=false",
            f"data.train_files={_lst_file(assets, batch_dir / 'prefix_rl_lst.parquet')}", *extra]


def legacy_run(assets: dict, batch_dir: Path) -> list[str]:
    return _run(assets, batch_dir)


def v1_run(assets: dict, batch_dir: Path) -> list[str]:
    return _run(assets, batch_dir, "trainer.use_v1=true", "trainer.v1.trainer_mode=sync")


HERE = "test_prefix_rl_e2e.py::"
LEGACY = batch_run("legacy", "prefix_rl", legacy_run, [HERE + "test_prefix_rl_recipe_trains_two_steps_legacy"])
V1_RUN = batch_run("v1", "prefix_rl_v1", v1_run, [HERE + "test_prefix_rl_recipe_trains_two_steps_v1"])


def test_recipe_overrides_carry_the_setting():
    overrides = recipe_overrides()
    for want in ("mix.loss.prefix_tokens=context", "mix.n_prefix=-1", "mix.prefix_share_across_samples=true",
                 "mix.data.use_target_lst=true", "actor_rollout_ref.actor.loss_agg_mode=token-mean"):
        assert want in overrides, want


def _check(run) -> None:
    metrics = run.metrics
    assert [m["step"] for m in metrics] == [1, 2]
    assert any(m["batch/prefix_token_frac"] > 0 for m in metrics)
    for m in metrics:
        assert m["batch/target_lst_repeated_rows"] == 0 and m["batch/target_lst_mean_size"] == 2.0
        assert m["actor/off_policy_prob"] == 0  # no prefix token in the loss
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert key in m and math.isfinite(m[key]), (key, m.get(key))
    assert any(m["actor/grad_norm"] > 0 for m in metrics)


def test_prefix_rl_recipe_trains_two_steps_legacy(legacy_batch):
    _check(batch_result(legacy_batch, LEGACY))


def test_prefix_rl_recipe_trains_two_steps_v1(v1_batch):
    _check(batch_result(v1_batch, V1_RUN))
