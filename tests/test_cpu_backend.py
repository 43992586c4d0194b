"""CPU backend (mix_src/cpu, mix_src/config/backend/cpu.yaml): sampler and server units, then one real run.

Unit tests load the tiny random Qwen2 in-process (no Ray). The integration test runs verl's own stock
``python -m verl.trainer.main_ppo`` (GRPO, legacy trainer) for 2 steps through the CPU backend.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from e2e import STOCK_VERL_CPU, run_command, run_verl, tiny_overrides
from mix_src.cpu.sampling import SamplingSpec, filter_top_k_top_p, generate_batch



@pytest.fixture(scope="module")
def tiny(tiny_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        tiny_assets["model"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tok = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "3+4=?"}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    return model, tok, prompt


def reference_logprobs(model, prompt, tokens, temperature):
    """log_softmax(raw logits / T) of ``tokens`` from one full forward pass over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1), logits[len(prompt) - 1 : -1]


def test_tiny_assets_tokenizer_contract(tiny_assets, tiny):
    """Assets contract other engineers rely on: "\\n" is one token, targets round-trip exactly and
    our reward grades every decoded target (plus EOS) correct."""
    import pandas as pd

    from mix_src.rewards.math_verify_reward import compute_score

    _, tok, prompt = tiny
    assert len(tok.encode("\n", add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None and prompt[-1] == tok.encode("\n")[0]
    df = pd.read_parquet(tiny_assets["train"])
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info", "target"} <= set(df.columns)
    for target, rm in zip(df["target"], df["reward_model"], strict=True):
        text = target[0]["content"]
        assert target[0]["role"] == "assistant" and text.endswith("\\boxed{%s}" % rm["ground_truth"])
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        decoded = tok.decode(ids, skip_special_tokens=True)
        assert decoded == text
        assert compute_score("tiny_arith", decoded, rm["ground_truth"], {})["score"] == 1.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_raw_logits_at_temperature(tiny, temperature):
    model, tok, prompt = tiny
    spec = SamplingSpec(max_tokens=12, temperature=temperature, logprobs=True, ignore_eos=True)
    [(tokens, lps)] = generate_batch(model, [prompt], [spec], {tok.eos_token_id}, tok.pad_token_id,
                                     torch.Generator().manual_seed(1))
    ref, _ = reference_logprobs(model, prompt, tokens, temperature)
    assert len(tokens) == 12
    torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)


def test_top_k_off_by_default_and_does_not_renormalise(tiny):
    """top_k=-1 samples from the whole vocabulary (transformers' default top_k=50 must not leak in);
    top_k=k restricts the draw to the k best tokens but the log-prob stays log_softmax(logits / T)."""
    model, tok, prompt = tiny
    vocab = model.config.vocab_size
    assert vocab > 100  # so that a leaked top-50 would be visible
    gen = torch.Generator().manual_seed(0)
    prompts, specs = [prompt] * 16, [SamplingSpec(max_tokens=8, temperature=1.0, ignore_eos=True)] * 16
    ranks = []
    for tokens, _ in generate_batch(model, prompts, specs, {tok.eos_token_id}, tok.pad_token_id, gen):
        _, logits = reference_logprobs(model, prompt, tokens, 1.0)
        order = logits.argsort(dim=-1, descending=True)
        ranks += [(order[i] == t).nonzero().item() for i, t in enumerate(tokens)]
    assert max(ranks) >= 50, f"no sampled token outside the top 50 in {len(ranks)} draws: top-k leaked?"

    spec = SamplingSpec(max_tokens=10, temperature=1.0, top_k=3, logprobs=True, ignore_eos=True)
    [(tokens, lps)] = generate_batch(model, [prompt], [spec], {tok.eos_token_id}, tok.pad_token_id, gen)
    ref, logits = reference_logprobs(model, prompt, tokens, 1.0)
    top3 = logits.topk(3, dim=-1).indices
    assert all(t in top3[i] for i, t in enumerate(tokens))
    torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)


