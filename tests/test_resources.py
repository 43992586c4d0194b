"""The checkpoint directory checked before Ray (mix_src/config/resources.py, preflight slot 6), on the paper recipe
as run.sh composes it: bounded (500 steps, 2 kept), a line with the count and size of its checkpoints, and
refusals naming trainer.default_local_dir. No Ray, no model weights: a config.json with Qwen2.5-Math-7B's shape."""

import json
import os
import shutil
from collections import namedtuple

import pytest
from omegaconf import open_dict

from mix_src.config import resources
from mix_src.config.resources import check_checkpoint_dir, kept_at_once
from mix_src.config.mix_config import MixConfigError
from mix_src.planner import checkpoint_bytes, count_params
from mix_src.planner.presets import PRESETS
from test_recipes import compose_recipe

Usage = namedtuple("Usage", "total used free")
SEVEN_B = checkpoint_bytes(count_params(PRESETS["Qwen/Qwen2.5-Math-7B"]))


def _paper(tmp_path, ckpt_dir, *overrides):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(PRESETS["Qwen/Qwen2.5-Math-7B"]))
    cfg = compose_recipe("luffy_zero", list(overrides))
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = str(model)
        cfg.trainer.default_local_dir = str(ckpt_dir)
    return cfg


def test_paper_recipe_is_bounded_and_keeps_two():
    cfg = compose_recipe("luffy_zero")
    assert cfg.trainer.total_training_steps == 500 and cfg.trainer.save_freq == 50
    assert cfg.trainer.max_actor_ckpt_to_keep == 2
    assert cfg.trainer.default_local_dir != "checkpoints/verl_examples/gsm8k"


def test_startup_line_and_a_disk_that_holds_two_checkpoints(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "out" / "checkpoints"
    cfg = _paper(tmp_path, ckpt)
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda p: Usage(10**13, 0, 2 * SEVEN_B))
    plan = check_checkpoint_dir(cfg)
    assert ckpt.is_dir() and os.listdir(ckpt) == []  # created; the probe file is gone
    assert (plan["saves"], plan["kept"], plan["bytes_each"]) == (10, 2, SEVEN_B)  # steps 50, 100, ..., 500
    assert 90e9 < SEVEN_B < 93e9  # 7.6B params x 12 B: model + AdamW in fp32
    line = capsys.readouterr().out
    assert "[mix_src] checkpoints: 10 actor checkpoint(s) (save_freq 50 over 500 steps)" in line
    assert "at most 2 on disk at once" in line and f"needs {2 * SEVEN_B / 1e9:.1f} GB" in line


def test_a_disk_too_small_is_refused_naming_the_key(tmp_path, monkeypatch):
    cfg = _paper(tmp_path, tmp_path / "ckpt")
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda p: Usage(10**13, 0, 2 * SEVEN_B - 1))
    with pytest.raises(MixConfigError, match=r"trainer\.default_local_dir=.*ckpt: .* keeps 2 checkpoint\(s\)"):
        check_checkpoint_dir(cfg)
    # without the bound every one of verl's default 30 epochs' saves would stay: counted from the data
    monkeypatch.setattr(resources, "rows_of", lambda paths: 46_080)
    cfg = _paper(tmp_path, tmp_path / "ckpt", "trainer.total_training_steps=null", "trainer.max_actor_ckpt_to_keep=null")
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda p: Usage(10**13, 0, 10**13))
    with pytest.raises(MixConfigError, match=r"keeps 216 checkpoint\(s\)"):  # 46080 // 128 x 30 = 10800 steps
        check_checkpoint_dir(cfg)


def test_a_path_under_a_file_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(MixConfigError, match=r"trainer\.default_local_dir=.*a_file/ckpt: cannot write"):
        check_checkpoint_dir(_paper(tmp_path, blocker / "ckpt"))


def test_a_read_only_directory_is_refused(tmp_path):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        if os.access(read_only, os.W_OK):  # root ignores the mode: the disk_usage/refusal path is tested above
            pytest.skip("running as root: a read-only mode does not stop writes")
        with pytest.raises(MixConfigError, match=r"read_only: cannot write .*PermissionError"):
            check_checkpoint_dir(_paper(tmp_path, read_only))
    finally:
        read_only.chmod(0o700)


def test_no_saves_no_check(tmp_path, monkeypatch):
    """save_freq <= 0: verl writes no checkpoint, so the directory is neither created nor measured."""
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda p: pytest.fail("measured a run that saves nothing"))
    cfg = _paper(tmp_path, tmp_path / "never", "trainer.save_freq=-1")
    assert check_checkpoint_dir(cfg) is None and not (tmp_path / "never").exists()


def test_kept_at_once_follows_verls_checkpoint_manager():
    """verl/utils/checkpoint/checkpoint_manager.py: k >= 2 deletes down to k - 1 before a save; k = 1 deletes
    the old one after the new one is written (2 at once); null keeps every save."""
    assert kept_at_once(10, 2) == 2 and kept_at_once(10, 1) == 2 and kept_at_once(10, 3) == 3
    assert kept_at_once(1, 2) == 1 and kept_at_once(10, None) == 10 and kept_at_once(None, None) is None
    assert kept_at_once(None, 2) == 2


def test_unknown_model_size_still_probes_the_directory(tmp_path, capsys):
    cfg = _paper(tmp_path, tmp_path / "ckpt")
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = "NoSuchOrg/no-such-model-in-cache"
    plan = check_checkpoint_dir(cfg)
    assert plan["bytes_each"] is None and (tmp_path / "ckpt").is_dir()
    assert "size unknown" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "ckpt")
