"""The GPU smoke test (``make smoke-gpu``): the whole LUFFY loop on one GPU in minutes, before a paper-size run.

Two real ``python -m mix_src.main_mix_ppo`` runs on the tiny arithmetic data (scripts/make_tiny_assets.py, with
LUFFY's ``target`` column):

1. 2 training steps with LUFFY on (1 of n rows the whole target + EOS), 1 validation and a checkpoint at step 2;
2. a resume from that checkpoint (``trainer.resume_mode=auto``) that trains step 3.

It prints tokens/s, the peak memory beside the planner's estimate (mix_src/planner), and PASS or FAIL with the
reason (exit 0 / 1). ``--backend gpu`` (default; ``SMOKE_BACKEND`` sets it too): one CUDA GPU, vLLM rollout,
FSDP, a small real model (``--model``: a Hub id or a local path; default Qwen/Qwen2.5-0.5B-Instruct), peak from
``nvidia-smi`` (all processes on the GPU), budget 10 minutes. ``--backend cpu``: the CPU backend (mix_src/cpu)
with the tiny random model; what CI runs. It checks the plumbing (configs, Ray, workers, checkpoint, resume),
not GPU kernels, vLLM or memory; the planner line there is for the named GPU, not the CPU.

``--model random:<shape>`` (either backend; shapes in scripts/gpu/random_model.py: qwen2.5-0.5b, qwen2.5-1.5b,
tiny) needs no Hub: a random-initialised model of that shape with a generated full-vocabulary tokenizer and
locally made data with full-length targets, built under ``--out``; the runs get ``HF_HUB_OFFLINE=1``,
``TRANSFORMERS_OFFLINE=1`` and ``actor_rollout_ref.rollout.ignore_eos=true``, so every row, prefixed or
sampled, is ``data.max_response_length`` tokens long, which the verdict checks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REWARD = ["reward.custom_reward_function.path=pkg://mix_src.rewards.math_verify_reward",
          "reward.custom_reward_function.name=compute_score"]
LUFFY = ["mix.n_prefix=1", "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0",  # the whole target + EOS
         "algorithm.adv_estimator=grpo_split", "mix.loss.loss_remove_clip=true"]
GPU_BUDGET_S = 600  # the bound for both runs on one 80 GB GPU

# Sizes per backend: the GPU run is small enough for minutes, large enough to exercise vLLM and FSDP for real.
SIZES = {
    "gpu": dict(batch=8, n=4, prompt=256, response=512, timeout=GPU_BUDGET_S),
    "cpu": dict(batch=2, n=2, prompt=32, response=32, timeout=300),  # 32: room for random:tiny's targets
}


def overrides(backend: str, assets: dict, model: str, out: Path, steps: int, *, resume: bool) -> list[str]:
    s = SIZES[backend]
    common = [
        f"data.train_files={assets['train']}", f"data.val_files={assets['val']}",
        f"data.train_batch_size={s['batch']}", f"data.max_prompt_length={s['prompt']}",
        f"data.max_response_length={s['response']}", f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.n={s['n']}", f"actor_rollout_ref.actor.ppo_mini_batch_size={s['batch']}",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
        "trainer.logger=[console,file]", "trainer.project_name=smoke", "trainer.experiment_name=smoke",
        f"trainer.default_local_dir={out / 'checkpoints'}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        *REWARD, *LUFFY,
    ]
    if resume:  # from the latest checkpoint in default_local_dir; nothing saved or validated again
        common += ["trainer.resume_mode=auto", "trainer.save_freq=-1", "trainer.test_freq=-1"]
    else:
        common += ["trainer.resume_mode=disable", f"trainer.save_freq={steps}", f"trainer.test_freq={steps}"]
    micro = s["batch"] * s["n"]
    if backend == "cpu":
        return ["+backend=cpu", f"++actor_rollout_ref.model.tokenizer_path={assets['tokenizer']}",
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
                f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}", *common]
    return ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.4", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192", *common]


def environment(backend: str, metrics: Path) -> dict:
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(metrics), PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)  # a private cluster per run
    if backend == "cpu":
        env.update(VERL_PLATFORM="cpu", OMP_NUM_THREADS="1")
    return env


class PeakGpuMemory:
    """Polls ``nvidia-smi`` every 0.5 s: the largest memory.used of GPU 0 (bytes), every process included."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=10).stdout
                self.peak = max(self.peak, int(out.split()[0]) * 2**20)
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run(backend: str, args: list[str], out: Path, name: str, timeout: float) -> tuple[int, list[dict], float, Path]:
    """One ``python -m mix_src.main_mix_ppo`` in its own session; returns (exit code, metrics per step, seconds, log)."""
    metrics, log = out / f"{name}_metrics.jsonl", out / f"{name}.log"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mix_src.main_mix_ppo", *args]
    start = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=out, env=environment(backend, metrics), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the run's own session: its Ray cluster included
            proc.wait()
            rc = 124
    return rc, read_metrics(metrics), time.monotonic() - start, log


def read_metrics(path: Path) -> list[dict]:
    """verl's file logger lines ``{"step": n, "data": {...}}``, merged per step."""
    steps: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                steps.setdefault(rec["step"], {"step": rec["step"]}).update(rec["data"])
    return [steps[k] for k in sorted(steps)]


