"""mix_src.planner: the estimates checked by hand (no Ray, no torch)."""

import pytest

from mix_src.planner import checkpoint_bytes, count_params
from mix_src.planner.presets import PRESETS


def test_count_params_qwen25_7b_by_hand():
    # embedding 152064*3584 twice (untied head) + 28 layers of (attn 3584*(3584+2*512) + 3584*3584 + biases
    # 3584+2*512, MLP 3*3584*18944, 2 norms 2*3584) + final norm 3584
    embed = 152064 * 3584
    layer = 3584 * (3584 + 2 * 512) + 3584 * 3584 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
    assert count_params(PRESETS["Qwen/Qwen2.5-7B"]) == 2 * embed + 28 * layer + 3584 == 7_615_616_512


def test_count_params_tied_head_qwen25_1p5b():
    n = count_params(PRESETS["Qwen/Qwen2.5-1.5B"])
    assert n == 1_543_714_304  # the model card's 1.54B; tied embeddings count once


def test_checkpoint_bytes_basis():
    n = 1_000_000
    assert checkpoint_bytes(n) - checkpoint_bytes(n, with_optimizer=False) == 8 * n  # AdamW's two fp32 moments
    assert checkpoint_bytes(2 * n, with_optimizer=False) - checkpoint_bytes(n, with_optimizer=False) == 4 * n
    with pytest.raises(ValueError):
        checkpoint_bytes(-1)


# ------------------------------------------------------------------------------------------------------------
# the paper recipe, composed as recipes/luffy_zero/run.sh does (no Ray)

import copy  # noqa: E402
import functools  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402

import torch  # noqa: E402

from mix_src.algo.flops import ModelShape  # noqa: E402
from mix_src.planner.__main__ import compose, main as planner_main  # noqa: E402
from mix_src.planner.check import PlannerRefusal, check_memory, refusal, run_shape  # noqa: E402
from mix_src.planner.estimate import GPUS, entropy_bytes, plan_memory, states_bytes  # noqa: E402
from mix_src.config.mix_config import MixConfigError  # noqa: E402

LUFFY_ZERO = str(Path(__file__).resolve().parents[1] / "recipes" / "luffy_zero")
Q7 = PRESETS["Qwen/Qwen2.5-7B"]
ONE_GPU_7B = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
              "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B", "mix.planner.gpu=a100-80gb"]


@functools.lru_cache(maxsize=1)
def _paper_base():
    return compose(LUFFY_ZERO, "config", [])


def paper(*overrides):
    """The paper recipe with ``key=value`` overrides set on one cached composition (a Hydra compose per test
    costs seconds); tests of how Hydra forwards a key compose for real (:func:`compose`)."""
    cfg = copy.deepcopy(_paper_base())
    with open_dict(cfg):
        for o in overrides:
            key, value = o.split("=", 1)
            OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg


def test_7b_on_one_80gb_gpu_is_refused_naming_the_term():
    cfg = paper(*ONE_GPU_7B)
    run = run_shape(cfg)
    assert run.fsdp_shards == 1
    assert states_bytes(count_params(Q7), run) == 16 * 7_615_616_512  # ~122 GB: 4 + 4 + 8 B/param
    with pytest.raises(PlannerRefusal, match=r"optimizer step alone needs 152\.3 GB .*AdamW states are 121\.8 GB") as e:
        check_memory(cfg)
    assert isinstance(e.value, MixConfigError)  # preflight's error type: the driver stops before Ray
    for fix in ("trainer.n_gpus_per_node", "offload_policy=true", "mix.planner.check=false"):
        assert fix in str(e.value)


def test_7b_on_one_h200_is_refused_by_the_optimizer_step():
    """Measured on an H200 (scripts/gpu/calibrate_memory.py, mix_src/planner/README.md): a random Qwen2.5-Math-7B ran
    out of memory at AdamW's first step with a 1024-token micro-batch (61.2 GB held after the backward; the step
    adds 8 B/param of moments and a 4 B/param foreach temporary). Its 121.8 GB of states fit the 150.8 GB card, so
    a states-only check let it through."""
    n = count_params(Q7)
    run = run_shape(paper(*ONE_GPU_7B))
    h200 = GPUS["h200-141gb"].memory_bytes
    assert states_bytes(n, run) < h200  # the old check's term fits
    why = refusal(n, run, h200)
    assert why is not None and "AdamW step temporary (foreach) 30.5 GB" in why and "at least 2 GPUs" in why
    step = plan_memory(Q7, run, GPUS["h200-141gb"]).phases["optimizer step"]
    assert sum(t.bytes for t in step) == 20 * 7_615_616_512


