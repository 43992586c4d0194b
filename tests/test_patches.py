"""CPU-backend patches fail loudly (mix_src.cpu): a patch written for another library version, a hook whose
module moved or that never fired, and a verl plugin that fails to import each stop the run with an error
naming them, instead of a silent fall-back (verl's own plugin loader logs such a failure at DEBUG only)."""

import logging
import os
import subprocess
import sys

import pytest

import mix_src.cpu as cpu
from mix_src.extend import PluginImportError, load_verl_plugins

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def patches(monkeypatch):
    """A private patch list for this test (the process's real patches stay as they are)."""
    monkeypatch.setattr(cpu, "PATCHES", [])
    return cpu.PATCHES


def _noop(mod):
    pass


def test_a_patch_written_for_another_verl_version_is_refused_naming_it(patches):
    with pytest.raises(cpu.PatchVersionError, match=r"test_patches\._noop was written for verl 0\.8\.0, but verl 0\.9\.1"):
        cpu.after_import("verl.utils.torch_functional", _noop, written_for={"verl": "0.8.0"})
    cpu.after_import("verl.utils.torch_functional", _noop, written_for={"verl": "0.9.1", "torch": ">=2.12"})
    assert patches and patches[-1].fired  # the right versions: applied (the module is imported already)


def test_a_hook_on_a_module_that_moved_is_refused_naming_it(patches):
    with pytest.raises(cpu.PatchTargetMissing, match=r"_noop hooks module 'verl\.utils\.no_such_module'"):
        cpu.after_import("verl.utils.no_such_module", _noop)


def test_a_hook_that_never_fired_stops_the_run_at_the_checkpoint(patches):
    """``install_loss`` is where both trainer bases pass once their workers are up."""
    from mix_src.worker.loss import install_loss

    sys.modules.pop("xml.dom.pulldom", None)
    cpu.after_import("xml.dom.pulldom", _noop, required_in=("trainer",))  # exists, not imported by now
    cpu.check_hooks_fired("worker")  # not required there

    class Workers:  # the one method install_loss calls on verl's worker group
        def set_loss_fn(self, loss):
            self.loss = loss

    with pytest.raises(cpu.HookNotFired, match=r"_noop on 'xml\.dom\.pulldom' \(never imported\)"):
        install_loss(Workers(), object())
    import xml.dom.pulldom  # noqa: F401

    assert patches[-1].fired
    cpu.check_hooks_fired("trainer")


def test_a_module_imported_past_its_hook_fails_at_every_checkpoint(patches):
    sys.modules.pop("xml.dom.xmlbuilder", None)
    cpu.after_import("xml.dom.xmlbuilder", _noop, required_in=())
    cpu._HOOKS.callbacks.pop("xml.dom.xmlbuilder")  # e.g. another finder loaded it first
    import xml.dom.xmlbuilder  # noqa: F401

    with pytest.raises(cpu.HookNotFired, match=r"imported without the hook running"):
        cpu.check_hooks_fired("worker")


def test_the_active_line_names_the_rollout(monkeypatch, caplog):
    monkeypatch.setenv(cpu.ROLLOUT_ENV, "vllm")
    with caplog.at_level(logging.INFO, logger="mix_src.cpu"):
        cpu.log_active()
    assert "CPU backend active" in caplog.text and "rollout 'vllm'" in caplog.text


def _fake_dist(root, name, version, entry_points=None):
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


def test_a_failing_verl_plugin_stops_the_driver_naming_it(tmp_path, monkeypatch):
    _fake_dist(tmp_path, "brokenplug", "0.1", "[verl.plugins]\nbroken = brokenplug_mod\n")
    (tmp_path / "brokenplug_mod.py").write_text("raise ImportError('no such backend here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginImportError, match=r"verl plugin 'broken' \(entry point 'brokenplug_mod'.*no such backend here"):
        load_verl_plugins()
    from mix_src.main_mix_ppo import export_plugins  # what the entry point runs first, before any config check
    from omegaconf import OmegaConf

    with pytest.raises(PluginImportError, match="'broken'"):
        export_plugins(OmegaConf.create({"mix": {}}))
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "mix_src_cpu")  # verl's policy: leave it out
    assert "broken" not in load_verl_plugins()


def test_a_worker_process_with_a_patch_for_another_verl_stops_at_import_verl(tmp_path):
    """What a Ray worker does first (``import verl`` with the entry point's VERL_USE_EXTERNAL_MODULES): here
    the installed verl claims 0.9.0, so the CPU backend's patches (written for 0.9.1) refuse to load, and
    the process stops with both names instead of running on without the backend."""
    _fake_dist(tmp_path, "verl", "0.9.0")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "VERL_PLATFORM": "cpu",
           "VERL_USE_EXTERNAL_MODULES": "mix_src.plugins"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", "import verl"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "PluginImportError: verl plugin 'mix_src_cpu'" in out.stderr, out.stderr[-3000:]
    assert "_patch_gloo was written for verl 0.9.1, but verl 0.9.0 is installed" in out.stderr
