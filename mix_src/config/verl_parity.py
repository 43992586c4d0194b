"""Which of verl's trainer settings the MIX trainer honours, and which it refuses before Ray starts.

:class:`mix_src.trainer.legacy.MIXRayPPOTrainer` replaces verl's ``RayPPOTrainer.fit`` (verl/trainer/ppo/
ray_trainer.py, verl 0.9.1) with its own loop, so every key that changes verl's fit is honoured there (read by its
full path, :func:`config_reads`, in the named MIX method) or refused here by name (:func:`check_verl_keys`, on the
driver). ``tests/test_verl_key_parity.py`` fails on any key or trainer call of verl's ``fit`` not listed below, so
after a verl upgrade it names what is new. This module imports no verl.
"""

from __future__ import annotations

import ast
import textwrap
from typing import Any, Callable, Optional

from mix_src.config.mix_config import MixConfigError

# Keys verl's fit reads -> the MIXRayPPOTrainer method(s) whose source reads them too (honoured).
HONOURED: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("trainer.project_name", "trainer.experiment_name", "trainer.logger", "trainer.val_before_train",
                     "trainer.val_only"), ("fit",)),
    **dict.fromkeys(("trainer.critic_warmup", "trainer.save_freq"), ("_update", "_end_of_data")),
    "trainer.total_epochs": ("_train_batches",),
    "trainer.balance_batch": ("_compute_log_probs",),
    "trainer.test_freq": ("_step", "_end_of_data"),
    "trainer.esi_redundant_time": ("_update",),
    "trainer.rollout_data_dir": ("_step",),
    "actor_rollout_ref.rollout.n": ("__init__",),
    "actor_rollout_ref.rollout.temperature": ("_generate",),
    # the entropy metric's aggregation
    **dict.fromkeys(("actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.loss_scale_factor"),
                    ("_compute_log_probs",)),
    "algorithm": ("_compute_advantages",),  # the whole section goes to verl's compute_advantage as `config`
    **{f"algorithm.{k}": ("_compute_advantages",) for k in ("adv_estimator", "gamma", "lam", "kl_penalty",
                                                            "use_kl_in_reward", "norm_adv_by_std_in_grpo")},
    "algorithm.rollout_correction": ("_apply_rollout_correction",),  # decoupled mode; see REFUSED
    "algorithm.gdpo_reward_keys": ("_add_step_metrics",),
}

# Keys verl's fit reads that the MIX trainer refuses for some values (see the checks below).
REFUSED_KEYS: dict[str, str] = {
    "global_profiler.steps": "_refuse_profiler",
    "global_profiler.profile_continuous_steps": "_refuse_profiler",  # only read when steps are set
    # loss_mode (and the mode's own keys, e.g. dro_beta) picks the on-policy term's verl loss (mix_src/worker/onpolicy_losses.py)
    "actor_rollout_ref.actor.policy_loss": "_refuse_policy_loss_mode",
    "algorithm.rollout_correction.bypass_mode": "_refuse_bypass_mode",
}

# Calls verl's fit makes on the trainer: the MIX loop makes them too, or they belong to a refused key.
FIT_CALLS_REFUSED: dict[str, str] = dict.fromkeys(
    ("_start_profiling", "_stop_profiling", "llm_server_manager.start_profile", "llm_server_manager.stop_profile"),
    "global_profiler.steps")


# --------------------------------------------------------------------------- the scanner (used by the guard test)
_NOT_KEYS = frozenset({"get", "items", "keys", "values", "copy", "pop", "setdefault", "update"})


def config_reads(source: str) -> set[str]:
    """The config keys (full dotted paths) a function's source reads from ``self.config``.

    Sees ``self.config.a.b``, ``self.config.a.get("b")``, ``self.config.a["b"]``, and the same through a local
    variable (``x = self.config.a`` then ``x.b`` / ``x.get("b")`` / ``x["b"]``). Each read yields its longest
    path: ``self.config.a.b.c`` is ``a.b.c``; ``f(self.config.a)`` is ``a`` (the whole section is passed on).
    A local assigned a config section is not itself a read; its uses are."""
    tree = ast.parse(textwrap.dedent(source))
    aliases: dict[str, tuple[str, ...]] = {}

    def path(node: ast.AST) -> Optional[tuple[str, ...]]:
        if isinstance(node, ast.Attribute):
            if node.attr == "config" and isinstance(node.value, ast.Name) and node.value.id == "self":
                return ()
            base = path(node.value)
            return None if base is None or node.attr in _NOT_KEYS else (*base, node.attr)
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Subscript):  # x["b"]
            key, base = node.slice, path(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:  # x.get("b")
            key, base = node.args[0], path(node.func.value)
        else:
            return None
        string_key = isinstance(key, ast.Constant) and isinstance(key.value, str)
        return (*base, key.value) if base is not None and string_key else None

    def bindings(tree: ast.AST):
        """(local name, value node) of ``x = ...`` and ``x, y = ..., ...``."""
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Name):
                yield target.id, value
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                yield from ((t.id, v) for t, v in zip(target.elts, value.elts) if isinstance(t, ast.Name))

    # aliases first (a local re-bound to a config section keeps the last section)
    for name, value in bindings(tree):
        p = path(value)
        if p:
            aliases[name] = p
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}

    def extended(node: ast.AST) -> bool:
        """Whether ``node``'s read continues in its parent (``.b``, ``["b"]``, ``.get("b")``)."""
        parent = parents.get(node)
        if not (isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node):
            return False
        grand = parents.get(parent)  # x.get("b"): the Attribute ``x.get`` is no key itself, its call is
        return path(parent) is not None or (isinstance(grand, ast.Call) and grand.func is parent
                                            and path(grand) is not None)

    used_as_section = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in aliases and extended(n)}
    alias_values = {id(value) for name, value in bindings(tree) if name in used_as_section}
    loads = (n for n in ast.walk(tree) if not isinstance(n, ast.Name) or isinstance(n.ctx, ast.Load))
    return {".".join(p) for n in loads if (p := path(n)) and id(n) not in alias_values and not extended(n)}


