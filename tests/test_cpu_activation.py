"""When the CPU backend (mix_src.cpu, a verl plugin loaded in every process) switches itself on: asked for
(VERL_PLATFORM=cpu), or on a machine with no sign of an accelerator at all; never because one probe failed."""

import os
import subprocess
import sys

import pytest

import mix_src.cpu as cpu

CHECK = "import verl, mix_src.cpu as c; print('ACTIVE' if c.is_active() else 'INACTIVE', c.accelerator_signs())"


def _clean_env(monkeypatch, tmp_path):
    """A machine with no accelerator: no visibility variables, device nodes, smi tools, or torch device."""
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    for var in cpu.DEVICE_VISIBILITY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cpu, "DEVICE_NODE_GLOBS", (str(tmp_path / "dev" / "nvidia[0-9]*"),))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(cpu, "_torch_sees_accelerator", lambda: False)
    monkeypatch.setattr(cpu, "_accelerator_detected", lambda: False)


def test_no_accelerator_anywhere_selects_cpu(monkeypatch, tmp_path):
    _clean_env(monkeypatch, tmp_path)
    assert cpu.accelerator_signs() == [] and cpu.is_selected()


@pytest.mark.parametrize("sign", ["visible_devices_empty", "device_node", "smi_on_path", "torch"])
def test_any_sign_of_a_gpu_keeps_it_off_even_when_verls_probe_fails(monkeypatch, tmp_path, sign):
    """verl's probe (nvidia-smi) fails in a Ray actor whose PATH lacks nvidia-smi: that alone must not
    switch a GPU host's worker to the CPU backend."""
    _clean_env(monkeypatch, tmp_path)
    if sign == "visible_devices_empty":  # what Ray gives a GPU-less actor on a GPU host
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    elif sign == "device_node":
        (tmp_path / "dev").mkdir()
        (tmp_path / "dev" / "nvidia0").write_text("")
    elif sign == "smi_on_path":
        (tmp_path / "bin").mkdir()
        smi = tmp_path / "bin" / "nvidia-smi"
        smi.write_text("#!/bin/sh\nexit 1\n")
        smi.chmod(0o755)
    else:
        monkeypatch.setattr(cpu, "_torch_sees_accelerator", lambda: True)
    assert len(cpu.accelerator_signs()) == 1
    assert not cpu.is_selected()
    monkeypatch.setenv("VERL_PLATFORM", "cpu")  # asking for it still works on such a machine
    assert cpu.is_selected()


def _fresh(env_updates, drop=()):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_updates)
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_plugin_in_a_fresh_process_follows_the_rule():
    """verl/__init__.py imports the plugin: a GPU-less Ray actor of a GPU host (CUDA_VISIBLE_DEVICES='')
    stays off. (VERL_PLATFORM=cpu turning it on in fresh processes is what every `ray` test runs on.)"""
    assert _fresh({"CUDA_VISIBLE_DEVICES": ""}, drop=("VERL_PLATFORM",)).startswith("INACTIVE")
