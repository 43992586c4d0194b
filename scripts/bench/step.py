"""Step-time overhead of the MIX trainer on CPU, two modes.

``python -m scripts.bench step --toy [--steps N] [--assets DIR]``: the toy-addition LUFFY step
(``recipes/toy_addition/luffy.yaml``: 32 prompts x n 8, responses <= 16 tokens, the 0.5M-parameter base
model) through ``python -m mix_src.main_mix_ppo``, then a plain-PyTorch reference loop in this process on the
same model and batch shape (sample 32 x 7 responses with ``model.generate``, log-probs of the 256 rows, one
update of 2 mini-batches with AdamW; no Ray, no verl). Prints the median per-stage times of both (first step
excluded: warm-up) and the ratio MIX / reference. The reference runs with 1 torch thread, as the Ray workers
do (``OMP_NUM_THREADS=1``).

``python -m scripts.bench step [--steps N] [--n N] [--batch B]``: runs the CPU tiny config twice in one invocation, side by side on the same assets and sizes: verl's stock
``python -m verl.trainer.main_ppo`` (GRPO, legacy trainer) and ``python -m mix_src.main_mix_ppo`` with
``mix.n_prefix=0`` (same GRPO maths through our trainer, agent loop and loss). Prints the median
``timing_s/step`` of each (first step excluded: warm-up) and the ratio MIX / stock (target <= 1.10).
Run from the repository root of a source checkout (it reuses tests/e2e.py and scripts/make_tiny_assets.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _helpers():
    import importlib.util

    from scripts import make_tiny_assets

    # the test suite's e2e job runner, loaded by path: tests/ is not a package (and site-packages may hold
    # an unrelated top-level "tests" package)
    spec = importlib.util.spec_from_file_location("mix_tests_e2e", REPO / "tests" / "e2e.py")
    e2e = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = e2e  # dataclasses look their module up while the module executes
    spec.loader.exec_module(e2e)
    return e2e, make_tiny_assets


# verl's stage timers of one MIX step (timing_s/<key>), in step order; "step" is the whole step.
TOY_STAGES = ["gen", "old_log_prob", "adv", "update_actor", "update_weights", "step"]


def toy_reference(assets: dict, steps: int, batch: int = 32, n: int = 8, response_length: int = 16) -> list[dict]:
    """Plain-torch LUFFY-shaped step on the toy base model: per-stage seconds of each of ``steps`` steps."""
    import random
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from scripts.experiments import toy_addition as ta

    from mix_src.algo.core_alg import agg_loss, compute_token_on_off_policy_loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        tok = ta.load_tokenizer(assets["tokenizer"])
        model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32, attn_implementation="eager")
        opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
        problems = ta.read_problems(assets["train"])
        eos, pad = tok.eos_token_id, tok.pad_token_id
        rng = random.Random(0)
        out = []
        for _ in range(steps):
            t = {}
            start = time.perf_counter()
            pids = [ta.prompt_ids(tok, x, y) for x, y in rng.sample(problems, batch)]
            plen = len(pids[0])
            model.eval()
            with torch.no_grad():  # 1 demonstration + (n - 1) samples per prompt, as LUFFY's n_prefix=1
                ids = torch.tensor([p for p in pids for _ in range(n - 1)])
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=response_length,
                                     pad_token_id=pad, eos_token_id=eos)
            gen = gen[:, plen:]
            ids = torch.full((batch * n, plen + response_length), pad)
            ids[:, :plen] = torch.tensor(pids).repeat_interleave(n, 0)
            ids[[i for i in range(batch * n) if i % n], plen : plen + gen.shape[1]] = gen
            mask = (ids[:, plen:] != pad).float()
            prefix = torch.zeros_like(mask, dtype=torch.bool)
            prefix[::n] = mask[::n].bool()
            adv = torch.randn(batch * n, 1) * mask
            t["gen"] = time.perf_counter() - start

            def logprobs_entropy(x):
                logp = torch.log_softmax(model(input_ids=x).logits[:, plen - 1 : -1].float(), -1)
                return logp.gather(-1, x[:, plen:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

            start = time.perf_counter()
            with torch.no_grad():
                old, _ = logprobs_entropy(ids)
            t["old_log_prob"] = time.perf_counter() - start
            start = time.perf_counter()
            model.train()
            for half in (slice(0, batch * n // 2), slice(batch * n // 2, batch * n)):
                logp, ent = logprobs_entropy(ids[half])
                loss = compute_token_on_off_policy_loss(
                    old[half], logp, adv[half], mask[half], prefix[half], cliprange=0.2,
                    off_policy_reshape="p_div_p", off_policy_reshape_gamma=0.1, loss_remove_clip=True,
                    loss_agg_mode="luffy-token-sum-norm", loss_scale_factor=response_length,
                )["pg_loss"] - 0.001 * agg_loss(ent, mask[half], "luffy-token-sum-norm", loss_scale_factor=response_length)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            t["update_actor"] = time.perf_counter() - start
            t["step"] = t["gen"] + t["old_log_prob"] + t["update_actor"]
            out.append(t)
        return out
    finally:
        torch.set_num_threads(threads)


def toy_main(args) -> None:
    e2e, _ = _helpers()
    from scripts.experiments import toy_addition as ta

    assets = ta.prepare(args.assets, seed=0, log=lambda *a, **k: None)
    with tempfile.TemporaryDirectory(prefix="mix_bench_toy_") as tmp:
        overrides = [
            f"--config-path={REPO / 'recipes' / 'toy_addition'}",
            "--config-name=luffy",
            f"actor_rollout_ref.model.path={assets['model']}",
            f"actor_rollout_ref.model.tokenizer_path={assets['tokenizer']}",
            f"data.train_files={assets['train']}",
            f"data.val_files={assets['heldout']}",
            f"trainer.total_training_steps={args.steps}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.logger=[console,file]",
        ]
        print(f"running MIX toy_addition luffy ({args.steps} steps) ...", flush=True)
        result = e2e.run_verl("mix_src.main_mix_ppo", overrides, Path(tmp), timeout=1200, name="bench_toy")
    mix = [{k: m.get(f"timing_s/{k}", 0.0) for k in TOY_STAGES} for m in result.metrics]
    if len(mix) < 2:
        raise SystemExit(f"only {len(mix)} steps logged")
    print(f"running the plain-torch reference ({args.steps} steps) ...", flush=True)
    ref = toy_reference(assets, args.steps)

    def med(rows, key):
        vals = [r[key] for r in rows[1:] if key in r]
        return statistics.median(vals) if vals else float("nan")

    print("\ntoy_addition LUFFY step: 32 prompts x n 8 (1 demonstration + 7 samples), responses <= 16 tokens; "
          f"median of steps 2..{args.steps}, seconds")
    print(f"{'stage':16s} {'MIX':>8s} {'reference':>10s}")
    for key in TOY_STAGES:
        r = med(ref, key) if key in ref[0] else float("nan")
        print(f"{key:16s} {med(mix, key):8.3f} {r:10.3f}")
    print(f"MIX step times: {[round(m['step'], 2) for m in mix]}")
    print(f"\nstep-time ratio MIX / plain-torch reference = {med(mix, 'step') / med(ref, 'step'):.2f}")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench step")
    ap.add_argument("--toy", action="store_true", help="toy-addition LUFFY step vs a plain-torch reference")
    ap.add_argument("--assets", default=str(REPO / "outputs" / "toy_addition"), help="toy assets (built if missing)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--response-length", type=int, default=32)
    args = ap.parse_args(argv)
    if args.toy:
        return toy_main(args)
    e2e, assets_mod = _helpers()

    with tempfile.TemporaryDirectory(prefix="mix_bench_step_") as tmp:
        tmp = Path(tmp)
        assets = assets_mod.build(str(tmp / "assets"), seed=0)
        common = e2e.tiny_overrides(
            assets, steps=args.steps, batch_size=args.batch, n=args.n, response_length=args.response_length
        ) + ["algorithm.adv_estimator=grpo", "trainer.use_v1=false"]
        runs = {
            "stock verl GRPO": ("verl.trainer.main_ppo", e2e.STOCK_VERL_CPU + common),
            "MIX n_prefix=0": ("mix_src.main_mix_ppo", e2e.MIX_CPU + common + ["mix.n_prefix=0"]),
        }
        rows = {}
        for label, (module, overrides) in runs.items():
            print(f"running {label} ({args.steps} steps) ...", flush=True)
            result = e2e.run_verl(module, overrides, tmp / label.split()[0], timeout=900, name="bench")
            steps = result.series("timing_s/step")
            if len(steps) < 2:
                raise SystemExit(f"{label}: only {len(steps)} steps logged; see {result.log_path}")
            rows[label] = (statistics.median(steps[1:]), steps, result.wall_s, result.peak_rss_mb)

    print(f"\nCPU tiny config: batch {args.batch} prompts x n={args.n}, response <= {args.response_length} tokens")
    print(f"{'run':18s} {'median step s':>14s} {'wall s':>8s} {'peak RSS MB':>12s}  step times")
    for label, (median, steps, wall, rss) in rows.items():
        print(f"{label:18s} {median:14.3f} {wall:8.1f} {rss:12.0f}  {[round(s, 2) for s in steps]}")
    base, mix = rows["stock verl GRPO"][0], rows["MIX n_prefix=0"][0]
    print(f"\nstep-time ratio MIX / stock = {mix / base:.3f}  (target <= 1.10)")
