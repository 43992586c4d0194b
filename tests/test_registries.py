"""Extension points: a prefix strategy, reshape, advantage estimator or group filter registered from outside
mix_src is used by the code that looks it up (the config check, the loss, the trainer's advantage stage,
the filter), and unknown names are refused with the registered names listed. No Ray."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto

import composed
from mix_src.algo import core_alg
from mix_src.trainer.adv_estimators import ADV_ESTIMATORS, register_adv_estimator
from mix_src.algo.core_alg import compute_token_on_off_policy_loss, register_off_policy_reshape, register_on_policy_reshape
from mix_src.algo.filter_groups import GroupStats, filter_groups, register_group_filter
from mix_src.config.mix_config import MixConfigError, mix_config_from_dict, validate_mix_config
from mix_src.trainer.legacy import MIXRayPPOTrainer
from mix_src.algo.prefix import PrefixDraw, compute_prefix_ratios, register_prefix_strategy
from mix_src.extend import Registry


def compose_mix(*overrides):
    return composed.compose_mix(overrides)  # tests/composed.py: the YAML read once per session


@register_prefix_strategy("test_half_then_quarter")
def _half_then_quarter(d: PrefixDraw) -> np.ndarray:
    return np.full(d.shape, 0.5 if d.global_step <= 2 else 0.25)


@register_off_policy_reshape("test_p_div_p_autograd")
def _p_div_p_autograd(log_prob, prob, params):
    return prob / (prob + params.gamma), None  # no derivative: autograd computes it


@register_on_policy_reshape("test_sqrt_autograd")
def _sqrt_autograd(log_ratio, log_prob, old_log_prob, params):
    return torch.exp(0.5 * log_ratio), None


@register_adv_estimator("test_prefix_rows_get_one")
def _prefix_rows_get_one(token_level_rewards, response_mask, index, prefix_mask, config):
    row = prefix_mask.any(-1).to(token_level_rewards.dtype)  # 1 for rows with a prefix, 0 otherwise
    adv = row[:, None] * response_mask
    return adv, adv


@register_group_filter("test_mean_in_open_unit")
def _mean_strictly_between(stats: GroupStats) -> np.ndarray:
    return (stats.mean > 0.25) & (stats.mean < 0.75)


def test_registered_prefix_strategy_is_used_and_validated():
    ratios = compute_prefix_ratios(2, 4, strategy="test_half_then_quarter", n_prefix=1, global_step=3,
                                   rng=np.random.default_rng(0))  # fmt: skip
    assert ratios.tolist() == [0.25, 0, 0, 0, 0.25, 0, 0, 0]
    assert mix_config_from_dict({"prefix_strategy": "test_half_then_quarter"}).prefix_strategy == "test_half_then_quarter"
    with pytest.raises(MixConfigError, match=r"mix\.prefix_strategy='nope'.*registered: random.*test_half_then_quarter"):
        mix_config_from_dict({"prefix_strategy": "nope"})


def _loss_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 5, generator=g) * 2
    lp = (old + 0.3 * torch.randn(6, 5, generator=g)).clamp(max=-1e-3).requires_grad_()
    adv = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.2).float()
    prefix = torch.zeros(6, 5, dtype=torch.bool)
    prefix[:2, :3] = True
    return old, lp, adv, mask, prefix


@pytest.mark.parametrize(
    "plugin, builtin",
    [
        (dict(off_policy_reshape="test_p_div_p_autograd", off_policy_reshape_gamma=0.3),
         dict(off_policy_reshape="p_div_p", off_policy_reshape_gamma=0.3)),
        (dict(on_policy_reshape="test_sqrt_autograd", loss_remove_clip=True), dict(on_policy_reshape="square_root", loss_remove_clip=True)),
        (dict(on_policy_reshape="test_sqrt_autograd"), dict(on_policy_reshape="square_root")),
    ],
)  # fmt: skip
def test_registered_reshape_with_autograd_derivative_equals_builtin_closed_form(plugin, builtin):
    old, lp, adv, mask, prefix = _loss_batch()
    old = old.clone()
    old[3, 0] = lp[3, 0].detach() - 25.0  # a clamped log-ratio: autograd must block its gradient too
    out = {}
    for name, kw in (("plugin", plugin), ("builtin", builtin)):
        res = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, **kw)
        (grad,) = torch.autograd.grad(res["pg_loss"], lp)
        out[name] = (res, grad)
    torch.testing.assert_close(out["plugin"][1], out["builtin"][1])
    for key in out["builtin"][0]:
        torch.testing.assert_close(out["plugin"][0][key].detach(), out["builtin"][0][key].detach(), msg=key)


def test_unknown_reshape_lists_registered_names():
    with pytest.raises(MixConfigError, match=r"mix\.loss\.on_policy_reshape='nope'.*no_reshape.*test_sqrt_autograd"):
        mix_config_from_dict({"loss": {"on_policy_reshape": "nope"}})
    assert "test_p_div_p_autograd" in core_alg.OFF_POLICY_RESHAPES


def test_trainer_advantage_stage_calls_the_registered_estimator_with_prefix_mask():
    trainer = object.__new__(MIXRayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": {"adv_estimator": "test_prefix_rows_get_one", "use_kl_in_reward": False}})
    trainer.mix = mix_config_from_dict({})
    prefix = torch.zeros(4, 3, dtype=torch.bool)
    prefix[1, :2] = True
    batch = DataProto.from_dict(
        tensors={"token_level_scores": torch.zeros(4, 3), "response_mask": torch.ones(4, 3), "prefix_mask": prefix},
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )
    out = trainer._compute_advantages(batch, {}, {})
    assert out.batch["advantages"][:, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    validate_mix_config(compose_mix("algorithm.adv_estimator=test_prefix_rows_get_one"))
    with pytest.raises(MixConfigError, match=r"algorithm\.adv_estimator='nope'.*grpo_split.*test_prefix_rows_get_one"):
        validate_mix_config(compose_mix("algorithm.adv_estimator=nope"))
    assert "grpo_split" in ADV_ESTIMATORS


def test_registered_group_filter_decides_which_groups_stay():
    uids = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 4)
    acc = np.array([1, 1, 1, 0] + [1, 0, 1, 0] + [0, 0, 0, 0], dtype=float)
    assert filter_groups(uids, acc).kept_groups.tolist() == ["a", "b"]
    assert filter_groups(uids, acc, rule="test_mean_in_open_unit").kept_groups.tolist() == ["b"]
    with pytest.raises(MixConfigError, match=r"mix\.filter_groups\.rule='nope'.*nonzero_std.*test_mean_in_open_unit"):
        mix_config_from_dict({"filter_groups": {"rule": "nope"}})


def test_registry_refuses_a_second_function_under_one_name():
    def one():
        return 1

    def two():
        return 2

    reg = Registry("thing", "mix.thing")
    reg.register("x")(one)
    reg.register("x")(one)  # the same function again (a module imported twice) is fine
    with pytest.raises(ValueError, match="thing 'x' is already registered"):
        reg.register("x")(two)
    with pytest.raises(KeyError, match=r"mix\.thing='y' is not a registered thing; registered: x"):
        reg.get("y")


# ---------------------------------------------------------------- self-describing entries (mix_src.extend.Entry)
def test_entry_describes_itself_and_refuses_unsupported_base_before_ray():
    """An entry's bases / why_not / check / reads are stored; check_selected_entries refuses an unsupported
    base with the entry's own reason and runs the entry's check, naming the key — no caller names the entry."""
    from mix_src.extend import EntryConfigError, check_selected_entries

    def my_check(cfg):
        if cfg.mix.prefix_linear_max_ratio > 0.9:
            raise ValueError(f"mix.prefix_linear_max_ratio={cfg.mix.prefix_linear_max_ratio} must be <= 0.9 here")

    @register_prefix_strategy("test_legacy_only", bases=("legacy",), why_not={"v1": "needs the legacy loop"},
                              check=my_check, reads=("mix.prefix_linear_max_ratio",))  # fmt: skip
    def _legacy_only(d):
        return np.zeros(d.shape)

    from mix_src.algo.prefix import PREFIX_STRATEGIES

    entry = PREFIX_STRATEGIES.describe("test_legacy_only")
    assert entry.bases == ("legacy",) and entry.reads == ("mix.prefix_linear_max_ratio",) and entry.check is my_check
    cfg = compose_mix("mix.prefix_strategy=test_legacy_only", "mix.prefix_linear_max_ratio=0.5")
    check_selected_entries(cfg)  # legacy base, check passes
    cfg.trainer.use_v1 = True
    with pytest.raises(EntryConfigError, match=r"mix.prefix_strategy='test_legacy_only' is not supported on the 'v1'.*needs the legacy loop"):
        check_selected_entries(cfg)
    cfg.trainer.use_v1 = False
    cfg.mix.prefix_linear_max_ratio = 1.0
    with pytest.raises(EntryConfigError, match=r"mix.prefix_strategy='test_legacy_only': mix.prefix_linear_max_ratio=1.0"):
        check_selected_entries(cfg)


def test_entry_without_reason_for_a_missing_base_is_refused_at_registration():
    reg = Registry("test thing", "mix.test_thing")
    with pytest.raises(ValueError, match=r"does not support base\(s\) \['v1'\]: say why"):
        reg.register("x", bases=("legacy",))
    with pytest.raises(ValueError, match="unknown trainer base"):
        reg.register("y", bases=("legacy", "v2"))


def test_declared_setting_is_checked_once_and_reaches_the_entry(monkeypatch):
    """One settings channel (mix_src/extend.py resolve_settings): an entry declares its settings; the driver
    checks each value once, names the key as the user wrote it (mix.plugin_options.<entry>, or the registry's
    older spelling), and writes the full settings back, which the entry then reads. < 0.1 s."""
    from mix_src import extend as registry_module
    from mix_src.extend import EntryConfigError, Setting, check_selected_entries, flag

    reg = Registry("test pick", "mix.test_pick", old_settings={"k": "mix.old_k"})
    monkeypatch.setattr(registry_module, "_REGISTRIES", [reg])
    seen = []

    @reg.register("mine", settings={"k": Setting(3, lambda v: seen.append(v) or (isinstance(v, int) and v >= 1),
                                                 "an integer >= 1"), "on": flag(True)})  # fmt: skip
    def mine(settings):
        return settings

    def config(**mix):
        return OmegaConf.create({"trainer": {}, "mix": {"test_pick": "mine", **mix}})

    cfg = config(plugin_options={"mine": {"k": 5}})
    check_selected_entries(cfg)
    assert seen == [5]  # checked once
    assert reg.get("mine")(reg.settings("mine", cfg.mix.plugin_options.mine)) == {"k": 5, "on": True}
    assert cfg.mix.old_k == 5  # the older spelling carries the checked value too
    old = config(old_k=2)
    check_selected_entries(old)
    assert dict(old.mix.plugin_options.mine) == {"k": 2, "on": True}
    for mix, message in [
        ({"plugin_options": {"mine": {"k": 0}}}, r"mix\.plugin_options\.mine\.k=0 must be an integer >= 1"),
        ({"old_k": 0}, r"^mix\.old_k=0 must be an integer >= 1"),
        ({"plugin_options": {"mine": {"on": "yes"}}}, r"mix\.plugin_options\.mine\.on='yes' must be true or false"),
        ({"plugin_options": {"mine": {"x": 1}}}, r"unknown key\(s\) \['mix\.plugin_options\.mine\.x'\]; valid: \['k', 'on'\]"),
        ({"plugin_options": {"mine": {"k": 5}}, "old_k": 2}, "disagree; set it once, in mix.plugin_options.mine.k"),
    ]:  # fmt: skip
        with pytest.raises(EntryConfigError, match=message):
            check_selected_entries(config(**mix))