def test_filter_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = filter_top_k_top_p(logits, torch.tensor([3, 10]), torch.tensor([1.0, 0.7]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, True, False], [True, True, False, False]]
    off = filter_top_k_top_p(logits, torch.tensor([10**9, 10**9]), torch.tensor([1.0, 1.0]))
    assert torch.equal(off, logits)


def test_greedy_max_tokens_and_batching(tiny):
    """Temperature 0 is argmax of the raw logits; max_tokens is exact; a left-padded batch of
    different prompts and params gives the same tokens and log-probs as one-by-one decoding."""
    model, tok, prompt = tiny
    eos = {tok.eos_token_id}
    short = prompt[-5:]
    specs = [
        SamplingSpec(max_tokens=7, temperature=0.0, logprobs=True, ignore_eos=True),
        SamplingSpec(max_tokens=3, temperature=0.0, logprobs=True, ignore_eos=True),
        SamplingSpec(max_tokens=0, temperature=0.0),
    ]
    batched = generate_batch(model, [prompt, short, prompt], specs, eos, tok.pad_token_id)
    assert [len(t) for t, _ in batched] == [7, 3, 0]
    for p, spec, (tokens, lps) in zip([prompt, short], specs, batched):
        ref, logits = reference_logprobs(model, p, tokens, 0.0)
        assert tokens == logits.argmax(dim=-1).tolist()
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)
        [(alone, alone_lps)] = generate_batch(model, [p], [spec], eos, tok.pad_token_id)
        assert alone == tokens
        torch.testing.assert_close(torch.tensor(alone_lps), torch.tensor(lps), atol=1e-5, rtol=0)


def test_stops_at_eos_unless_ignored(tiny):
    model, tok, prompt = tiny
    [(tokens, _)] = generate_batch(model, [prompt], [SamplingSpec(max_tokens=5, temperature=0.0)], set(), 0)
    first = tokens[0]  # make the greedy first token a stop token
    [(stopped, _)] = generate_batch(model, [prompt], [SamplingSpec(max_tokens=5, temperature=0.0)], {first}, 0)
    assert stopped == [first]
    spec = SamplingSpec(max_tokens=5, temperature=0.0, ignore_eos=True)
    [(ignored, _)] = generate_batch(model, [prompt], [spec], {first}, 0)
    assert ignored == tokens


def test_sampling_params_parsing():
    spec = SamplingSpec.from_params(
        {"temperature": 0.5, "top_k": -1, "top_p": 1.0, "repetition_penalty": 1.0, "logprobs": True},
        default_max_tokens=16, max_possible_tokens=100,
    )
    assert (spec.max_tokens, spec.temperature, spec.top_k, spec.logprobs) == (16, 0.5, -1, True)
    assert SamplingSpec.from_params({"max_tokens": 500}, 16, 40).max_tokens == 40  # context window
    assert SamplingSpec.from_params({"max_new_tokens": 3}, 16, 40).max_tokens == 3  # sglang spelling
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingSpec.from_params({"repetition_penalty": 1.2}, 16, 40)
    with pytest.raises(ValueError, match="unsupported sampling params"):
        SamplingSpec.from_params({"best_of": 2}, 16, 40)


