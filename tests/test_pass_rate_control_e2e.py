"""recipes/pass_rate_control trains 2 steps on CPU on both trainer bases (its compare.yaml settings, the plugin loaded
from the recipe's folder, failure prefixes on so the stored-failure path runs too), each run in its base's shared
batch (tests/conftest.py legacy_batch / v1_batch; the plugin's runs share one Ray cluster there). The random tiny
model solves nothing: every group is below the band and gets a head start at the initial ratio 0.5, the controller
raises each prompt's ratio after its visit, and the state (ratios, failures) is in each step's mix_state.pt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from e2e import MIX_CPU, batch_result, batch_run, tiny_overrides
from mix_src.trainer.stages import MIX_STATE_FILE

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "pass_rate_control"
N, PROMPTS, NAME = 4, 4, "pass_rate_control"
BASES = {"legacy": [], "v1": ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync"]}
CKPT = "pass_rate_control_ckpt"


def compare_overrides() -> list[str]:
    spec = yaml.safe_load((RECIPE / "compare.yaml").read_text())
    return [f"mix.plugins=[{','.join(str(ROOT / p) for p in spec['plugins'])}]", *spec["overrides"]]


def recipe_run(base: str):
    def overrides(assets: dict, batch_dir: Path) -> list[str]:
        return [*MIX_CPU, *tiny_overrides(assets, steps=2, n=N, batch_size=PROMPTS, response_length=24),
                *compare_overrides(), f"+mix.plugin_options.{NAME}.failure_prefixes=true", *BASES[base],
                f"trainer.default_local_dir={batch_dir / f'{CKPT}_{base}'}", "trainer.save_freq=1"]  # fmt: skip

    return overrides


RUNS = {base: batch_run(base, f"{NAME}_{base}", recipe_run(base),
                        [f"test_pass_rate_control_e2e.py::test_recipe_trains_two_steps_{base}"]) for base in BASES}


def check_run(base: str, result) -> None:
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert m[f"{NAME}/pass_rate_before"] == 0.0  # the random tiny model solves nothing
        assert m[f"{NAME}/head_start_groups"] == PROMPTS and m[f"{NAME}/head_start_ratio"] == 0.5
        assert m[f"{NAME}/guided_rows"] == PROMPTS * N and m[f"{NAME}/prefix_tokens"] > 0
        assert 0.0 <= m[f"{NAME}/pass_rate_after"] <= 1.0 and 0.0 <= m[f"{NAME}/informative_after"] <= 1.0
        assert m["batch/off_policy_rows"] == PROMPTS * N  # every row replaced by a head-start row
        assert m["actor/off_policy_prob"] == 0  # prefix_tokens=context: no replayed token in the loss
        if base == "v1":
            assert m["rollout_policy/passes"] == 2 and m["rollout_policy/rows_generated"] == 2 * PROMPTS * N
    folder = Path(result.log_path).parent / f"{CKPT}_{base}" / "global_step_2"
    state = torch.load(folder / MIX_STATE_FILE, weights_only=False)["rollout_policy"][NAME]
    heads = state["head_start"]
    assert len(heads) == 2 * PROMPTS and not state["handicap"]  # 8 distinct prompts over 2 steps, one visit each
    assert all(e["visits"] == 1 and e["ratio"] == pytest.approx(0.5 + 0.5 * (0.5 - e["rate"])) for e in heads.values())
    assert len(state["failures"]) == 2 * PROMPTS and all(isinstance(t, str) for t in state["failures"].values())


@pytest.mark.ray
def test_recipe_trains_two_steps_legacy(legacy_batch):
    check_run("legacy", batch_result(legacy_batch, RUNS["legacy"]))


@pytest.mark.ray
def test_recipe_trains_two_steps_v1(v1_batch):
    check_run("v1", batch_result(v1_batch, RUNS["v1"]))
