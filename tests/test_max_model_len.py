"""``rollout.max_model_len`` where the prefix-guided agent loop needs it (mix_src/config/model_context.py). No Ray.

verl fills a null ``max_model_len`` only inside its server actor (vllm_async_server.py ``_validate_configs``);
the agent loop, in another process, saw null and never clamped, so a prompt + prefix reaching the model's
context made verl's server raise mid-rollout. Now the driver resolves it (or refuses before Ray when prompt +
response cannot fit), and the loop falls back to verl's server rule where the driver could not."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

import composed
from mix_src.config.mix_config import MixConfigError
from test_agent_loop_server_parity import TARGET, StrictServer, _lengths, _run


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


def _model(tmp_path, tiny_assets, context: int):
    """A model directory whose config says ``max_position_embeddings = context`` (config only: the
    context is all the driver reads)."""
    path = tmp_path / f"model{context}"
    path.mkdir()
    cfg = json.loads((Path(tiny_assets["model"]) / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": context}))
    return path


def _config(tiny_assets, model, *overrides):
    return composed.compose_mix([  # tests/composed.py: the YAML read once per session
            f"data.train_files={tiny_assets['train']}", f"data.val_files={tiny_assets['val']}",
            f"actor_rollout_ref.model.path={model}", "data.max_prompt_length=32", "data.max_response_length=16",
            *overrides])  # fmt: skip


def test_driver_resolves_a_null_max_model_len_to_the_model_context(tiny_assets, tmp_path):
    from mix_src.main_mix_ppo import prepare_config

    cfg = _config(tiny_assets, _model(tmp_path, tiny_assets, 96))
    assert cfg.actor_rollout_ref.rollout.max_model_len is None
    prepare_config(cfg)
    assert cfg.actor_rollout_ref.rollout.max_model_len == 96  # what verl's server would set, now seen everywhere
    # override_config.max_position_embeddings counts, as in verl's HFModelConfig
    cfg = _config(tiny_assets, _model(tmp_path, tiny_assets, 80), "+actor_rollout_ref.model.override_config.max_position_embeddings=64")
    prepare_config(cfg)
    assert cfg.actor_rollout_ref.rollout.max_model_len == 64


def test_prompt_plus_response_beyond_the_context_is_refused_before_ray(tiny_assets, tmp_path):
    from mix_src.main_mix_ppo import prepare_config

    small = _model(tmp_path, tiny_assets, 40)  # < 32 + 16
    with pytest.raises(MixConfigError, match=r"data.max_prompt_length \(32\) \+ data.max_response_length \(16\) = 48") as e:
        prepare_config(_config(tiny_assets, small))
    assert "actor_rollout_ref.rollout.max_model_len=40" in str(e.value)
    with pytest.raises(MixConfigError, match="actor_rollout_ref.rollout.max_model_len=64 exceeds the context"):
        prepare_config(_config(tiny_assets, small, "actor_rollout_ref.rollout.max_model_len=64"))
    cfg = _config(tiny_assets, small, "actor_rollout_ref.rollout.max_model_len=40")  # deliberate: shorter answers
    prepare_config(cfg)
    assert cfg.actor_rollout_ref.rollout.max_model_len == 40


def test_agent_loop_clamps_prompt_plus_prefix_at_the_model_context(tokenizer, tiny_assets, tmp_path):
    """In the worker, with ``max_model_len`` still null (as verl hands it to the agent loop on stock verl, or
    for a hub id the driver had not cached): the loop reads the model's context as verl's server does, so a
    prompt + prefix close to it gets a shorter answer, and one that reaches it makes no call, where verl's
    server (StrictServer) would raise."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from mix_src.rollout import agent_loop
    from mix_src.rollout.agent_loop import PrefixGuidedAgentLoop
    from mix_src.trainer.dataset import RLHFDatasetWithTarget

    def loop(server, model):
        rollout = {"response_length": 40, "prompt_length": 64, "calculate_log_probs": True, "name": "vllm",
                   "max_model_len": None, "full_determinism": False}  # fmt: skip
        cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout, "model": {"path": str(model)}}, "data": {}})
        return PrefixGuidedAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                                     processor=None, dataset_cls=RLHFDatasetWithTarget, data_config=DictConfigWrap(cfg.data))  # fmt: skip

    tok7 = tokenizer.convert_tokens_to_ids("7")
    n_prompt, n_prefix = _lengths(tokenizer, loop(StrictServer(tok7, 10**6), tiny_assets["model"]), 0.5)
    assert n_prompt + 40 > n_prompt + n_prefix + 2  # prompt + response would not fit the context below

    context = n_prompt + n_prefix + 2  # room for 2 tokens after prompt + prefix
    server = StrictServer(tok7, context)
    out = _run(loop(server, _model(tmp_path, tiny_assets, context)), target=TARGET, prefix_ratio=0.5)
    assert server.calls[-1]["max_tokens"] == 2 and len(out.response_ids) == n_prefix + 2

    tight = n_prompt + n_prefix  # prompt + prefix fill the context: no room at all
    server = StrictServer(tok7, tight)
    out = _run(loop(server, _model(tmp_path, tiny_assets, tight)), target=TARGET, prefix_ratio=0.5)
    assert server.calls == [] and len(out.response_ids) == n_prefix
    assert len(agent_loop._MODEL_CONTEXT) >= 2  # read once per model, not per row
