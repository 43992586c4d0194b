"""Old import paths of modules that moved in 0.2 (issue #38's layout), kept working for one release.

``import mix_src.mix_trainer`` (or ``pkg://mix_src.toy_addition``, a plugin's ``from mix_src.registry import
...``) imports the module at its new path once, binds the old name to the SAME module object (so registries,
pickled classes and monkeypatches see one module) and warns with a ``DeprecationWarning`` naming the new path.
Installed by ``mix_src/__init__.py``; remove after 0.2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {  # old -> new
    **{f"mix_src.{m}": f"mix_src.algo.{m}" for m in (
        "core_alg", "token_maths", "loss_terms", "prefix", "filter_groups", "prefix_select", "off_policy_behaviour",
        "row_loss", "loss_combine", "seeding", "flops")},
    **{f"mix_src.{m}": f"mix_src.rollout.{m}" for m in (
        "agent_loop", "agent_loop_tools", "agent_loop_worker", "environments")},
    **{f"mix_src.{m}": f"mix_src.worker.{m}" for m in ("loss", "loss_inputs", "onpolicy_losses")},
    **{f"mix_src.{m}": f"mix_src.trainer.{m}" for m in ("stages", "adv_estimators", "dataset", "failure", "rollout_policy", "rollout_policy_v1")},
    **{f"mix_src.{m}": f"mix_src.config.{m}" for m in ("mix_config", "luffy_keys", "model_context", "verl_parity")},
    "mix_src.mix_trainer": "mix_src.trainer.legacy",
    "mix_src.mix_trainer_v1": "mix_src.trainer.v1",
    "mix_src.registry": "mix_src.extend",
    "mix_src.toy_addition": "scripts.experiments.toy_tasks.addition",  # from the repository root
    "mix_src.toy_sort": "scripts.experiments.toy_tasks.sort",
    "mix_src.toy_calculator": "scripts.experiments.toy_tasks.calculator",
}  # fmt: skip


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; the old path works until mix_src 0.3",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._spec = module.__spec__  # the import system overwrites __spec__ below; exec_module puts it back
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finders: an old file left on disk never shadows the move
