"""Several demonstrations per prompt (issue #55 item 1, ``mix.data.use_target_lst``): the row rule
(mix_src/config/data_check.py ``demonstrations``), the driver's count before Ray (``check_data``), the dataset's load
(mix_src/trainer/dataset.py), the per-row draw (mix_src/algo/demonstrations.py), the agent loop's per-session target
and LUFFY's key. No Ray (the 2-step runs on both bases: tests/test_target_lst_e2e.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from e2e import MIX_CPU, tiny_overrides
from mix_src.algo.demonstrations import draw_demonstration_indices, draw_row_targets
from mix_src.config.data_check import (LST_DUPLICATE, LST_NONE, LST_NOT_TEXT, LST_OVER_CAP, check_data,
                                       demonstrations)
from mix_src.config.luffy_keys import translate_overrides
from mix_src.config.mix_config import MixConfigError, mix_config_from_dict
from mix_src.rollout.agent_loop import row_target
from mix_src.trainer.dataset import TARGET_LST_FIELD, RLHFDatasetWithTarget


def _msg(text):
    return [{"role": "assistant", "content": text}]


# ---- the row rule ----------------------------------------------------------------------------------------------
def test_target_first_then_the_list_and_each_bad_item_counted():
    texts, why = demonstrations("a", ["b", _msg("c")[0], "a", "b", 3, "  ", None, "d"], max_num_targets=5)
    assert texts == ["a", "b", "c", "d"]  # target first; "a" again merged silently; a {content} message is text
    assert why == {LST_DUPLICATE: 1, LST_NOT_TEXT: 3}
    # LUFFY's cap: the first max_num_targets, target included
    assert demonstrations("a", ["b", "c", "d"], 2) == (["a", "b"], {LST_OVER_CAP: 2})
    assert demonstrations(None, ["b", "c"], 5) == (["b", "c"], {})  # no target: the list alone


@pytest.mark.parametrize("empty", [None, [], np.array([], dtype=object), "not a list"])
def test_empty_or_null_list_leaves_the_target(empty):
    assert demonstrations("a", empty, 5) == (["a"], {LST_NONE: 1})
    assert demonstrations(None, empty, 5) == ([], {LST_NONE: 1})


# ---- the draw --------------------------------------------------------------------------------------------------
def test_prefixed_rows_draw_distinct_demonstrations_seeded():
    sizes, n, k = [5, 3, 0, 1], 4, 3
    idx, repeated = draw_demonstration_indices(sizes, n, k, np.random.default_rng(0))
    idx = idx.reshape(len(sizes), n)
    assert len(set(idx[0, :k])) == k and len(set(idx[1, :k])) == k  # m >= k: distinct
    assert (idx[2] == -1).all() and (idx[3] == 0).all()  # none; one (repeated twice among 3 prefixed rows)
    assert repeated == 2
    again, _ = draw_demonstration_indices(sizes, n, k, np.random.default_rng(0))
    assert (again.reshape(len(sizes), n) == idx).all()  # seeded
    other = [draw_demonstration_indices([5], 4, 3, np.random.default_rng(s))[0].tolist() for s in range(8)]
    assert len({tuple(o) for o in other}) > 1  # the seed matters


def test_fewer_demonstrations_than_prefixed_rows_cycle_and_are_counted():
    idx, repeated = draw_demonstration_indices([2], 5, -1, np.random.default_rng(1))  # n_prefix=-1: all 5 prefixed
    assert repeated == 3 and sorted(np.bincount(idx).tolist()) == [2, 3]  # each used floor/ceil(5/2) times
    assert set(idx[:2].tolist()) == {0, 1}
    assert draw_demonstration_indices([2], 5, 0, np.random.default_rng(1))[1] == 0  # no prefixed row: no repeat


def test_one_prefix_per_group_takes_one_demonstration():
    idx, repeated = draw_demonstration_indices([3, 1], 4, -1, np.random.default_rng(2), shared=True)
    assert len(set(idx[:4].tolist())) == 1 and idx[4:].tolist() == [0] * 4 and repeated == 0


def test_row_targets_from_sets():
    rows, repeated = draw_row_targets(np.array([["x", "y"], []], dtype=object), 2, 2, np.random.default_rng(0))
    assert sorted(rows[:2].tolist()) == ["x", "y"] and rows[2:].tolist() == ["", ""] and repeated == 0


def test_v1_sessions_read_their_own_draw():
    assert row_target({"target": "a", "prefix_targets": ["b", "c"], "session_id": 1}) == "c"
    assert row_target({"target": "a", "session_id": 1}) == "a"  # no target_lst
    assert row_target({"target": "a"}) == "a"  # legacy: the row's own draw is its target


def test_luffy_key_is_live():
    out = translate_overrides(["actor_rollout_ref.actor.use_target_lst=True"], log=lambda _: None)
    assert out == ["mix.data.use_target_lst=True"]


# ---- the dataset's load -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


def _row(i, target, lst):
    return {"data_source": "t", "prompt": [{"role": "user", "content": f"{i}+1=?"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i},
            "target": target, "target_lst": lst}


def _rows():
    short, long = "\\boxed{1}", "9" * 40
    return [_row(0, _msg(short), [short, "\\boxed{01}", "\\boxed{01}"]),  # target repeated (merged); a duplicate
            _row(1, _msg(long), [short, long + "8"]),  # two items over the cap dropped, one kept
            _row(2, None, [long, long + "7"]),  # every item over the cap: row dropped
            _row(3, _msg(short), []),  # empty list: target alone
            _row(4, None, None)]  # nothing: on-policy only


def test_dataset_loads_the_drawn_set_and_drops_by_item_then_row(tmp_path, tokenizer, capsys):
    path = tmp_path / "lst.parquet"
    pd.DataFrame(_rows()).to_parquet(path)
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 256, "seed": 3, "cache_dir": str(tmp_path),
                            "mix": {"n_prefix": 2, "data": {"use_target_lst": True, "max_target_length": 16}}})
    ds = RLHFDatasetWithTarget(str(path), tokenizer, cfg)
    assert len(ds) == 4  # row 2 dropped
    assert [ds[i][TARGET_LST_FIELD] for i in range(4)] == [["\\boxed{1}", "\\boxed{01}"], ["\\boxed{1}"],
                                                           ["\\boxed{1}"], []]
    assert [ds[i]["target"] for i in range(4)] == ["\\boxed{1}", "\\boxed{1}", "\\boxed{1}", ""]
    stats = ds.target_stats
    assert stats["dropped_too_long"] == 1 and stats["items_too_long"] == 4 and stats["invalid_target"] == 1
    assert stats[f"lst: {LST_DUPLICATE}"] == 1 and stats[f"lst: {LST_NONE}"] == 2
    assert "target_lst (target_lst, target first" in capsys.readouterr().out
    # off: the column is ignored (the trainers draw only with use_target_lst), the target alone trains
    cfg.mix.data.use_target_lst, cfg.mix.data.max_target_length = False, 64
    ds = RLHFDatasetWithTarget(str(path), tokenizer, cfg)
    assert "demonstrations" not in ds.target_stats and [ds[i]["target"] for i in range(5)][:2] == ["\\boxed{1}", "9" * 40]


# ---- before Ray ------------------------------------------------------------------------------------------------
_BASE = {}


def _config(tiny_assets, train, *extra, batch_size=2):
    if "cfg" not in _BASE:
        with initialize_config_module(config_module="mix_src.config", version_base=None):
            _BASE["cfg"] = compose(config_name="mix_ppo", overrides=MIX_CPU + tiny_overrides(tiny_assets))
        OmegaConf.resolve(_BASE["cfg"])
    cfg = _BASE["cfg"].copy()
    for item in [f"data.train_files={train}", f"data.train_batch_size={batch_size}", "mix.data.use_target_lst=true",
                 *extra]:
        key, value = item.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg


def test_check_data_counts_each_reason_and_the_rows_left(tiny_assets, tmp_path, capsys):
    path = tmp_path / "lst.parquet"
    pd.DataFrame(_rows()).to_parquet(path)
    check_data(_config(tiny_assets, str(path), "mix.data.max_target_length=16", batch_size=4))
    out = capsys.readouterr().out
    assert f"target_lst: 8 demonstrations in 5 rows (target first when present), left out: 1 {LST_DUPLICATE}; " \
           f"2 {LST_NONE}" in out
    assert "4 target_lst demonstrations are longer than mix.data.max_target_length=16 tokens" in out
    assert "all its demonstrations are: 1 rows" in out
    with pytest.raises(MixConfigError, match=r"4 usable rows.*fewer than data.train_batch_size=5"):
        check_data(_config(tiny_assets, str(path), "mix.data.max_target_length=16", batch_size=5))


def test_check_data_refuses_a_missing_or_wrong_column(tiny_assets, tmp_path):
    rows = _rows()
    for r in rows:
        r.pop("target_lst")
    pd.DataFrame(rows).to_parquet(tmp_path / "none.parquet")
    with pytest.raises(MixConfigError, match=r"use_target_lst=true.*none\.parquet: no 'target_lst' column"):
        check_data(_config(tiny_assets, str(tmp_path / "none.parquet")))
    for r in rows:
        r["target_lst"] = "one string"
    pd.DataFrame(rows).to_parquet(tmp_path / "str.parquet")
    with pytest.raises(MixConfigError, match=r"str\.parquet.*column 'target_lst' has type (large_)?string"):
        check_data(_config(tiny_assets, str(tmp_path / "str.parquet")))
    with pytest.raises(MixConfigError, match=r"mix\.data\.max_num_targets"):
        mix_config_from_dict({"data": {"max_num_targets": 0}}).check()
