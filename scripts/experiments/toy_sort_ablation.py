"""Why RL lowered accuracy on the sort task (issue #40): the RL step in plain PyTorch, one knob at a time.

The evidence grid's sort RL runs (``compare.py``; ``recipes/toy_addition/base.yaml``'s settings) all lost
accuracy. This script re-implements their step with no Ray, as ``luffy_replica.py`` does for addition (same
maths: ``mix_src.algo.core_alg.compute_token_on_off_policy_loss`` / ``agg_loss``, the functions the worker loss
calls), so that each suspect can be switched off cheaply (~10-20 s a step on the shared 2-core machine):

* 32 training prompts per step drawn without replacement (``random.Random(seed)``); ``grpo``: 8 samples each,
  ``luffy``: the whole expert trace + EOS and 7 samples (temperature 1, no top-k/top-p, at most 24 tokens);
* reward ``scripts.experiments.toy_tasks.sort.compute_score``; A = R - mean(R over the group of 8) (no std);
* old log-probs from the pre-update model; 2 mini-batches of 16 prompts; loss = LUFFY's token loss
  (``grpo``: PPO clip 0.2; ``luffy``: p/(p+0.1) on expert tokens, no clip), token sum / 24, minus
  ``entropy`` x entropy, plus ``kl`` x low-var KL to the starting model; AdamW (weight decay 0.01, a fresh
  state as every run of the grid has), grad-norm clip 1.0, constant lr;
* ``sft``: the same optimiser on the expert traces' NLL (32 traces, one step) - the control that tells a
  destructive RL gradient from a destructive optimiser start.

Held-out accuracy is the harness's evaluator (``toy_sort.evaluate_rows``: greedy, 200 problems). That
evaluator seeds torch with 0, so the sampler restarts from seed 0 after each evaluation and ``--seed``
varies the problems drawn. Departures from the trainer: other random streams, one fp32 model for rollout and
update, no trainer validation or FLOPs budget (a fixed number of steps).

Usage::

    python -m scripts.experiments.toy_sort_ablation run --model DIR [--assets outputs/toy_sort] [--loss grpo]
        [--lr 5e-4] [--entropy 0.001] [--kl 0] [--steps 4] [--seed 0] [--eval-every 1] [--save DIR] [--out FILE]
    python -m scripts.experiments.toy_sort_ablation table FILE.json ... (arm = the file's parent folder)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time

from scripts.experiments.toy_tasks import sort as task
from scripts.experiments import toy_addition as ta
from scripts.experiments import toy_sort as ts

GROUP, BATCH, RESPONSE_LEN, CLIP, GAMMA = 8, 32, 24, 0.2, 0.1


def _rollout(model, tok, prompts: list[str], loss: str, n: int, plen: int):
    """Responses (token lists ending in EOS when they stopped) and their rewards, ``n`` per prompt."""
    import torch

    eos, pad = tok.eos_token_id, tok.pad_token_id
    if loss == "sft":
        rows = [tok.encode(task.expert_trace(s), add_special_tokens=False) + [eos] for s in prompts for _ in range(n)]
        return rows, [1.0] * len(rows)
    with torch.no_grad():
        ids = torch.tensor([ts._prompt_ids(tok, s) for s in prompts for _ in range(n)])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=RESPONSE_LEN, pad_token_id=pad, eos_token_id=eos)
    gen = gen[:, plen:].tolist()
    rows, rewards = [], []
    for i, s in enumerate(prompts):
        for j in range(n):
            resp = gen[i * n + j]
            resp = resp[: resp.index(eos) + 1] if eos in resp else resp
            if loss == "luffy" and j == 0:
                resp = tok.encode(task.expert_trace(s), add_special_tokens=False) + [eos]
            text = tok.decode([t for t in resp if t != eos])
            rewards.append(task.compute_score(task.DATA_SOURCE, text, "".join(sorted(s)))["score"])
            rows.append(resp)
    return rows, rewards


def run(model_dir: str, assets: str, loss: str = "grpo", lr: float = 5e-4, entropy: float = 1e-3, kl: float = 0.0,
        steps: int = 4, seed: int = 0, eval_every: int = 1, save: str | None = None, log=print) -> dict:
    """``steps`` steps from ``model_dir``; returns the held-out curve {step: greedy accuracy} and per-step stats."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM

    from mix_src.algo.core_alg import agg_loss, compute_token_on_off_policy_loss

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tok = ta.load_tokenizer(os.path.join(assets, "tokenizer"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = copy.deepcopy(model).eval() if kl else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    train = [p[0]["content"] for p in pd.read_parquet(os.path.join(assets, "train.parquet"))["prompt"]]
    heldout = os.path.join(assets, "heldout.parquet")
    rng = random.Random(seed)
    n, minibatches = (1, 1) if loss == "sft" else (GROUP, 2)

    def logprobs(m, ids, plen):
        logp = torch.log_softmax(m(input_ids=ids).logits[:, plen - 1 : -1].float(), -1)
        return logp.gather(-1, ids[:, plen:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def evaluate():
        return ts.evaluate_rows(model, tok, heldout, task.compute_score, RESPONSE_LEN)["acc"]

    curve, stats, t0 = {0: evaluate()}, {}, time.time()
    log(f"step 0 held-out {curve[0]:.3f}")
    for step in range(1, steps + 1):
        prompts = rng.sample(train, BATCH)
        plen = len(ts._prompt_ids(tok, prompts[0]))  # every templated 5-digit prompt has the same length
        model.eval()
        rows, rewards = _rollout(model, tok, prompts, loss, n, plen)
        model.train()
        r = torch.tensor(rewards).view(BATCH, n)
        ids = torch.full((BATCH * n, plen + RESPONSE_LEN), tok.pad_token_id)
        mask = torch.zeros(BATCH * n, RESPONSE_LEN)
        for i, resp in enumerate(rows):
            ids[i, :plen] = torch.tensor(ts._prompt_ids(tok, prompts[i // n]))
            ids[i, plen : plen + len(resp)] = torch.tensor(resp)
            mask[i, : len(resp)] = 1
        adv = (r - r.mean(1, keepdim=True)).view(-1)[:, None] * mask
        prefix = torch.zeros_like(mask).bool()
        if loss == "luffy":
            prefix[::n] = mask[::n].bool()
        with torch.no_grad():
            old, _ = logprobs(model, ids, plen)
        groups = torch.arange(BATCH * n).view(BATCH, n)
        for mb in range(minibatches):
            idx = groups[mb * BATCH // minibatches : (mb + 1) * BATCH // minibatches].reshape(-1)
            logp, ent = logprobs(model, ids[idx], plen)
            if loss == "sft":
                pg = agg_loss(-logp, mask[idx], "luffy-token-sum-norm", loss_scale_factor=RESPONSE_LEN)
            else:
                pg = compute_token_on_off_policy_loss(
                    old[idx], logp, adv[idx], mask[idx], prefix[idx], cliprange=CLIP, off_policy_reshape="p_div_p",
                    off_policy_reshape_gamma=GAMMA, loss_remove_clip=(loss == "luffy"),
                    loss_agg_mode="luffy-token-sum-norm", loss_scale_factor=RESPONSE_LEN,
                )["pg_loss"]  # fmt: skip
            total = pg - entropy * agg_loss(ent, mask[idx], "luffy-token-sum-norm", loss_scale_factor=RESPONSE_LEN)
            if kl:
                with torch.no_grad():
                    ref_logp, _ = logprobs(ref, ids[idx], plen)
                d = (ref_logp - logp).clamp(-20, 20)  # verl's low_var_kl: exp(d) - d - 1, clamped to [-10, 10]
                total = total + kl * agg_loss((d.exp() - d - 1).clamp(-10, 10), mask[idx], "luffy-token-sum-norm",
                                              loss_scale_factor=RESPONSE_LEN)
            opt.zero_grad(set_to_none=True)
            total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if step % eval_every == 0 or step == steps:
            curve[step] = evaluate()
        stats[step] = {"train_reward": r.mean().item(), "groups_with_signal": (r.std(1) > 0).float().mean().item(),
                       "grad_norm_last": grad_norm.item()}
        log(f"step {step}: train reward {stats[step]['train_reward']:.3f}, held-out {curve.get(step, float('nan')):.3f} "
            f"({time.time() - t0:.0f} s)")
    if save:
        model.save_pretrained(save)
    return {"curve": curve, "stats": stats, "wall_s": round(time.time() - t0, 1)}


def table(files: list[str]) -> str:
    """Markdown: arm (a file's parent folder) -> held-out % at step 0, 1 and the last step: mean [95% t CI] over
    seeds (per seed)."""
    from scripts.experiments.compare import t_interval

    arms: dict[str, list[dict]] = {}
    for f in files:
        arms.setdefault(os.path.basename(os.path.dirname(os.path.abspath(f))), []).append(json.load(open(f)))
    lines = ["| arm | seeds | held-out step 0 | after 1 step | after the last step (N) |", "|---|---|---:|---:|---:|"]
    for arm, runs in arms.items():
        def cell(key):
            vals = [r["curve"][key(r)] for r in runs]
            t = t_interval(vals)
            half = f" [{100 * t['lo']:.1f}, {100 * t['hi']:.1f}]" if len(runs) > 1 else ""
            each = f" ({' / '.join(f'{100 * v:.1f}' for v in vals)})" if len(set(vals)) > 1 else ""
            return f"{100 * t['mean']:.1f}{half}{each}"
        last = lambda r: max(r["curve"], key=int)  # noqa: E731
        lines.append(f"| {arm} | {', '.join(str(r['args']['seed']) for r in runs)} | {cell(lambda r: '0')} | "
                     f"{cell(lambda r: '1') if all('1' in r['curve'] for r in runs) else 'n/a'} | "
                     f"{cell(last)} ({', '.join(sorted({last(r) for r in runs}))}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--assets", default=ts.DEFAULT_OUT)
    r.add_argument("--loss", default="grpo", choices=["grpo", "luffy", "sft"])
    r.add_argument("--lr", type=float, default=5e-4)
    r.add_argument("--entropy", type=float, default=1e-3)
    r.add_argument("--kl", type=float, default=0.0)
    r.add_argument("--steps", type=int, default=4)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--eval-every", type=int, default=1)
    r.add_argument("--save", default=None)
    r.add_argument("--out", default=None, help="JSON of the run (its folder names the arm in `table`)")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    if a.cmd == "table":
        print(table(a.files))
        return 0
    args = {k: v for k, v in vars(a).items() if k not in ("cmd", "out")}
    res = {"args": args, **run(args["model"], **{k: v for k, v in args.items() if k != "model"})}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res["curve"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