def test_server_batches_requests_and_loads_pushed_weights(tiny_assets, tiny):
    """The server (run in-process, without Ray) answers concurrent requests with the vLLM server's
    TokenOutput contract, and after ``update_weights`` samples from the new weights."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mix_src.cpu.hf_rollout import HFRolloutServer

    model, tok, prompt = tiny
    config = RolloutConfig(name="hf", prompt_length=32, response_length=16, tensor_model_parallel_size=1,
                           dtype="float32")
    server = HFRolloutServer(config, HFModelConfig(path=tiny_assets["model"], tokenizer_path=tiny_assets["tokenizer"]))
    greedy = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "logprobs": True, "ignore_eos": True}

    async def ask(params_list):
        return await asyncio.gather(*[server.generate(prompt, dict(p), f"r{i}") for i, p in enumerate(params_list)])

    outs = asyncio.run(ask([greedy] * 3 + [{**greedy, "max_tokens": 4}, {"temperature": 1.0}]))
    assert {k: server.get_stats()[k] for k in ("requests", "batches")} == {"requests": 5, "batches": 1}  # one batch
    assert [len(o.token_ids) for o in outs[:4]] == [16, 16, 16, 4]  # default max_tokens = response_length
    assert outs[0].token_ids == outs[1].token_ids and outs[4].log_probs is None
    assert outs[0].extra_fields == {"global_steps": None} and outs[0].stop_reason == "completed"

    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    asyncio.run(server.update_weights(new_state, global_steps=3))
    after = asyncio.run(ask([greedy]))[0]
    assert after.extra_fields["global_steps"] == 3
    perturbed = type(model)(model.config).eval()
    perturbed.load_state_dict(new_state)
    ref, _ = reference_logprobs(perturbed, prompt, after.token_ids, 0.0)
    torch.testing.assert_close(torch.tensor(after.log_probs), ref, atol=1e-5, rtol=0)
    with pytest.raises(KeyError, match="not in the rollout model"):
        asyncio.run(server.update_weights({"nope.weight": torch.zeros(1)}))


def test_server_gathers_requests_that_trickle_in(tiny_assets, tiny):
    """verl's agent loop sends a batch's requests one by one, milliseconds apart: they still form one decoding
    batch (each batch pays a whole decoding loop), as long as the gaps stay under the quiet period."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mix_src.cpu import hf_rollout
    from mix_src.cpu.hf_rollout import HFRolloutServer

    _, _, prompt = tiny
    config = RolloutConfig(name="hf", prompt_length=32, response_length=4, tensor_model_parallel_size=1,
                           dtype="float32")
    server = HFRolloutServer(config, HFModelConfig(path=tiny_assets["model"], tokenizer_path=tiny_assets["tokenizer"]))
    gap = getattr(hf_rollout, "_BATCH_QUIET_S", 0.03) / 3  # 10 ms

    async def trickle(n):
        async def one(i):
            await asyncio.sleep(i * gap)
            return await server.generate(prompt, {"temperature": 1.0, "seed": i}, f"r{i}")

        return await asyncio.gather(*[one(i) for i in range(n)])

    asyncio.run(trickle(8))  # spread over 70 ms
    assert {k: server.get_stats()[k] for k in ("requests", "batches")} == {"requests": 8, "batches": 1}


def test_selection_rules(monkeypatch):
    import mix_src.cpu as cpu

    monkeypatch.setenv("VERL_PLATFORM", "nvidia")
    assert not cpu.is_selected()
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert cpu.is_selected()
    monkeypatch.delenv("VERL_PLATFORM")
    assert cpu.is_selected() == (not cpu.accelerator_signs())


PROCESS_GROUP_SCRIPT = """
import os, sys
import torch.distributed as dist
import verl.utils.distributed as vdist
variant = sys.argv[1]
fn = getattr(vdist, variant)
assert getattr(fn, "_mix_src_cpu", False), f"{variant} is not patched"
if variant == "initialize_global_process_group":
    print("ranks", fn(timeout_second=60))
else:
    fn(timeout_second=60)
print("backend", dist.get_backend())
dist.destroy_process_group()
"""


