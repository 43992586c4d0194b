"""Guard: every key verl 0.9.1's ``RayPPOTrainer.fit`` reads (``trainer.*``, ``algorithm.*``,
``actor_rollout_ref.*``, ``global_profiler.*``) is honoured by MIXRayPPOTrainer's own loop or refused
before Ray starts, naming the key. The lists live in ``mix_src/config/verl_parity.py``: after a verl upgrade
this test names each new key or call of verl's fit. No Ray."""

import inspect
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

import composed
from mix_src.config import verl_parity
from mix_src.config.mix_config import MixConfigError
from mix_src.trainer.legacy import MIXRayPPOTrainer

CALL_RE = re.compile(r"self\.(\w+(?:\.\w+)?)\(")


def compose_mix(*overrides):
    return composed.compose_mix(overrides)  # tests/composed.py: the YAML read once per session


def verl_fit_source() -> str:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    return inspect.getsource(RayPPOTrainer.fit)


def fit_keys() -> set[str]:
    return verl_parity.config_reads(verl_fit_source())


def test_the_scan_sees_verls_fit():
    keys = fit_keys()  # a few keys we know verl 0.9.1's fit reads, so an empty scan cannot pass
    assert {"trainer.save_freq", "trainer.rollout_data_dir", "algorithm.rollout_correction", "global_profiler.steps"} <= keys
    # read through locals: `actor_config = self.config.actor_rollout_ref.actor`, `rollout_corr_config.get(...)`
    assert {"actor_rollout_ref.actor.loss_agg_mode", "algorithm.rollout_correction.bypass_mode"} <= keys


def test_the_scan_sees_locals_get_and_subscripts():
    src = """
def f(self):
    a = self.config.trainer.save_freq
    c = self.config["trainer"]["test_freq"]
    section = self.config.actor_rollout_ref.actor
    d = section.loss_agg_mode + section["clip_ratio"]
    rc = self.config.algorithm.get("rollout_correction", None)
    e = rc.get("bypass_mode", False)
    g(self.config.data)
    for k, v in self.config.reward.items():
        pass
"""
    assert verl_parity.config_reads(src) == {
        "trainer.save_freq", "trainer.test_freq", "actor_rollout_ref.actor.loss_agg_mode",
        "actor_rollout_ref.actor.clip_ratio", "algorithm.rollout_correction.bypass_mode", "data", "reward",
    }  # fmt: skip


def test_every_key_verls_fit_reads_is_honoured_or_refused():
    listed = set(verl_parity.HONOURED) | set(verl_parity.REFUSED_KEYS)
    new = sorted(fit_keys() - listed)
    assert not new, (
        f"verl's RayPPOTrainer.fit reads {new}, which mix_src/config/verl_parity.py does not list: honour each in "
        "MIXRayPPOTrainer (HONOURED) or refuse its unsupported values before Ray starts (REFUSED_KEYS + a check)"
    )


def test_every_call_verls_fit_makes_is_made_by_the_mix_trainer_or_refused():
    # the trainer's own classes (its stages 1-3 live in mix_src/trainer/legacy_collect.py, a mixin)
    ours = "".join(inspect.getsource(c) for c in MIXRayPPOTrainer.__mro__ if c.__module__.startswith("mix_src."))
    calls = set(CALL_RE.findall(verl_fit_source()))
    missing = sorted(c for c in calls if f"self.{c}(" not in ours and c not in verl_parity.FIT_CALLS_REFUSED)
    assert not missing, f"verl's fit calls {missing}; MIXRayPPOTrainer neither makes these calls nor refuses their key"


def test_refused_keys_name_their_check():
    checks = {c.__name__ for c in verl_parity.CHECKS}
    assert set(verl_parity.REFUSED_KEYS.values()) <= checks
    assert {c.__name__ for c in verl_parity.REFUSED_SETTINGS.values()} <= checks


@pytest.mark.parametrize("key", sorted(verl_parity.HONOURED))
def test_honoured_key_is_read_by_the_named_mix_trainer_method(key):
    """By its full path (``rollout.n`` is not honoured by any ``n`` in the source)."""
    for name in verl_parity.HONOURED[key]:
        reads = verl_parity.config_reads(inspect.getsource(getattr(MIXRayPPOTrainer, name)))
        assert key in reads, f"{key}: not read in MIXRayPPOTrainer.{name} (it reads {sorted(reads)})"


def test_listed_keys_exist_in_the_composed_mix_config():
    """Walks the composed MIX config: a listed key that verl renamed or dropped fails here."""
    cfg = compose_mix()
    missing = object()
    listed = list(verl_parity.HONOURED) + list(verl_parity.REFUSED_KEYS)
    absent = [k for k in listed if OmegaConf.select(cfg, k, default=missing) is missing]
    optional = {"algorithm.gdpo_reward_keys"}  # read with .get(); verl's algorithm config has no default
    assert set(absent) <= optional, absent


def test_packaged_config_passes():
    verl_parity.check_verl_keys(compose_mix())


@pytest.mark.parametrize("setting", sorted(verl_parity.REFUSED_SETTINGS))
def test_refused_setting_is_refused_naming_the_key(setting):
    key = setting.split("=")[0]
    with pytest.raises(MixConfigError, match=re.escape(key)):
        verl_parity.check_verl_keys(compose_mix(setting))