def dotted_get(config: Any, dotted: str, default: Any = None) -> Any:
    """The value at the dotted key ``dotted`` of a DictConfig, dict or object; ``default`` when a part is missing or
    the value is None (shared by the config checks and the planner)."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def _refuse_estimator(config: Any, mix: Any) -> Optional[str]:
    """verl's estimators whose inputs only verl's own fit makes."""
    return ("algorithm.adv_estimator=remax needs a greedy baseline rollout per prompt (verl's fit generates it with "
            "the sampled rollouts, ray_trainer.py `__do_sample__`); the MIX loop does not generate one. Use grpo, "
            "grpo_split, rloo, reinforce_plus_plus, or gae (with a critic)."
            ) if str(dotted_get(config, "algorithm.adv_estimator")) == "remax" else None


def _refuse_bypass_mode(config: Any, mix: Any) -> Optional[str]:
    return ("algorithm.rollout_correction.bypass_mode=true replaces old log-probs by rollout log-probs and the "
            "policy loss by actor.policy_loss; the MIX loss needs recomputed old log-probs (target tokens have "
            "no rollout log-prob). Set it to false: decoupled mode (rollout_is / rollout_rs) is supported."
            ) if dotted_get(config, "algorithm.rollout_correction.bypass_mode", False) else None


def _refuse_correction_without_logprobs(config: Any, mix: Any) -> Optional[str]:
    active = [k for k in ("rollout_is", "rollout_rs") if dotted_get(config, f"algorithm.rollout_correction.{k}")]
    if not active or dotted_get(config, "actor_rollout_ref.rollout.calculate_log_probs", False):
        return None
    return (f"algorithm.rollout_correction.{active[0]} is set but actor_rollout_ref.rollout.calculate_log_probs="
            "false: there are no rollout log-probs to correct with (verl would skip it silently). Set "
            "actor_rollout_ref.rollout.calculate_log_probs=true.")


def _refuse_profiler(config: Any, mix: Any) -> Optional[str]:
    steps = dotted_get(config, "global_profiler.steps")
    return (f"global_profiler.steps={list(steps)}: the MIX trainer's loop does not drive verl's profiler "
            "(ray_trainer.py _start_profiling / _stop_profiling); set global_profiler.steps=null.") if steps else None


def _refuse_policy_loss_mode(config: Any, mix: Any) -> Optional[str]:
    """Any registered verl policy loss is the on-policy term, unless the mode x mix.loss knob table
    (mix_src/worker/onpolicy_losses.py knob_refusals) refuses the pair (bypass_mode is refused there), the mode's entry
    declares a key the config leaves unusable (``required_refusals``: dro_beta), or verl's own loss function, called
    once here on a tiny batch with this actor config, raises (any other value only the worker would have found)."""
    from mix_src.worker.onpolicy_losses import knob_refusals, mode_entry, required_refusals

    mode = dotted_get(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    actor = config.actor_rollout_ref.actor
    if mix is None:
        from mix_src.config.mix_config import validate_mix_config

        mix = validate_mix_config(config)
    try:
        refusals = [] if mode == "vanilla" else knob_refusals(mode, mix.loss, actor)
    except ValueError as e:  # a name verl does not know
        return str(e)
    refusals = refusals or required_refusals(mode, actor)
    if refusals or mode_entry(mode).luffy_kernel:
        return "; ".join(refusals) or None
    return _loss_call_refusal(mode, actor)


def _tiny_inputs() -> tuple:
    import torch

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 3, generator=g)
    return old, old + 0.1 * torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g), torch.ones(2, 3)


def _loss_call_refusal(mode: str, actor: Any) -> Optional[str]:
    """verl's ``mode`` loss called once on 2x3 tokens with the run's actor config (as verl's worker builds it:
    ``omega_conf_to_dataclass``; a micro-batch size is filled in where none is set, since that is checked elsewhere)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    section = OmegaConf.create(OmegaConf.to_container(actor, resolve=True))
    if section.get("ppo_micro_batch_size") is None and section.get("ppo_micro_batch_size_per_gpu") is None:
        section.ppo_micro_batch_size_per_gpu = 1
    old, log_prob, adv, mask = _tiny_inputs()
    try:
        actor_config = omega_conf_to_dataclass(section)
        get_policy_loss_fn(mode)(old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask,
                                 loss_agg_mode=actor_config.loss_agg_mode, config=actor_config, rollout_is_weights=None)
    except Exception as e:  # noqa: BLE001 - any failure of verl's loss is the refusal's reason
        return (f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r} fails with this actor config before "
                f"training (verl's loss function, called once here): {type(e).__name__}: {e}. Set the key it names "
                "under actor_rollout_ref.actor.policy_loss (or actor_rollout_ref.actor).")
    return None