def verdict(first: tuple, second: tuple, ckpt: Path, budget_s: float | None,
            full_length: int | None = None) -> str | None:
    """None when everything the smoke test checks held, else the first reason it failed. ``full_length``: every
    training step's responses (prefixed and sampled rows alike) must be that many tokens."""
    (rc1, m1, t1, log1), (rc2, m2, t2, log2) = first, second
    if rc1 != 0:
        return f"the 2-step run exited {rc1} (log {log1})"
    if [m["step"] for m in m1] != [1, 2]:
        return f"the 2-step run logged steps {[m['step'] for m in m1]}, not [1, 2] (log {log1})"
    if not any(k.startswith("val") for k in m1[-1]):
        return f"no validation metrics at step 2 (log {log1})"
    if not (ckpt / "global_step_2" / "actor").is_dir():
        return f"no checkpoint {ckpt / 'global_step_2' / 'actor'}"
    if rc2 != 0:
        return f"the resumed run exited {rc2} (log {log2})"
    if [m["step"] for m in m2] != [3]:
        return f"the resumed run logged steps {[m['step'] for m in m2]}, not [3]: it did not resume (log {log2})"
    for m in (m1 + m2) if full_length else ():
        lengths = (m.get("response_length/min"), m.get("response_length/max"))
        if lengths != (full_length, full_length):
            return f"step {m['step']}: response lengths (min, max) {lengths}, not all {full_length} (log {log1})"
    if budget_s is not None and t1 + t2 > budget_s:
        return f"both runs took {t1 + t2:.0f} s > {budget_s} s"
    return None


def tokens_per_s(metrics: list[dict]) -> float:
    """Tokens trained per second of step time over the logged steps (verl's perf/total_num_tokens, timing_s/step)."""
    tokens = sum(m.get("perf/total_num_tokens", 0) for m in metrics)
    seconds = sum(m.get("timing_s/step", 0) for m in metrics)
    return tokens / seconds if seconds else float("nan")


def planner_line(backend: str, args: list[str], model: str, gpu: str) -> str:
    """The planner's peak for this run's config on ``gpu``."""
    from mix_src.planner.__main__ import compose
    from mix_src.planner.check import load_model_config, run_shape
    from mix_src.planner.estimate import ERROR_BOUND, GB, GPUS, plan_memory

    hf, source = load_model_config(model)
    if hf is None:
        return f"planner: not estimated ({source})"
    cfg = compose(str(REPO / "mix_src" / "config"), "mix_ppo", [a for a in args if not a.startswith("+backend")])
    plan = plan_memory(hf, run_shape(cfg), GPUS[gpu])
    return f"planner ({GPUS[gpu].name}): peak {plan.peak / GB:.1f} GB +/- {ERROR_BOUND:.0%} ({plan.peak_phase})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["gpu", "cpu"], default=os.environ.get("SMOKE_BACKEND", "gpu"))
    ap.add_argument("--model", help="Hub id or local path (gpu; default Qwen/Qwen2.5-0.5B-Instruct), or random:<shape> "
                    "(either backend; no Hub: scripts/gpu/random_model.py)")
    ap.add_argument("--out", default=str(REPO / "outputs" / "smoke"), help="assets, logs, checkpoints")
    ap.add_argument("--gpu", default="h100-80gb", help="the planner's GPU for the estimate line")
    ap.add_argument("extra", nargs="*", help="Hydra overrides added to both runs (e.g. recipes/common.sh's SDPA set)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    random_model = (a.model or "").startswith("random:")
    if random_model:  # no Hub: the shape built here, the runs offline (HF_HUB_OFFLINE in their environment)
        from scripts.gpu import random_model as rm

        rm.offline()
        assets = rm.build(a.model, str(out / "assets" / rm.shape_of(a.model)),
                          response_length=SIZES[a.backend]["response"])
        a.extra = ["actor_rollout_ref.rollout.ignore_eos=true", *a.extra]  # sampled rows as long as prefixed ones
    else:
        from scripts.make_tiny_assets import build

        assets = build(str(out / "assets"), seed=0)
    model = assets["model"] if a.backend == "cpu" or random_model else (a.model or "Qwen/Qwen2.5-0.5B-Instruct")
    timeout = SIZES[a.backend]["timeout"]
    ckpt = out / "checkpoints"
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)  # a stale checkpoint would be resumed by the first run's successor
    print(f"[smoke] backend={a.backend} model={model} out={out}", flush=True)
    peak = PeakGpuMemory() if a.backend == "gpu" else None
    if peak:
        peak.__enter__()
    try:
        first = run(a.backend, overrides(a.backend, assets, model, out, 2, resume=False) + a.extra, out, "train",
                    timeout)
        print(f"[smoke] 2 steps + validation + save: exit {first[0]} in {first[2]:.0f} s", flush=True)
        second = run(a.backend, overrides(a.backend, assets, model, out, 3, resume=True) + a.extra, out, "resume",
                     timeout)
        print(f"[smoke] resume + step 3: exit {second[0]} in {second[2]:.0f} s", flush=True)
    finally:
        if peak:
            peak.__exit__()
    print(f"[smoke] tokens/s (training steps): {tokens_per_s(first[1] + second[1]):.1f}")
    try:
        line = planner_line(a.backend, overrides(a.backend, assets, model, out, 2, resume=False) + a.extra, model, a.gpu)
        print(f"[smoke] {line}" + (" (this config on that GPU; the CPU run is not comparable)" if a.backend == "cpu" else ""))
    except Exception as e:  # noqa: BLE001  (the estimate line never decides PASS/FAIL)
        print(f"[smoke] planner: not estimated ({type(e).__name__}: {e})")
    if peak:
        print(f"[smoke] measured peak GPU memory (nvidia-smi, all processes): {peak.peak / 1e9:.1f} GB")
    else:
        print("[smoke] measured peak: not on the CPU backend (it checks the plumbing, not GPU memory)")
    why = verdict(first, second, ckpt, GPU_BUDGET_S if a.backend == "gpu" else None,
                  SIZES[a.backend]["response"] if random_model else None)
    print(f"[smoke] {'PASS' if why is None else 'FAIL: ' + why}")
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main())
