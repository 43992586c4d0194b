"""The data check before Ray (mix_src/config/data_check.py): bad files refused naming file/column, bad rows dropped
and counted by the same rule the dataset class applies, long prompts per data.truncation. No Ray."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from e2e import MIX_CPU, tiny_overrides
from mix_src.config.data_check import check_data, row_problem
from mix_src.trainer.dataset import RLHFDatasetWithTarget
from mix_src.config.mix_config import MixConfigError


def _row(i, prompt=..., gt=..., target=...):
    return {"data_source": "t", "prompt": [{"role": "user", "content": f"{i}+1=?"}] if prompt is ... else prompt,
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1) if gt is ... else gt},
            "extra_info": {"split": "train", "index": i},
            "target": [{"role": "assistant", "content": f"\\boxed{{{i + 1}}}"}] if target is ... else target}


def _write(path, rows):
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


_BASE = {}


def _config(tiny_assets, train, *extra, batch_size=4):
    """The composed CPU config (composed once: Hydra takes seconds here) with ``key=value`` overrides."""
    if "cfg" not in _BASE:
        with initialize_config_module(config_module="mix_src.config", version_base=None):
            _BASE["cfg"] = compose(config_name="mix_ppo", overrides=MIX_CPU + tiny_overrides(tiny_assets))
        OmegaConf.resolve(_BASE["cfg"])
    cfg = _BASE["cfg"].copy()
    for item in [f"data.train_files={train}", f"data.train_batch_size={batch_size}", *extra]:
        key, value = item.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg


def test_row_rule():
    ok = [{"role": "user", "content": "q"}]
    assert row_problem(ok, {"ground_truth": "3"}) is None
    assert row_problem(np.array(ok, dtype=object), {"ground_truth": 12}) is None  # an int answer is its text
    assert row_problem(ok, {"ground_truth": "\\infty"}) is None  # infinity as LaTeX is an answer
    bad = {"prompt is not a non-empty list": [("q", {"ground_truth": "1"}), ([], {"ground_truth": "1"}),
                                              (None, {"ground_truth": "1"})],
           "a prompt message is not": [([{"role": "user"}], {"ground_truth": "1"}),
                                       ([{"role": "user", "content": 5}], {"ground_truth": "1"})],
           "reward_model has no ground_truth": [(ok, None), (ok, {"style": "rule"})],
           "reward_model.ground_truth": [(ok, {"ground_truth": g}) for g in ("", " ", "nan", "NaN", "inf", "-inf",
                                                                             None, float("nan"), float("inf"))]}
    for start, cases in bad.items():
        for prompt, rm in cases:
            why = row_problem(prompt, rm)
            assert why is not None and why.startswith(start), (prompt, rm, why)


def test_good_files_pass_with_a_summary(tiny_assets, capsys):
    reports = check_data(_config(tiny_assets, tiny_assets["train"]))
    out = capsys.readouterr().out
    assert f"train {tiny_assets['train']}: 32 rows, 32 kept, none dropped" in out
    assert f"val {tiny_assets['val']}: 8 rows, 8 kept, none dropped" in out
    assert len(reports) == 2
    # a remote file is verl's to copy (not opened here, not counted as missing rows)
    reports = check_data(_config(tiny_assets, tiny_assets["train"], "data.val_files=hdfs://cluster/valid.parquet"))
    assert list(reports) == [tiny_assets["train"]]


def test_bad_files_refused_naming_file_and_column(tiny_assets, tmp_path):
    good = [_row(i) for i in range(8)]
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    (tmp_path / "dir.parquet").mkdir()
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    cases = {
        str(tmp_path / "empty.parquet"): r"is empty \(0 bytes\)",
        str(tmp_path / "fake.parquet"): "is not a readable parquet file",
        str(tmp_path / "dir.parquet"): "is a directory",
        str(tmp_path / "x.csv"): "unsupported file type",
        _write(tmp_path / "noprompt.parquet", [{k: v for k, v in r.items() if k != "prompt"} for r in good]):
            r"data.prompt_key=prompt.*no 'prompt' column",
        _write(tmp_path / "strprompt.parquet", [_row(i, prompt="what is 1+1?") for i in range(8)]):
            "column 'prompt' holds strings",
        _write(tmp_path / "norm.parquet", [{k: v for k, v in r.items() if k != "reward_model"} for r in good]):
            "no 'reward_model' column",
        _write(tmp_path / "inttarget.parquet", [_row(i, target=i) for i in range(8)]):
            r"mix.data.target_key=target.*has type int64",
        _write(tmp_path / "norows.parquet", pd.DataFrame(good).iloc[:0]): "has no rows",
        _write(tmp_path / "few.parquet", good[:3]): r"3 usable rows .* fewer than data.train_batch_size=4",
        _write(tmp_path / "fewafterdrops.parquet", good[:3] + [_row(9, gt="nan")] * 5):
            r"3 usable rows after the drops above, fewer than data.train_batch_size=4",
    }
    for path, message in cases.items():
        with pytest.raises(MixConfigError, match=message) as e:
            check_data(_config(tiny_assets, path))
        assert "data.train_files" in str(e.value), str(e.value)
        if "usable" not in message:
            assert path in str(e.value)


def test_jsonl_read_as_verl_reads_it_and_a_broken_line_named(tiny_assets, tmp_path, capsys):
    rows = [_row(i) for i in range(6)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    check_data(_config(tiny_assets, path))
    assert f"train {path}: 6 rows, 6 kept" in capsys.readouterr().out
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n{broken\n")
    with pytest.raises(MixConfigError, match=re.escape(f"{path}: line 3 is not JSON")):
        check_data(_config(tiny_assets, path))


def test_bad_rows_dropped_counted_and_the_dataset_drops_the_same(tiny_assets, tmp_path, capsys):
    rows = [_row(i) for i in range(10)]
    rows[2] = _row(2, gt="nan")
    rows[5] = _row(5, gt="")
    rows[7] = _row(7, prompt=[{"role": "user"}])
    path = _write(tmp_path / "mixed.parquet", rows)
    cfg = _config(tiny_assets, path)
    reports = check_data(cfg)
    out = capsys.readouterr().out
    assert (f"train {path}: 10 rows, 7 kept, 3 dropped: 1 reward_model.ground_truth is 'nan', the text of a missing "
            "or non-finite number (first: row 2)") in out, out
    assert "1 a prompt message is not {role: str, content: str} (first: row 7)" in out
    assert reports[path].kept == [0, 1, 3, 4, 6, 8, 9]

    # the workers' dataset class keeps exactly those rows
    tok = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    data_cfg = OmegaConf.create({**OmegaConf.to_container(cfg.data), "mix": {"n_prefix": 1},
                                 "cache_dir": str(tmp_path / "cache")})
    ds = RLHFDatasetWithTarget(path, tok, data_cfg)
    assert [e["index"] for e in ds.dataframe["extra_info"]] == reports[path].kept
    assert "dropped 3 of 10 rows that fail the data check" in capsys.readouterr().out

    # with another dataset class nothing would drop them: refused
    with pytest.raises(MixConfigError, match=r"1 rows with reward_model.ground_truth is 'nan'.*first: row 2.*fix the file"):
        check_data(_config(tiny_assets, path, "data.custom_cls.name=RLHFDataset",
                           "data.custom_cls.path=pkg://verl.utils.dataset.rl_dataset"))


def test_long_prompts_follow_data_truncation(tiny_assets, tmp_path, capsys):
    rows = [_row(i) for i in range(8)] + [_row(8 + i, prompt=[{"role": "user", "content": "9" * 60}]) for i in range(2)]
    path = _write(tmp_path / "long.parquet", rows)
    with pytest.raises(MixConfigError, match=r"2 of 10 prompts are longer than data.max_prompt_length=32 tokens "
                                             r"\(first: row 8.*data.truncation=error"):
        check_data(_config(tiny_assets, path))
    capsys.readouterr()
    check_data(_config(tiny_assets, path, "data.filter_overlong_prompts=true"))
    assert "2 prompts longer than data.max_prompt_length=32 tokens" in capsys.readouterr().out
    with pytest.raises(MixConfigError, match=r"8 usable rows.*fewer than data.train_batch_size=9"):
        check_data(_config(tiny_assets, path, "data.filter_overlong_prompts=true", batch_size=9))
    with pytest.raises(MixConfigError, match=r"data.truncation=right, but verl's agent loop cuts long prompts from the left"):
        check_data(_config(tiny_assets, path, "data.truncation=right"))
    check_data(_config(tiny_assets, path, "data.truncation=left"))  # what the agent loop does: not tokenised


def test_targets_over_the_cap_leave_the_usable_rows_before_ray(tiny_assets, tmp_path, capsys):
    """Rows whose target is over mix.data.max_target_length are dropped by the dataset at load: counted here, so a
    file where too few rows are left is refused before Ray (it was found empty inside Ray: num_samples=0)."""
    rows = [_row(i, target=[{"role": "assistant", "content": "7" * 40}]) for i in range(6)] + [_row(6 + i) for i in range(2)]
    path = _write(tmp_path / "long_targets.parquet", rows)
    check_data(_config(tiny_assets, path, "mix.data.max_target_length=16", batch_size=2))
    out = capsys.readouterr().out
    assert "6 rows have a target longer than mix.data.max_target_length=16 tokens (first: row 0)" in out
    with pytest.raises(MixConfigError, match=r"2 usable rows.*fewer than data.train_batch_size=4"):
        check_data(_config(tiny_assets, path, "mix.data.max_target_length=16", batch_size=4))
    # a multi-turn expert episode (the tool loop's JSON target) is the tool loop's to measure: not counted
    episode = json.dumps([{"role": "assistant", "content": "7" * 40}, {"role": "tool", "content": "1"}])
    path_ep = _write(tmp_path / "episodes.parquet", [_row(i, target=episode) for i in range(4)])
    check_data(_config(tiny_assets, path_ep, "mix.data.max_target_length=16", batch_size=4))
    # truncated instead of dropped, or a short cap's bytes bound: nothing counted
    check_data(_config(tiny_assets, path, "mix.data.max_target_length=16", "mix.data.truncate_targets=true", batch_size=8))
    check_data(_config(tiny_assets, path, "mix.data.max_target_length=64", batch_size=8))


@pytest.mark.parametrize("mix,target", [({"n_prefix": 1, "data": {"sample_target_ratio": 0.0}}, ...),
                                        ({"n_prefix": 1}, None), ({"n_prefix": 1}, [])])
def test_no_target_left_loads_on_policy_only(tiny_assets, tmp_path, mix, target):
    """sample_target_ratio=0 and an all-null target column raised IndexError (tokenizer([])) before."""
    tok = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 64, "filter_overlong_prompts": False,
                            "seed": 1, "cache_dir": str(tmp_path / "cache"), "mix": mix})
    ds = RLHFDatasetWithTarget(_write(tmp_path / "t.parquet", [_row(i, target=target) for i in range(4)]), tok, cfg)
    assert len(ds) == 4 and list(ds.dataframe["target"]) == [""] * 4
    assert ds.target_stats["with_target"] == 0