def test_rollout_correction_needs_rollout_logprobs():
    cfg = compose_mix("algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false")
    with pytest.raises(MixConfigError, match="calculate_log_probs"):
        verl_parity.check_verl_keys(cfg)
    verl_parity.check_verl_keys(compose_mix("algorithm.rollout_correction.rollout_is=token"))  # n_prefix=0: honoured


def test_sglang_refusal_explains_the_conflict():
    with pytest.raises(MixConfigError, match=r"transformers==5\.6\.0.*excludes"):
        verl_parity.check_verl_keys(compose_mix("actor_rollout_ref.rollout.name=sglang"))


# ----------------------------------------------------------------------------------------------------
# the entry point: refusals run before Ray starts; no agent-loop path is fixed on the driver
def _entry_config(tmp_path, *overrides):
    import pandas as pd

    for name in ("train", "val"):
        pd.DataFrame({"prompt": [[{"role": "user", "content": "1+1"}]]}).to_parquet(tmp_path / f"{name}.parquet")
    (tmp_path / "model").mkdir(exist_ok=True)
    return compose_mix(f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/val.parquet",
                       f"actor_rollout_ref.model.path={tmp_path}/model", *overrides)  # fmt: skip


def test_run_refuses_before_ray_starts(tmp_path, monkeypatch):
    import ray

    import mix_src.main_mix_ppo as entry

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(MixConfigError, match="algorithm.adv_estimator=remax"):
        entry.run_mix_ppo(_entry_config(tmp_path, "algorithm.adv_estimator=remax"))


def test_agent_loop_config_path_is_not_fixed_on_the_driver(tmp_path):
    import mix_src.main_mix_ppo as entry

    cfg = _entry_config(tmp_path)
    entry.prepare_config(cfg)
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path is None


def test_agent_loop_worker_registers_prefix_guided_through_the_dataset_class():
    """What verl's AgentLoopWorker does first (get_dataset_class(config.data)) registers the loop, in a
    fresh process, with no config file path involved."""
    code = (
        "from hydra import compose, initialize_config_module\n"
        "from verl.utils.dataset.rl_dataset import get_dataset_class\n"
        "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry\n"
        "with initialize_config_module(config_module='mix_src.config', version_base=None):\n"
        "    cfg = compose(config_name='mix_ppo')\n"
        "assert 'prefix_guided' not in _agent_loop_registry\n"
        "get_dataset_class(cfg.data)\n"
        "print(_agent_loop_registry['prefix_guided'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mix_src.rollout.agent_loop.PrefixGuidedAgentLoop" in out.stdout


def test_backend_cpu_refused_when_the_cpu_backend_is_off(tmp_path, monkeypatch):
    import mix_src.cpu
    import mix_src.main_mix_ppo as entry

    monkeypatch.setattr(mix_src.cpu, "is_active", lambda: False)
    monkeypatch.setattr(mix_src.cpu, "accelerator_signs", lambda: ["torch sees an accelerator"])
    with pytest.raises(MixConfigError, match="trainer.device=cpu.*VERL_PLATFORM=cpu"):
        entry.prepare_config(_entry_config(tmp_path, "+backend=cpu"))


# ----------------------------------------------------------------------------------------------------
# the GPU install: `make install-gpu` pins exactly what verl 0.9.1 pins (no network; `make
# check-gpu-install` resolves them against PyPI)
def test_gpu_install_pins_are_verls_own():
    import os
    from importlib.metadata import requires

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    makefile = open(os.path.join(root, "Makefile")).read()
    pins = set(re.search(r"^GPU_PINS\s*:=(.*)$", makefile, re.M).group(1).split())
    flash = re.search(r"^FLASH_ATTN\s*:=(.*)$", makefile, re.M).group(1).strip()

    def extra(name):
        reqs = [r.split(";")[0].replace(" ", "") for r in requires("verl") if f'extra == "{name}"' in r]
        return {r for r in reqs if "==" in r and not r.startswith("verl")}

    assert pins == extra("vllm"), f"Makefile GPU_PINS {sorted(pins)} != verl[vllm] pins {sorted(extra('vllm'))}"
    assert {flash} == extra("flash-attn-cu130torch211")
    assert "--no-build-isolation $(FLASH_ATTN)" in makefile
    setup = open(os.path.join(root, "setup.py")).read()
    assert '"gpu": ["verl[vllm]==0.9.1"]' in setup  # flash-attn is never built by pip in isolation


def test_lora_layered_summon_needs_a_preloaded_base():
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.layered_summon=true"]
    with pytest.raises(MixConfigError, match=r"actor_rollout_ref\.rollout\.layered_summon=true with .*load_format=dummy"):
        verl_parity.check_verl_keys(compose_mix(*lora))
    verl_parity.check_verl_keys(compose_mix(*lora, "actor_rollout_ref.rollout.load_format=safetensors"))
    verl_parity.check_verl_keys(compose_mix(*lora, "++actor_rollout_ref.model.lora.merge=true"))
    verl_parity.check_verl_keys(compose_mix("actor_rollout_ref.rollout.layered_summon=true"))  # no LoRA