@pytest.mark.parametrize("variant", ["initialize_global_process_group", "initialize_global_process_group_ray"])
def test_process_group_init_uses_plain_gloo(variant, tmp_path):
    """verl builds "cpu:gloo,cpu:gloo" on the cpu platform (torch: "Duplicate device type cpu"); both the
    torchrun variant (verl.trainer.sft_trainer) and the Ray variant must get a working 1-rank gloo group."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VERL_PLATFORM": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", PROCESS_GROUP_SCRIPT, variant], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend gloo" in out.stdout
    if variant == "initialize_global_process_group":
        assert "ranks (0, 0, 1)" in out.stdout


def test_fragment_composes_with_stock_verl_config():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=STOCK_VERL_CPU + ["trainer.n_gpus_per_node=2"])
    arr = cfg.actor_rollout_ref
    assert arr.rollout.name == "hf" and arr.rollout.tensor_model_parallel_size == 1
    assert arr.actor.strategy == "fsdp2" and arr.ref.strategy == "fsdp2"
    assert arr.model.override_config.attn_implementation == "eager" and not arr.model.use_remove_padding
    assert arr.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    assert cfg.ray_kwargs.ray_init.num_gpus == 2  # follows trainer.n_gpus_per_node
    assert cfg.trainer.device == "cpu" and cfg.reward.num_workers == 1 and arr.rollout.agent.num_workers == 1
    assert cfg.data.max_prompt_length == 512  # the fragment sets no sizes


def test_reward_loop_workers_start_at_their_first_call(monkeypatch):
    """mix_src/cpu/lean_start.py: under the MIX agent-loop manager (rule rewards in its worker), verl's
    RewardLoopManager builds its workers' handles but starts no actor until a method is looked up, then the one its
    body asked for (same options and arguments, get_if_exists); under verl's own, it starts them at once."""
    import ray
    from omegaconf import OmegaConf
    from verl.experimental.reward_loop import reward_loop

    from mix_src.cpu.lean_start import DeferredActor
    from mix_src.rollout.agent_loop_worker import MANAGER_FQN

    started = []

    class Remote:  # ray.remote(cls).options(**options).remote(*args), recorded; the "handle" has one method
        def __init__(self, cls, options=None):
            self.cls, self.options_ = cls, options

        def options(self, **options):
            return Remote(self.cls, options)

        def remote(self, *args):
            started.append((self.cls, self.options_, args))
            return SimpleNamespace(compute_score="the handle's method")

    monkeypatch.setattr(ray, "remote", Remote)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "ab" * 28, "Alive": True, "Resources": {"CPU": 8}}])
    manager = reward_loop.RewardLoopManager.__new__(reward_loop.RewardLoopManager)
    manager.reward_loop_workers_class, manager.reward_router_address = Remote(reward_loop.RewardLoopWorker), None
    manager.config = OmegaConf.create({"reward": {"num_workers": 2, "reward_model": {"enable": False}},
                                       "actor_rollout_ref": {"rollout": {"agent": {"agent_loop_manager_class": MANAGER_FQN}}}})
    manager._init_reward_loop_workers()
    workers = manager.reward_loop_workers
    assert [type(w) for w in workers] == [DeferredActor] * 2 and not started
    assert workers[1].compute_score == workers[1].compute_score == "the handle's method" and len(started) == 1
    cls, options, args = started[0]
    assert cls is reward_loop.RewardLoopWorker and args == (manager.config, None)
    assert options["name"] == "reward_loop_worker_1" and options["get_if_exists"] is True
    # verl's agent-loop worker (V1, stock verl) calls them: started at once, as verl does
    manager.config.actor_rollout_ref.rollout.agent.agent_loop_manager_class = None
    manager.reward_loop_workers_class = Remote(reward_loop.RewardLoopWorker)  # as verl's __init__ sets it
    manager._init_reward_loop_workers()
    assert len(started) == 3 and not any(isinstance(w, DeferredActor) for w in manager.reward_loop_workers)