def test_no_flash_attn_keeps_the_log_softmax_for_the_backward():
    """Without flash-attn verl's logprobs_from_logits_v2 saves each row's log_softmax (measured: 0.5B, 32768 tokens,
    update peak 39.3 GB, planner 41.5 GB with the term, 31.5 GB without it)."""
    sdpa = run_shape(paper("actor_rollout_ref.model.override_config.attn_implementation=sdpa"))
    assert not sdpa.flash_ce and run_shape(paper()).flash_ce
    t = sdpa.train_tokens
    assert _logit_bytes(paper("actor_rollout_ref.model.override_config.attn_implementation=sdpa"), "actor update",
                        "log_softmax kept for backward") == 2 * t * Q7["vocab_size"]


def test_offload_flags_as_verl_uses_them():
    n = count_params(Q7)
    # param_offload / optimizer_offload: verl loads both back for the update, still refused
    cfg = paper(*ONE_GPU_7B, "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true")
    assert refusal(n, run_shape(cfg), GPUS["a100-80gb"].memory_bytes) is not None
    # FSDP2's CPUOffloadPolicy keeps the states on the CPU: not refused
    cfg = paper(*ONE_GPU_7B, "actor_rollout_ref.actor.strategy=fsdp2",
                "actor_rollout_ref.actor.fsdp_config.offload_policy=true")
    assert refusal(n, run_shape(cfg), GPUS["a100-80gb"].memory_bytes) is None
    # 2 GPUs: 61 GB of states per GPU, under 80 GiB
    assert refusal(n, run_shape(paper(*ONE_GPU_7B, "trainer.n_gpus_per_node=2")), GPUS["a100-80gb"].memory_bytes) is None


def test_check_memory_switches():
    assert check_memory(paper(*ONE_GPU_7B, "mix.planner.check=false")) is None  # one key turns it off
    cpu = paper("actor_rollout_ref.model.path=Qwen/Qwen2.5-7B", "trainer.device=cpu")
    assert check_memory(cpu) is None  # the CPU backend: skipped unless a GPU is named
    msg = check_memory(paper("actor_rollout_ref.model.path=Qwen/Qwen2.5-7B", "mix.planner.gpu=a100-80gb"))
    assert "peak" in msg and "fits" in msg
    hub = check_memory(paper("actor_rollout_ref.model.path=nobody/not-a-cached-model", "mix.planner.gpu=a100-80gb"))
    assert "memory not checked" in hub and "nobody/not-a-cached-model" in hub  # says what could not be checked


