"""mix.plugins: a plugin file outside mix_src registers a prefix strategy, a reshape and an advantage
estimator; the entry point loads it on the driver and exports it so every Ray process (the task runner,
the FSDP actor that computes the loss) imports it before looking anything up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import composed
from e2e import MIX_CPU, cpu_env, run_verl, tiny_overrides

PLUGIN = '''
import os

import torch

from mix_src.trainer.adv_estimators import grpo_split_estimator, register_adv_estimator
from mix_src.algo.core_alg import register_off_policy_reshape
from mix_src.algo.prefix import register_prefix_strategy

import numpy as np

MARKS = {marks!r}


def _mark(kind):
    with open(MARKS, "a") as f:
        f.write(f"{{kind}} {{os.getpid()}}\\n")


@register_prefix_strategy("plugin_full")
def full(draw):
    _mark("strategy")
    return np.full(draw.shape, 1.0)


@register_off_policy_reshape("plugin_sqrt")
def sqrt_p(log_prob, prob, params):
    _mark("reshape")
    return torch.exp(0.5 * log_prob), None  # derivative by autograd


@register_adv_estimator("plugin_split")
def split(token_level_rewards, response_mask, index, prefix_mask, config):
    _mark("estimator")
    return grpo_split_estimator(token_level_rewards, response_mask, index, prefix_mask, config)
'''


def write_plugin(folder, marks) -> str:
    path = os.path.join(folder, "my_plugin.py")
    with open(path, "w") as f:
        f.write(PLUGIN.format(marks=str(marks)))
    return path


def compose_mix(*overrides):
    return composed.compose_mix(overrides)  # tests/composed.py: the YAML read once per session


def test_config_stage_loads_a_plugin_by_relative_path_and_exports_it(tmp_path, monkeypatch):
    """In a fresh interpreter (no registration left over from other tests): the entry point's config
    stage imports the plugin, validates names it registered, and exports absolute paths for Ray."""
    write_plugin(tmp_path, tmp_path / "marks.txt")
    code = textwrap.dedent("""
        import os
        from hydra import compose, initialize_config_module
        from mix_src.main_mix_ppo import export_plugins
        from mix_src.config.mix_config import validate_mix_config
        with initialize_config_module(config_module="mix_src.config", version_base=None):
            cfg = compose(config_name="mix_ppo", overrides=["mix.plugins=[my_plugin.py]", "mix.n_prefix=1",
                          "mix.prefix_strategy=plugin_full", "mix.loss.off_policy_reshape=plugin_sqrt",
                          "algorithm.adv_estimator=plugin_split"])
        export_plugins(cfg)
        validate_mix_config(cfg)
        print("PLUGINS", cfg.mix.plugins[0])
        print("ENV", os.environ["MIX_PLUGINS"], os.environ["VERL_USE_EXTERNAL_MODULES"])
        print("RAY", dict(cfg.ray_kwargs.ray_init.runtime_env.env_vars))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=cpu_env())
    assert out.returncode == 0, out.stderr[-3000:]
    path = str(tmp_path / "my_plugin.py")
    assert f"PLUGINS {path}" in out.stdout
    assert f"ENV {path} mix_src.plugins" in out.stdout
    assert "'MIX_PLUGINS': '" + path in out.stdout and "'VERL_USE_EXTERNAL_MODULES': 'mix_src.plugins'" in out.stdout
    assert f"[mix_src] plugin loaded: {path}" in out.stdout


def test_worker_process_loads_plugins_at_import_verl(tmp_path):
    """What a Ray worker does: with the exported environment, `import verl` alone registers the plugin."""
    path = write_plugin(tmp_path, tmp_path / "marks.txt")
    code = "import verl\nfrom mix_src.algo.prefix import PREFIX_STRATEGIES\nprint('plugin_full' in PREFIX_STRATEGIES._entries)"
    env = cpu_env({"MIX_PLUGINS": path, "VERL_USE_EXTERNAL_MODULES": "mix_src.plugins"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_missing_plugin_is_a_clear_error(tmp_path):
    from mix_src.config.mix_config import mix_config_from_dict

    with pytest.raises(FileNotFoundError, match=r"mix\.plugins: plugin file 'nope/missing\.py' does not exist"):
        mix_config_from_dict({"plugins": ["nope/missing.py"]})
    with pytest.raises(ModuleNotFoundError, match=r"mix\.plugins: cannot import plugin module 'no_such_plugin_mod'"):
        mix_config_from_dict({"plugins": ["no_such_plugin_mod"]})


@pytest.mark.ray
def test_plugins_train_two_steps_with_guide_on_failure(tiny_assets, tmp_path):
    """Two plugin files in one run (one Ray start-up for two tests' worth): this file's plugin (a prefix strategy,
    an off-policy reshape and an advantage estimator) and recipes/guide_on_failure's rollout policy. The random
    tiny model fails every prompt, so every group gets k=1 guided row, its prefix from the plugin's strategy
    (the whole target)."""
    from test_guide_on_failure import PLUGIN as GUIDE_ON_FAILURE

    marks = tmp_path / "marks.txt"
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    path = write_plugin(plugin_dir, marks)
    overrides = MIX_CPU + tiny_overrides(tiny_assets, steps=2, n=4, batch_size=4, response_length=24) + [
        f"mix.plugins=[{path},{GUIDE_ON_FAILURE}]", "mix.n_prefix=1", "mix.prefix_strategy=plugin_full",
        "mix.loss.off_policy_reshape=plugin_sqrt", "algorithm.adv_estimator=plugin_split",
        "mix.rollout_policy=guide_on_failure", "mix.loss.loss_remove_clip=true",
    ]  # fmt: skip
    result = run_verl("mix_src.main_mix_ppo", overrides, tmp_path, timeout=420)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        if m["batch/on_solved"] == 0:  # all on-policy samples failed: one guided row per prompt, the whole target
            assert m["batch/off_policy_rows"] == 4 and m["batch/avg_prefix_ratio"] == pytest.approx(1 / 4)
        assert m["batch/off_solved"] in (0.0, 1.0) and m["actor/grad_norm"] >= 0
    assert any(m["batch/off_policy_rows"] > 0 and m["actor/grad_norm"] > 0 for m in result.metrics)
    lines = [line.split() for line in marks.read_text().splitlines()]
    pids = {kind: {pid for k, pid in lines if k == kind} for kind in ("strategy", "reshape", "estimator")}
    assert all(pids.values()), pids  # every extension was called ...
    assert pids["reshape"].isdisjoint(pids["strategy"])  # ... the reshape in the actor worker, not the trainer