@pytest.mark.ray
def test_stock_verl_main_ppo_grpo_two_steps(tiny_assets, tmp_path):
    """Stock verl GRPO, legacy trainer, 2 steps through the CPU backend (plus one greedy
    validation pass before training, the path recipes use)."""
    overrides = STOCK_VERL_CPU + tiny_overrides(tiny_assets, lr=1e-3) + [
        "trainer.use_v1=false",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.temperature=1.0",
        # The random policy earns reward 0, so GRPO advantages are 0; an entropy bonus gives a non-zero
        # gradient, the weights change at step 1, and step 2 then checks the weight push to the rollout.
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.calculate_entropy=true",
        "trainer.val_before_train=true",
    ]
    result = run_verl("verl.trainer.main_ppo", overrides, tmp_path, timeout=420)
    print(f"wall {result.wall_s:.1f}s, peak RSS of the job's process tree {result.peak_rss_mb:.0f} MiB, "
          f"killed after exit: {result.killed}")

    log = result.log_path.read_text(errors="replace")
    assert "mix_src.cpu: CPU backend active" in log and "hf rollout server 0 ready" in log
    val, *train = result.metrics
    assert val["step"] == 0 and any(k.startswith("val-core/") for k in val), sorted(val)
    assert [m["step"] for m in train] == [1, 2], result.log_tail()
    for m in train:
        for key in ("actor/pg_loss", "timing_s/step", "training/rollout_probs_diff_mean", "critic/score/mean"):
            assert key in m, f"{key} missing at step {m['step']}"
        assert m["training/rollout_probs_diff_valid"] == 1
        assert m["training/rollout_probs_diff_mean"] < 0.05
        # fp32 on both sides: measured ~1e-8; with the weight push disabled step 2 measured 5.8e-3.
        assert m["training/rollout_probs_diff_max"] < 1e-4
    assert train[0]["actor/grad_norm"] > 0  # so step 2 samples from updated, pushed weights


