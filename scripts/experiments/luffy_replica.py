"""Plain-PyTorch replica of the toy LUFFY / on-policy GRPO loop: a diagnostic, not the experiment.

The experiment runs through the real trainer (``recipes/toy_addition``, ``luffy_vs_grpo.py``). This script
re-implements the same step with no Ray and no verl workers, so that a trainer result can be classified as
a bug or a property of the algorithm, and so that budgets the trainer cannot afford on 2 CPU cores (it takes
~6 s per step here, this loop ~1 s) can be explored. The maths is shared: the token loss and its aggregation
are ``mix_src.algo.core_alg.compute_token_on_off_policy_loss`` / ``agg_loss`` (what the worker loss calls).

One step, as ``recipes/toy_addition/{luffy,on_policy_grpo}.yaml`` configure the trainer:
  * 32 training prompts drawn without replacement from train.parquet (the trainer shuffles epochs instead);
  * luffy: per prompt the whole expert trace + EOS (prefix ratio 1.0) and 7 samples; grpo: 8 samples
    (temperature 1, no top-k/top-p, at most 16 tokens);
  * reward ``scripts.experiments.toy_tasks.addition.compute_score``; A = R - mean(R over the group of 8) (no std);
  * old log-probs from the pre-update model; 2 mini-batches of 16 prompts, loss = LUFFY's token loss
    (p/(p+0.1) on expert tokens; luffy: no clip; grpo: PPO clip 0.2), token sum / 16, minus 0.001 x entropy
    (same aggregation); AdamW (weight decay 0.01), grad-norm clip 1.0, constant lr.
Departures from the trainer: sampling and data order use other random streams; no rollout/actor log-prob
mismatch (one fp32 model does both).

Usage::

    python -m scripts.experiments.luffy_replica --method luffy --lr 5e-4 --steps 300 --seed 0 [--eval-every 25]
        [--out outputs/toy_addition/replica/luffy_lr5e-4_seed0.json] [--base MODEL_DIR] [--zero-on-policy-reward]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from scripts.experiments.toy_tasks import addition as task
from scripts.experiments import toy_addition as ta

RESPONSE_LEN, N, ENTROPY_COEFF, CLIP = 16, 8, 0.001, 0.2


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from mix_src.algo.core_alg import agg_loss, compute_token_on_off_policy_loss

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=["luffy", "on_policy_grpo"], default="luffy")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--assets", default=ta.DEFAULT_OUT)
    p.add_argument("--variant", default="addition3", choices=sorted(ta.VARIANTS))
    p.add_argument("--out", default=None)
    p.add_argument("--base", default=None, help="start from this base model instead of the prepared one (the "
                   "tokenizer and parquets are read from --assets as they are)")
    p.add_argument("--zero-on-policy-reward", action="store_true", help="diagnostic: score every sampled response "
                   "0, so only the expert trace earns a reward (what a base with no sampled success would give)")
    a = p.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    if a.base is None:
        prep = ta.prepare(a.assets, seed=0, variant=a.variant)
    else:
        prep = {"model": a.base, "tokenizer": os.path.join(a.assets, "tokenizer"),
                "train": os.path.join(a.assets, "train.parquet"), "heldout": os.path.join(a.assets, "heldout.parquet")}
    tok = ta.load_tokenizer(prep["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(prep["model"], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    train, held = ta.read_problems(prep["train"]), ta.read_problems(prep["heldout"])
    eos, pad = tok.eos_token_id, tok.pad_token_id
    n_off = 1 if a.method == "luffy" else 0
    rng = random.Random(a.seed)

    def logprobs_entropy(ids, plen):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, plen - 1 : -1].float(), -1)
        return logp.gather(-1, ids[:, plen:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    curve, t0 = {}, time.time()
    for step in range(a.steps + 1):
        if step % a.eval_every == 0:
            curve[step] = ta.evaluate(model, tok, held)["acc"]
            model.train()
            print(f"step {step} held-out greedy acc {curve[step]:.3f} ({time.time() - t0:.0f}s)", flush=True)
        if step == a.steps:
            break
        probs = rng.sample(train, a.batch)
        pids = [ta.prompt_ids(tok, x, y) for x, y in probs]
        plen = len(pids[0])  # every templated prompt has the same length
        model.eval()
        with torch.no_grad():
            ids = torch.tensor([pid for pid in pids for _ in range(N - n_off)])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=RESPONSE_LEN, pad_token_id=pad, eos_token_id=eos)
        gen = gen[:, plen:].tolist()
        model.train()
        rows, prefix, rewards = [], [], []
        for i, (x, y) in enumerate(probs):
            for j in range(N):
                if j < n_off:
                    resp = tok.encode(task.expert_trace(x, y), add_special_tokens=False) + [eos]
                else:
                    resp = gen[i * (N - n_off) + j - n_off]
                    resp = resp[: resp.index(eos) + 1] if eos in resp else resp
                score = task.compute_score("", tok.decode([t for t in resp if t != eos]), str(x + y))["score"]
                rewards.append(0.0 if a.zero_on_policy_reward and j >= n_off else score)
                rows.append(resp)
                prefix.append(float(j < n_off))
        r = torch.tensor(rewards).view(a.batch, N)
        adv_row = (r - r.mean(1, keepdim=True)).view(-1)
        ids = torch.full((a.batch * N, plen + RESPONSE_LEN), pad)
        mask = torch.zeros(a.batch * N, RESPONSE_LEN)
        for i, resp in enumerate(rows):
            ids[i, :plen] = torch.tensor(pids[i // N])
            ids[i, plen : plen + len(resp)] = torch.tensor(resp)
            mask[i, : len(resp)] = 1
        prefix_mask = (torch.tensor(prefix)[:, None] * mask).bool()
        adv = adv_row[:, None] * mask
        with torch.no_grad():
            old, _ = logprobs_entropy(ids, plen)
        groups = torch.arange(a.batch * N).view(a.batch, N)
        for mb in range(2):
            idx = groups[mb * a.batch // 2 : (mb + 1) * a.batch // 2].reshape(-1)
            logp, ent = logprobs_entropy(ids[idx], plen)
            out = compute_token_on_off_policy_loss(
                old[idx], logp, adv[idx], mask[idx], prefix_mask[idx], cliprange=CLIP,
                off_policy_reshape="p_div_p", off_policy_reshape_gamma=0.1, loss_remove_clip=(a.method == "luffy"),
                loss_agg_mode="luffy-token-sum-norm", loss_scale_factor=RESPONSE_LEN,
            )  # fmt: skip
            ent_loss = agg_loss(ent, mask[idx], "luffy-token-sum-norm", loss_scale_factor=RESPONSE_LEN)
            loss = out["pg_loss"] - ENTROPY_COEFF * ent_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if step % 25 == 0:
            on = r[:, n_off:].mean().item()
            h = ((ent * mask[idx]).sum() / mask[idx].sum()).item()
            print(f"  step {step}: on-policy solved {on:.3f}, expert-token p {out['off_policy_prob'].item():.3f}, "
                  f"entropy {h:.3f}", flush=True)
    res = {"method": a.method, "lr": a.lr, "seed": a.seed, "steps": a.steps, "batch": a.batch, "curve": curve,
           "base": a.base, "zero_on_policy_reward": a.zero_on_policy_reward,
           "wall_s": round(time.time() - t0, 1)}
    out_path = a.out or os.path.join(a.assets, "replica", f"{a.method}_lr{a.lr:g}_seed{a.seed}_steps{a.steps}.json")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