def test_paper_recipe_on_8x80gb_prints_every_term(capsys):
    rc = planner_main(["--config-path", LUFFY_ZERO, "--config-name", "config", "--model", "Qwen/Qwen2.5-Math-7B"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for line in ("rollout:", "old log-prob:", "actor update:", "fp32 grads", "AdamW states", "logits + their gradient",
                 "vLLM: KV cache", "peak per GPU", "+/- 25%", "GPU-hours for 500 steps"):
        assert line in out, line
    # the update's states by hand: 16 B/param x 7.62B / 8 GPUs = 15.2 GB
    cfg = paper("actor_rollout_ref.model.path=Qwen/Qwen2.5-Math-7B")
    plan = plan_memory(PRESETS["Qwen/Qwen2.5-Math-7B"], run_shape(cfg), GPUS["a100-80gb"])
    upd = {t.name: t.bytes for t in plan.phases["actor update"]}
    assert upd["fp32 params"] + upd["fp32 grads"] + upd["AdamW states"] == 16 * 7_615_616_512 // 8
    assert upd["logits + their gradient"] == 4 * 32768 * 152064  # bf16 logits and gradient of 32k tokens
    assert plan.peak <= GPUS["a100-80gb"].memory_bytes


def test_one_gpu_7b_cli_exits_2(capsys):
    rc = planner_main(["--config-path", LUFFY_ZERO, "--config-name", "config", "--model", "Qwen/Qwen2.5-7B",
                       "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"])
    assert rc == 2 and "REFUSED before Ray" in capsys.readouterr().out


def _logit_bytes(cfg, phase, name):
    plan = plan_memory(Q7, run_shape(cfg), GPUS["a100-80gb"])
    return {t.name: t.bytes for t in plan.phases[phase]}[name]


def test_chunked_entropy_before_after():
    eager = "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false"
    chunk = "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true"  # dp_actor.yaml forwards it to fsdp_config
    base, chunked = paper(eager), compose(LUFFY_ZERO, "config", [eager, chunk])
    assert run_shape(chunked).entropy_chunking and not run_shape(base).entropy_chunking
    t, v = 32768, 152064
    # the log-prob pass (no gradient): chunking lowers the entropy's temporaries from 4 B/logit to one chunk's 12 B
    assert _logit_bytes(base, "old log-prob", "entropy (no gradient)") == 4 * t * v
    assert _logit_bytes(chunked, "old log-prob", "entropy (no gradient)") == 12 * 2048 * v
    # the update (entropy_coeff 0.001: a gradient): chunking keeps each chunk's fp32 copies, 8 B/logit instead of 2
    assert _logit_bytes(base, "actor update", "entropy (with gradient)") == 2 * t * v
    assert _logit_bytes(chunked, "actor update", "entropy (with gradient)") == 8 * t * v
    # verl's default, torch.compile: a fused reduction either way
    assert _logit_bytes(paper("actor_rollout_ref.actor.fsdp_config.entropy_from_logits_with_chunking=true"),
                        "actor update", "entropy (with gradient)") == 0


def _saved_per_logit(fn, tokens=512, vocab=256, **kw):
    x = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    seen = {}

    def pack(t):
        seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, **kw)
    seen.pop(x.data_ptr(), None)
    return sum(seen.values()) / x.numel()


def test_entropy_bytes_match_verl():
    """The planner's bytes per logit saved for the backward are what verl's own entropy functions save (eager)."""
    from verl.utils.torch_functional import entropy_from_logits, entropy_from_logits_with_chunking

    shape = ModelShape.from_hf_config(Q7)
    run = run_shape(paper("actor_rollout_ref.actor.fsdp_config.use_torch_compile=false"))
    per_logit = entropy_bytes(shape, run, 1000, grad=True) / (1000 * shape.vocab)
    assert _saved_per_logit(entropy_from_logits) == pytest.approx(per_logit, rel=0.01)
    run_c = run_shape(paper("actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
                            "actor_rollout_ref.actor.fsdp_config.entropy_from_logits_with_chunking=true"))
    per_logit_c = entropy_bytes(shape, run_c, 1000, grad=True) / (1000 * shape.vocab)
    assert _saved_per_logit(entropy_from_logits_with_chunking, chunk_size=128) == pytest.approx(per_logit_c, rel=0.01)


def test_calibration_script_runs_on_cpu_with_a_tiny_config(tmp_path, capsys):
    """scripts/gpu/calibrate_memory.py's plumbing (model build, update with AdamW, log-prob pass, the planner's
    terms); the measurement itself needs CUDA (mix_src/planner/README.md)."""
    import json

    from scripts.gpu import calibrate_memory

    cfg = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512, "max_position_embeddings": 256,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert calibrate_memory.main(["--config", str(tmp_path), "--tokens", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "actor update:" in out and "old log-prob:" in out and "n/a (no CUDA)" in out
    assert "timing (the second update, wall, synchronised): forward " in out and "optimizer step" in out
    assert f"{count_params(cfg) / 1e9:.3f}B" in out


def _layers_1p5b(layers):
    """Qwen2.5-1.5B's shape with ``layers`` decoder layers: the family run across the 80 GB boundary."""
    return dict(PRESETS["Qwen/Qwen2.5-1.5B"], num_hidden_layers=layers)


def test_h100_boundary_as_measured():
    """Measured on one H100 80GB HBM3 (scripts/gpu/calibrate_memory.py, 4096-token micro-batch,
    calibration/h100_2026-11-26_boundary.txt): 81 layers (4.02B params, AdamW's step 80.55 GB) ran; 82, 83, 84, 85
    and 87 layers ran out of memory at the first step, with 2.61-2.74 GiB reserved by torch but unallocated. The
    80 GiB preset called 82-85 'fits' (and did not refuse 86); torch's total_memory there is 85,017,493,504 B."""
    from mix_src.planner.check import format_plan
    from mix_src.planner.estimate import RunShape

    h100 = GPUS["h100-80gb"]
    assert h100.memory_bytes == 85_017_493_504  # torch.cuda.get_device_properties(0).total_memory on that H100
    run = RunShape(world_size=1, fsdp_shards=1, offload_policy=False, param_offload=False, optimizer_offload=False,
                   train_tokens=4096, logprob_tokens=4096, gradient_checkpointing=True, entropy_in_update=True,
                   entropy_chunking=False, entropy_chunk=2048, entropy_compiled=True, reference=False,
                   gpu_memory_utilization=0.05, rollout_tp=1, max_num_seqs=256, prompt_len=2048, response_len=2048,
                   n=1, n_full_target=0, batch_size=1, ppo_epochs=1, steps=0, flash_ce=False)

    def verdict(layers):
        hf = _layers_1p5b(layers)
        mem = plan_memory(hf, run, h100)
        assert mem.peak_phase == "optimizer step"  # the step decides here (vLLM's share kept small)
        return format_plan(mem, None, run, count_params(hf), mfu=0.3, mean_response=1024).splitlines()[-2]

    assert verdict(81).endswith(": fits")
    for layers in (82, 83, 84, 85):  # all ran out of memory
        assert "DOES NOT FIT" in verdict(layers), layers
    assert refusal(count_params(_layers_1p5b(85)), run, h100.memory_bytes) is None  # not certain: an estimate
    assert refusal(count_params(_layers_1p5b(86)), run, h100.memory_bytes) is not None  # step 85.16 GB > the card


def _calibration_rows():
    """(file, config, tokens, measured {phase: bytes}) for every run on verl's path in calibration/*_verl_path.txt and
    *_head_*.txt: the raw outputs of scripts/gpu/calibrate_memory.py on the H200 and the H100 (README's tables)."""
    import re

    rows, root = [], Path(__file__).resolve().parents[1]
    for f in sorted((root / "mix_src/planner/calibration").glob("*.txt")):
        if not ("_verl_path" in f.name or "_head_" in f.name):
            continue
        for block in f.read_text().split("=== ")[1:]:
            head = re.match(r"(\S+) tokens=(\d+) path=verl", block)
            got = [float(x) * 1e9 for x in re.findall(r"measured max_memory_allocated ([\d.]+) GB", block)]
            assert head and len(got) == 3, (f.name, block[:200])
            cfg = head[1] if head[1] in PRESETS else str(root / head[1])
            rows.append((f.name, cfg, int(head[2]), dict(zip(("actor update", "optimizer step", "old log-prob"), got))))
    return rows


def test_planner_brackets_every_gpu_measurement():
    """Every row measured on a GPU (0.5B, 1.5B, 3B; 8,192-32,768 tokens; H200 and H100): the planner's update is on
    the high side by at most 25 % of the measured, its optimizer step within 1.5 % and its log-prob pass above by at most 3 %."""
    from scripts.gpu import calibrate_memory

    rows = _calibration_rows()
    assert len(rows) >= 13 and any("q25_3b" in r[1] for r in rows)
    for name, cfg, tokens, measured in rows:
        phases = calibrate_memory.planner_terms(calibrate_memory.load_config(cfg), tokens, GPUS["h200-141gb"])
        plan = {p: sum(t.bytes for t in phases[p]) for p in measured}
        where = (name, cfg, tokens)
        assert measured["actor update"] <= plan["actor update"] <= 1.25 * measured["actor update"], where
        assert abs(plan["optimizer step"] - measured["optimizer step"]) <= 0.015 * plan["optimizer step"], where
        assert measured["old log-prob"] <= plan["old log-prob"] <= 1.03 * measured["old log-prob"], where