def test_run_verl_fails_clearly_and_leaves_nothing_running(tmp_path):
    """A hanging job is killed at the timeout with its whole process tree; a crashing job fails the
    test with the log tail (the helper's contract for every e2e test)."""
    import psutil

    (tmp_path / "hang_job.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('child', child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    (tmp_path / "crash_job.py").write_text("print('about to fail'); raise SystemExit('boom: bad config')\n")
    env = {"PYTHONPATH": str(tmp_path)}

    with pytest.raises(pytest.fail.Exception, match="timed out after 3s"):
        run_verl("hang_job", [], tmp_path, timeout=3, env=env, name="hang")
    child = int((tmp_path / "hang.log").read_text().split("child ")[1].split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE

    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited with 1.*about to fail.*boom: bad config"):
        run_verl("crash_job", ["x=1"], tmp_path, timeout=60, env=env, name="crash")
    result = run_verl("crash_job", [], tmp_path, timeout=60, env=env, name="crash", check=False)
    assert result.returncode == 1 and result.metrics == [] and "boom" in result.log_tail()


def test_a_job_whose_ray_cluster_timed_out_starting_runs_once_more(tmp_path):
    """Ray's hard-coded 30 s raylet wait (e2e.RAY_START_TIMEOUT), missed when two pytest workers start clusters at once
    on 2 cores: a job that trained nothing yet runs again; one that had trained a step fails as before."""
    from e2e import RAY_START_TIMEOUT

    (tmp_path / "flaky_start.py").write_text(
        "import pathlib, sys\n"
        "seen = pathlib.Path(sys.argv[1])\n"
        "if not seen.exists():\n"
        f"    seen.write_text('1'); print(sys.argv[2] + {RAY_START_TIMEOUT!r}); raise SystemExit(1)\n"
        "print('trained')\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    result = run_verl("flaky_start", [str(tmp_path / "first"), ""], tmp_path, timeout=60, env=env, name="flaky")
    assert result.returncode == 0 and "trained" in result.log_tail()
    assert RAY_START_TIMEOUT in (tmp_path / "flaky.ray_start_timeout.log").read_text()
    with pytest.raises(pytest.fail.Exception, match="exited with 1"):  # a step was logged before: no second run
        run_verl("flaky_start", [str(tmp_path / "second"), "step:1 "], tmp_path, timeout=60, env=env, name="late")


def test_time_table_records_every_job(tmp_path, monkeypatch):
    """MIX_E2E_TIMES: each job appends its test id, module, wall and CPU seconds and when its log first showed
    ray.init being called, Ray up and step 1; ``python tests/e2e.py <file>`` sums them per test file. (~4 s)"""
    from e2e import time_table

    (tmp_path / "fake_job.py").write_text(
        "import time\n"
        "def line(text, wait):\n"
        "    time.sleep(wait); print(text, flush=True)\n"
        "line('ray init kwargs: {}', 0.6)\n"
        "line('INFO worker.py:2038 -- Started a local Ray instance.', 0.6)\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.5: pass\n"  # half a second of CPU
        "line('(TaskRunner pid=1) step:1 - actor/pg_loss:0.1', 0.6)\n"
    )
    times = tmp_path / "times.jsonl"
    monkeypatch.setenv("MIX_E2E_TIMES", str(times))
    run_verl("fake_job", [], tmp_path, timeout=60, env={"PYTHONPATH": str(tmp_path)}, name="fake")
    run_verl("fake_job", [], tmp_path, timeout=60, env={"PYTHONPATH": str(tmp_path)}, name="fake2")
    first, second = (json.loads(line) for line in times.read_text().splitlines())
    assert first["test"] == "tests/test_cpu_backend.py::test_time_table_records_every_job"
    assert first["module"] == "fake_job" and first["returncode"] == 0
    assert 0.5 <= first["ray_init_s"] < first["ray_up_s"] < first["step1_s"] <= first["wall_s"]
    assert first["cpu_s"] >= 0.4  # the job's busy loop
    table = time_table(str(times)).splitlines()
    assert table[2].startswith("| tests/test_cpu_backend.py | 2 | ")
    assert f"{first['wall_s'] + second['wall_s']:.0f}" == table[2].split(" | ")[2]


def test_run_batch_gives_each_test_its_own_runs_result(tmp_path, monkeypatch):
    """A batch (tests/e2e.py run_batch) trains the selected tests' runs in one process and hands each its own
    metrics and status: a failed run fails only the test that reads it. The process is stood in for by a script
    that prints mix_modes_run.py's lines and writes verl's file-logger lines. (<1 s)"""
    import e2e

    fake = tmp_path / "fake_modes_run.py"
    fake.write_text(
        "import json, os, sys\n"
        "runs = json.load(open(sys.argv[1]))\n"
        "for i, (name, overrides) in enumerate(runs.items()):\n"
        "    if 'fail=1' in overrides:\n"
        "        print(f'MIX_MODES_RUN {name} FAILED 0.5s'); continue\n"
        "    os.makedirs(os.path.join(os.environ['VERL_FILE_LOGGER_ROOT'], 'e2e'), exist_ok=True)\n"
        "    with open(os.path.join(os.environ['VERL_FILE_LOGGER_ROOT'], 'e2e', name + '.jsonl'), 'w') as f:\n"
        "        f.write(json.dumps({'step': 1, 'data': {'x': i}}) + '\\n')\n"
        "    print(f'MIX_MODES_RUN {name} ok 1.5s')\n"
        "sys.exit(1)\n"  # as mix_modes_run: the number of failed runs
    )
    monkeypatch.setattr(e2e, "BATCHES", {})
    monkeypatch.setattr(e2e, "run_command", lambda cmd, *a, **kw: run_command([cmd[0], str(fake), *cmd[2:]], *a, **kw))
    e2e.batch_run("b", "one", lambda assets, d: ["trainer.project_name=e2e"], ["f.py::test_one"])
    e2e.batch_run("b", "bad", lambda assets, d: ["fail=1"], ["f.py::test_bad"])
    e2e.batch_run("b", "two", lambda assets, d: [f"dir={d}"], ["f.py::test_two"])
    e2e.batch_run("b", "unread", lambda assets, d: [], ["f.py::test_deselected"])
    results = e2e.run_batch("b", {"f.py::test_one", "f.py::test_bad", "f.py::test_two"}, {}, tmp_path / "b")
    assert list(results) == ["one", "bad", "two"]  # the selected tests' runs, in registration order
    assert e2e.batch_result(results, "one").metrics == [{"step": 1, "x": 0}] and results["one"].wall_s == 1.5
    assert e2e.batch_result(results, "two").metrics == [{"step": 1, "x": 2}]
    with pytest.raises(pytest.fail.Exception, match=r"(?s)run 'bad' of the batch failed \(exit 1\).*bad FAILED"):
        e2e.batch_result(results, "bad")


def test_server_takes_verls_lora_base_sync_then_adapter_sync(tiny_assets, tiny):
    """LoRA with verl's adapter sync (model.lora.merge=False; verl/workers/engine_workers.py update_weights): the
    first sync sends base weights with peft's ``base_layer`` names, every later one the adapter tensors of
    ``get_peft_model_state_dict`` with the peft config. The server then scores tokens as the actor's peft model."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mix_src.cpu.hf_rollout import HFRolloutServer, HFServerAdapter

    model, tok, prompt = tiny
    config = RolloutConfig(name="hf", prompt_length=32, response_length=8, tensor_model_parallel_size=1,
                           dtype="float32")
    server = HFRolloutServer(config, HFModelConfig(path=tiny_assets["model"], tokenizer_path=tiny_assets["tokenizer"]))
    actor = get_peft_model(type(model)(model.config).eval(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    actor.load_state_dict(model.state_dict(), strict=False)  # base weights of the tiny model
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter (peft initialises lora_B to 0)
            elif "lora_" not in name:
                p.add_(0.01 * torch.randn_like(p))  # and moved base weights, which only the base sync carries

    class Handle:  # the adapter's Ray handle, in-process
        def __getattr__(self, method):
            return type("M", (), {"remote": staticmethod(getattr(server, method))})

    adapter = HFServerAdapter.__new__(HFServerAdapter)
    adapter.rollout_rank, adapter._server = 0, Handle()
    peft_config = actor.peft_config["default"].to_dict()  # as verl's engine returns it (transformer_impl.py:1060)
    base = {k.removeprefix("base_model.model."): v for k, v in actor.state_dict().items() if "lora_" not in k}
    assert any(".base_layer." in k for k in base)  # verl's replace_lora_wrapper spelling
    asyncio.run(adapter.update_weights(iter(base.items()), peft_config=peft_config, base_sync_done=False))
    lora = get_peft_model_state_dict(actor)
    asyncio.run(adapter.update_weights(iter(lora.items()), peft_config=peft_config, base_sync_done=True, global_steps=2))
    assert server.get_stats()["lora_syncs"] == 1

    greedy = {"temperature": 0.0, "logprobs": True, "ignore_eos": True}
    out = asyncio.run(server.generate(prompt, greedy, "r0"))
    ref, _ = reference_logprobs(actor, prompt, out.token_ids, 0.0)
    torch.testing.assert_close(torch.tensor(out.log_probs), ref, atol=1e-5, rtol=0)
    with actor.disable_adapter():  # the adapter changes what the server computes
        base_lp, _ = reference_logprobs(actor, prompt, out.token_ids, 0.0)
    assert (base_lp - ref).abs().max() > 1e-3

    # model.lora.merge=True: verl sends merged full weights under plain HF names and peft_config=None
    # (transformer_impl._merged_lora_per_tensor_param); a fresh server loads them as any update
    import copy

    merged = copy.deepcopy(actor).merge_and_unload()
    server2 = HFRolloutServer(config, HFModelConfig(path=tiny_assets["model"], tokenizer_path=tiny_assets["tokenizer"]))
    adapter._server = type("H", (), {"__getattr__": lambda self, m: type("M", (), {"remote": staticmethod(getattr(server2, m))})})()
    asyncio.run(adapter.update_weights(iter(merged.state_dict().items()), peft_config=None, base_sync_done=True))
    out2 = asyncio.run(server2.generate(prompt, greedy, "r1"))
    assert out2.token_ids == out.token_ids
    torch.testing.assert_close(torch.tensor(out2.log_probs), ref, atol=1e-4, rtol=0)