def _refuse_rollout_correction_settings(config: Any, mix: Any) -> Optional[str]:
    """verl's rollout correction called once on 2x3 tokens with the run's ``algorithm.rollout_correction`` (what its
    ``compute_rollout_correction_and_add_to_batch`` passes on): e.g. a ``rollout_rs`` mode with verl's default
    ``rollout_rs_threshold: null`` raises there only at the first step."""
    rc = dotted_get(config, "algorithm.rollout_correction")
    if not rc or not (rc.get("rollout_is") or rc.get("rollout_rs")):
        return None
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    old, rollout, _, mask = _tiny_inputs()
    keys = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")
    try:
        compute_rollout_correction_and_rejection_mask(old, rollout, mask, **{k: rc.get(k) for k in keys if k in rc})
    except Exception as e:  # noqa: BLE001
        set_ = " ".join(f"algorithm.rollout_correction.{k}={rc.get(k)!r}" for k in ("rollout_is", "rollout_rs")
                        if rc.get(k))  # fmt: skip
        return (f"{set_} fails before training (verl's "
                f"compute_rollout_correction_and_rejection_mask, called once here): {type(e).__name__}: {e}. Set the "
                "algorithm.rollout_correction key it names (e.g. rollout_rs_threshold).")
    return None


def _refuse_sglang(config: Any, mix: Any) -> Optional[str]:
    return ("actor_rollout_ref.rollout.name=sglang: verl[sglang]==0.9.1 pins sglang==0.5.12, which requires "
            "transformers==5.6.0, a version verl 0.9.1 itself excludes (transformers!=5.6.0), so SGLang and this verl "
            "cannot be installed in one environment. Use actor_rollout_ref.rollout.name=vllm (`make install-gpu`)."
            ) if dotted_get(config, "actor_rollout_ref.rollout.name") == "sglang" else None


def _refuse_layered_summon_base_sync(config: Any, mix: Any) -> Optional[str]:
    """LoRA adapter sync with ``rollout.layered_summon`` and a dummy-loaded rollout: verl's first weight sync sends
    the base model (``verl/workers/engine_workers.py`` 793-801, ``base_sync_done`` starts False when
    ``"dummy" in load_format``, 673), and ``collect_lora_params`` refuses that under layered summon
    (``verl/utils/fsdp_utils.py`` 725-730) -- a crash at the first sync, after Ray and every worker started."""
    lora = any((dotted_get(config, f"actor_rollout_ref.model.{k}", 0) or 0) > 0 for k in ("lora_rank", "lora.rank"))
    merge = dotted_get(config, "actor_rollout_ref.model.lora.merge", False)
    load_format = str(dotted_get(config, "actor_rollout_ref.rollout.load_format", "dummy"))
    if lora and not merge and dotted_get(config, "actor_rollout_ref.rollout.layered_summon", False) and "dummy" in load_format:
        return ("actor_rollout_ref.rollout.layered_summon=true with "
                f"actor_rollout_ref.rollout.load_format={load_format}: verl's first LoRA weight sync must send the "
                "base model, which layered summon cannot (verl/utils/fsdp_utils.py collect_lora_params: 'To use "
                "layered_summon, you must make sure base-model is preloaded'). Set "
                "actor_rollout_ref.rollout.load_format=safetensors, or layered_summon=false.")
    return None


# The checks, in order (each returns its refusal or None) -> a key=value that alone triggers it (for the guard test;
# None: it takes several keys)
CHECKS: dict[Callable[[Any, Any], Optional[str]], Optional[str]] = {
    _refuse_estimator: "algorithm.adv_estimator=remax",
    _refuse_bypass_mode: "algorithm.rollout_correction.bypass_mode=true",
    _refuse_correction_without_logprobs: None,
    _refuse_rollout_correction_settings: "algorithm.rollout_correction.rollout_rs=token_k1",
    _refuse_profiler: "global_profiler.steps=[1]",
    _refuse_policy_loss_mode: "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
    _refuse_sglang: "actor_rollout_ref.rollout.name=sglang",
    _refuse_layered_summon_base_sync: None,
}
REFUSED_SETTINGS = {setting: check for check, setting in CHECKS.items() if setting}


def check_verl_keys(config: Any, mix: Any = None) -> None:
    """Raise :class:`MixConfigError` naming the first verl setting the MIX trainer cannot honour."""
    for check in CHECKS:
        message = check(config, mix)
        if message:
            raise MixConfigError(message)
