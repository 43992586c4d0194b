"""The `mix:` section: schema, ranges, aliases and cross-section rules (no Ray, no training)."""

import pytest

import composed
from mix_src.config.mix_config import MixConfigError, mix_config_from_dict, validate_mix_config
from mix_src.extend import EntryConfigError, check_selected_entries


def compose_mix(*overrides):
    return composed.compose_mix(overrides)  # tests/composed.py: the YAML read once per session


def test_packaged_defaults_validate():
    cfg = compose_mix()
    mix = validate_mix_config(cfg)
    assert mix.n_prefix == 0 and mix.loss.off_policy_reshape == "p_div_p" and mix.loss.off_policy_reshape_gamma == 0.1
    assert cfg.data.custom_cls.name == "RLHFDatasetWithTarget"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "prefix_guided"
    assert cfg.trainer.use_v1 is False


def test_unknown_key_lists_valid_keys():
    with pytest.raises(MixConfigError) as err:
        validate_mix_config(compose_mix("+mix.loss.off_policy_reshap=p_div_p"))
    msg = str(err.value)
    assert "mix.loss.off_policy_reshap" in msg and "off_policy_reshape_gamma" in msg
    with pytest.raises(MixConfigError, match=r"unknown key.*mix\.nprefix.*valid keys of mix"):
        validate_mix_config(compose_mix("+mix.nprefix=1"))


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["mix.n_prefix=5", "actor_rollout_ref.rollout.n=4"], r"mix\.n_prefix=5 > actor_rollout_ref\.rollout\.n=4"),
        (["mix.n_prefix=-2"], r"mix\.n_prefix=-2 is out of range \[-1, inf\]"),
        (["mix.min_prefix_ratio=1.5"], r"mix\.min_prefix_ratio=1\.5 is out of range \[0\.0, 1\.0\]"),
        (["mix.min_prefix_ratio=0.8", "mix.max_prefix_ratio=0.5"], r"min_prefix_ratio=0\.8 > mix\.max_prefix_ratio=0\.5"),
        (["mix.prefix_strategy=linear_variance"], r"mix\.prefix_strategy='linear_variance' is not a registered prefix strategy; registered: random, linear"),
        (["mix.prefix_fix_ratios=[0.1,1.2]"], r"mix\.prefix_fix_ratios\[1\]=1\.2 is out of range \[0\.0, 1\.0\]"),
        (["mix.prefix_steps=0"], r"mix\.prefix_steps=0 is out of range \[1, inf\]"),
        (["mix.loss.off_policy_reshape=p_div_p_0.2"], r"mix\.loss\.off_policy_reshape='p_div_p_0\.2' is not a registered off-policy reshape; registered: no_reshape"),
        (["mix.loss.off_policy_reshape_gamma=0"], r"off_policy_reshape_gamma=0\.0 must be > 0"),
        (["mix.loss.off_max_clip=0.5", "mix.loss.off_min_clip=0.9"], r"off_min_clip=0\.9 > mix\.loss\.off_max_clip=0\.5"),
        (["mix.data.sample_target_ratio=2"], r"mix\.data\.sample_target_ratio=2\.0 is out of range"),
        (["mix.loss.loss_remove_clip=yes"], r"mix\.loss\.loss_remove_clip='yes' must be true or false"),
        (["mix.n_prefix=0.5"], r"mix\.n_prefix=0\.5 must be an integer"),
        (["mix.filter_groups.carry_over=true"], r"algorithm\.filter_groups\.enable=false"),
        (["mix.loss.use_adaptive_entropy=true", "actor_rollout_ref.actor.entropy_coeff=0"], r"entropy_coeff"),
    ],
)
def test_bad_values_name_key_and_range(overrides, pattern):
    with pytest.raises(MixConfigError, match=pattern):
        validate_mix_config(compose_mix(*overrides))


def test_luffy_reshape_aliases_become_gamma():
    for alias, gamma in (("p_div_p_0.1", 0.1), ("p_div_p_0.3", 0.3), ("p_div_p_0.5", 0.5)):
        mix = mix_config_from_dict({"loss": {"off_policy_reshape": alias}})
        assert (mix.loss.off_policy_reshape, mix.loss.off_policy_reshape_gamma) == ("p_div_p", gamma)


def test_minus_one_switches_clips_off_like_luffy():
    mix = mix_config_from_dict({"loss": {"off_max_clip": -1, "all_max_clip": -1, "off_min_clip": 0.1}})
    assert mix.loss.off_max_clip is None and mix.loss.all_max_clip is None and mix.loss.off_min_clip == 0.1


def test_fixed_ratio_count_must_match_prefixed_rows():
    """The fixed strategy's entry check (mix_src/algo/prefix.py _check_fixed), not a name special case in mix_config."""
    cfg = compose_mix("mix.n_prefix=2", "actor_rollout_ref.rollout.n=4", "mix.prefix_strategy=fixed",
                      "mix.prefix_fix_ratios=[0.2,0.5,0.8]")  # fmt: skip
    validate_mix_config(cfg)
    with pytest.raises(EntryConfigError, match=r"3 ratios; give 1 or one per prefixed row \(2"):
        check_selected_entries(cfg)
    with pytest.raises(EntryConfigError, match=r"needs mix\.prefix_fix_ratios"):
        check_selected_entries(compose_mix("mix.prefix_strategy=fixed"))
    ok = compose_mix("mix.n_prefix=2", "actor_rollout_ref.rollout.n=4", "mix.prefix_strategy=fixed",
                     "mix.prefix_fix_ratios=[0.2,0.5]")  # fmt: skip
    check_selected_entries(ok)
    assert validate_mix_config(ok).prefix_fix_ratios == [0.2, 0.5]


def test_yaml_mix_section_equals_the_dataclass_defaults():
    """One source of defaults: every key of mix_ppo_trainer.yaml's `mix:` section exists in MixConfig with the
    same default, and every MixConfig field is in the YAML (so `mix.loss.x=...` works without a `+`)."""
    import dataclasses

    import yaml
    from importlib.resources import files

    from mix_src.config.mix_config import MixConfig

    with open(files("mix_src.config") / "mix_ppo_trainer.yaml") as f:
        yaml_mix = yaml.safe_load(f)["mix"]
    assert yaml_mix == dataclasses.asdict(MixConfig())
    cfg = compose_mix("mix.loss.adaptive_entropy_fixed=true", "actor_rollout_ref.actor.entropy_coeff=0.001")
    assert validate_mix_config(cfg).loss.adaptive_entropy_fixed is True


def test_all_max_clip_token_mean_refuses_shuffled_mini_batches():
    ok = compose_mix("mix.loss.all_max_clip=0.9")
    validate_mix_config(ok)
    with pytest.raises(MixConfigError, match="actor_rollout_ref.actor.shuffle=false"):
        validate_mix_config(compose_mix("mix.loss.all_max_clip=0.9", "actor_rollout_ref.actor.shuffle=true"))
    validate_mix_config(compose_mix("mix.loss.all_max_clip=0.9", "actor_rollout_ref.actor.shuffle=true",
                                    "mix.loss.loss_agg_mode=luffy-token-sum-norm"))  # a fixed W needs no count
