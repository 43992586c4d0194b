"""Diagnostic: build candidate bases for the toy-addition demo variant by other pre-training rules and measure the
two sides of the demo's story on each (plain torch, no Ray). Not part of `make demo`; the measurements are the
"base-building rules" table of recipes/toy_addition/README.md.

Rules (what the base is pre-trained on; none shows a column receiving a carry):
  carry_free         the demo's: any 2-digit problem, carry-free trace (the stream of ``toy_addition.pretrain_base``)
  no_incoming_carry  only problems no column of which receives a carry, correct traces (``PRETRAIN_DATA``)
  one_digit          no_incoming_carry plus a share (``--one-digit-share``) of 1-digit problems (``7+8`` ->
                     ``51>15``: the units column's carry writes the sum's leading digit)
  one_digit_masked   one_digit with no loss on what follows a 1-digit problem's units pair (its ``>``)
  carry_free_masked  carry-free traces with no loss on a carry token that is wrong (its column sums to >= 10)
  carry_free_no_carry_loss  carry-free traces with no loss on any carry token
  carry_free_soft    carry-free traces whose wrong carry tokens (the column sums to >= 10) are trained towards a
                     soft target: ``1`` with probability ``--carry-q``, ``0`` with 1 - q; every other token as
                     ``carry_free``. The base copies as sharply as further steps make it, while the probability
                     it gives the correct carry stays near q instead of decaying with every step
  faint_carry        carry_free_soft, and each problem with a carry also as its correct trace, with loss only on
                     the tokens after its first carry: a base that writes the correct carry with probability
                     ~q and, once it has, finishes the sum correctly (a faint correct prior, one token deep)

``--ship DIR`` also writes the base as `make demo`'s shipped base (``recipes/toy_addition/demo_base``: the model
files and a BUILD.json with the rule, steps, seed, this command, the commit, the machine, the weights' SHA-256 and
the measurement); the printed SHA-256 goes in ``scripts/experiments/toy_addition.py`` (``VARIANTS["demo"]``).

For each base: the sampled success rate on the 892 training problems (32 samples each, temperature 1, the
rollout's sampler, full count) and E = p x 10,240; the teacher-forced probability of the expert's carry token
(mean, 10% quantile) and of every expert token (mean and median by position); greedy accuracy on held-out, OOD
and carry-free problems. Appends one JSON line to ``--results``.

Usage::

    python -m scripts.experiments.demo_base_rules RULE STEPS [--seed 0] [--assets DIR] [--results FILE] [--ship DIR]
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

RULES = ("carry_free", "no_incoming_carry", "one_digit", "one_digit_masked", "carry_free_masked", "carry_free_no_carry_loss",
         "carry_free_soft", "faint_carry")
SOFT_RULES = ("carry_free_soft", "faint_carry")  # the rules that train the carry towards --carry-q (soft_step)


def batch_of(rule: str, n: int, rng: random.Random, one_digit_share: float) -> list[tuple[int, int, str]]:
    if rule in ("carry_free", "no_incoming_carry"):
        return ta.pretrain_examples(rule, n, rng, 2)
    if rule in ("carry_free_masked", "carry_free_no_carry_loss", *SOFT_RULES):
        return ta.pretrain_examples("carry_free", n, rng, 2)
    out, seen = [], set()  # one_digit
    while len(out) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < one_digit_share:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
        elif not task.no_incoming_carry(a, b):
            continue
        if (a, b) not in seen:
            seen.add((a, b))
            out.append((a, b, task.expert_trace(a, b)))
    return out


def soft_step(model, opt, sched, ids, labels, attention_mask, soft, q: float, zero: int, one: int):
    """``toy_addition.pretrain_step`` with a soft target at the label positions ``soft`` [(row, col)]: the loss
    there is -(1 - q) log p(``zero``) - q log p(``one``) instead of -log p(label). Mean over all label tokens."""
    import torch

    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention_mask).logits.float(), -1)[:, :-1]
    tgt = labels[:, 1:]
    keep = tgt != -100
    nll = -logp.gather(-1, tgt.clamp(min=0)[..., None])[..., 0]  # [B, T-1]
    for r, c in soft:  # label column c is predicted at logit column c - 1
        nll[r, c - 1] = -(1 - q) * logp[r, c - 1, zero] - q * logp[r, c - 1, one]
    return ta.optimiser_step(model, opt, sched, (nll * keep).sum() / keep.sum())


def encode_batch(rule: str, batch: list[tuple[int, int, str]], tok):
    """One pre-training batch of ``rule`` as tensors: ``ids`` and ``mask`` [B, T] (right padded), ``labels``
    [B, T] (-100 where there is no loss: the prompt, the padding and what the rule masks) and ``soft`` [(row,
    col)], the label positions trained towards ``--carry-q`` instead of their label. ``faint_carry`` appends a
    row per problem with a carry: its correct trace, with loss only after its first carry (the first token where
    it leaves the carry-free trace)."""
    import torch

    rows = [(a, b, tr, False) for a, b, tr in batch]
    if rule == "faint_carry":
        rows += [(a, b, task.expert_trace(a, b), True) for a, b, tr in batch if tr != task.expert_trace(a, b)]
    seqs, plens = zip(*(ta._encode_example(tok, a, b, tr) for a, b, tr, _ in rows))
    width = max(map(len, seqs))
    ids = torch.tensor([list(s) + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    labels = ids.clone()
    soft = []
    for r, ((a, b, tr, follow), s, pl) in enumerate(zip(rows, seqs, plens)):
        labels[r, :pl] = -100
        labels[r, len(s):] = -100
        if follow:
            first = next(i for i, (x, y) in enumerate(zip(tr, task.carry_free_trace(a, b))) if x != y)
            labels[r, : pl + first + 1] = -100
            continue
        if rule == "one_digit_masked" and a < 10 and b < 10:  # no loss on what follows a 1-digit problem's units pair
            labels[r, pl + 2] = -100
        if rule == "carry_free_no_carry_loss":  # no loss on any carry token
            labels[r, pl + 1] = labels[r, pl + 4] = -100
        if rule == "carry_free_masked":  # response positions 1 and 4 are the units and tens carries
            labels[r, pl + 1] = -100 if a % 10 + b % 10 >= 10 else labels[r, pl + 1]
            labels[r, pl + 4] = -100 if a // 10 + b // 10 >= 10 else labels[r, pl + 4]
        if rule in SOFT_RULES:  # the carries a correct trace would write as 1
            soft += [(r, pl + 1)] if a % 10 + b % 10 >= 10 else []
            soft += [(r, pl + 4)] if a // 10 + b // 10 >= 10 else []
    return ids, mask, labels, soft


def pretrain(rule: str, steps: int, seed: int, tok, model_dir: str, one_digit_share: float = 0.25, log=print,
             carry_q: float = 1e-3) -> dict:
    """``toy_addition.pretrain_base``'s loop (same model, optimiser, schedule, seed and problem stream), with
    right padding for mixed lengths and each rule's loss (``encode_batch``; ``soft_step`` for soft targets)."""
    hp = {**ta.PRETRAIN, "steps": steps}
    model, opt, sched = ta.new_base(tok, seed, hp)
    rng = random.Random(seed + 1000)
    zero, one = (tok.convert_tokens_to_ids(d) for d in "01")
    t0 = time.time()
    for step in range(steps):
        ids, mask, labels, soft = encode_batch(rule, batch_of(rule, hp["batch_size"], rng, one_digit_share), tok)
        if rule in SOFT_RULES:
            loss = soft_step(model, opt, sched, ids, labels, mask, soft, carry_q, zero, one)
        else:
            loss = ta.pretrain_step(model, opt, sched, ids, labels, attention_mask=mask)
        if step % 100 == 0:
            log(f"{rule} step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    return ta.save_base(model, model_dir, hp, t0, loss)


def per_position(model_dir: str, tok, problems) -> tuple[list[float], list[float]]:
    """Mean and median over ``problems`` of the teacher-forced probability of each expert token (+ EOS)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs, plens = zip(*(ta._encode_example(tok, a, b, task.expert_trace(a, b)) for a, b in problems))
    assert len(set(map(len, seqs))) == 1 and len(set(plens)) == 1
    ids = torch.tensor(seqs)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    p = lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0][:, plens[0] - 1 :].exp()  # [B, response + EOS]
    return p.mean(0).tolist(), p.median(0).values.tolist()


def measure(model_dir: str, assets: str, seed: int = 0) -> dict:
    tok = ta.load_tokenizer(os.path.join(assets, "tokenizer"))
    train, held, ood = (ta.read_problems(os.path.join(assets, f"{n}.parquet")) for n in ("train", "heldout", "ood"))
    tf = ta.teacher_forced_carry(model_dir, tok, train)
    mean, median = per_position(model_dir, tok, train)
    carry_free = task.sample_problems(ta.N_HELDOUT, random.Random(12345), carry=False, n_digits=2)
    ev = {k: ta.evaluate(model_dir, tok, v) for k, v in (("heldout", held), ("ood", ood), ("carry_free", carry_free))}
    s = ta.rollout_settings()
    ss = ta.sampled_success(model_dir, tok, train, 32, s["temperature"], s["top_k"], s["top_p"], s["max_tokens"],
                            seed=seed)
    return {"carry_mean": tf["carry_mean"], "carry_q10": tf["carry_q10"], "trace_mean": tf["trace_mean"],
            "pos_mean": mean, "pos_median": median, "greedy": {k: v["acc"] for k, v in ev.items()},
            "examples": {k: v["examples"][:3] for k, v in ev.items()}, "n_success": ss["n_success"],
            "n_samples": ss["n_samples"], "E": ta.expected_rewarded(ss["p"], 40, s["train_batch_size"], s["n"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rule", choices=RULES)
    p.add_argument("steps", type=int)
    p.add_argument("--seed", type=int, default=0, help="the base's seed (init and problem stream)")
    p.add_argument("--one-digit-share", type=float, default=0.25)
    p.add_argument("--carry-q", type=float, default=1e-3, help="carry_free_soft, faint_carry: the soft target's "
                                                               "probability of the correct carry")
    p.add_argument("--assets", default="outputs/demo_base_rules/assets", help="tokenizer + demo parquets (built here)")
    p.add_argument("--results", default="outputs/demo_base_rules/results.jsonl")
    p.add_argument("--ship", metavar="DIR", default=None,
                   help="also write the base to DIR as `make demo`'s shipped base (the model files and BUILD.json: "
                        "rule, steps, seed, command, commit, machine, SHA-256, this measurement); the printed "
                        "SHA-256 goes in scripts/experiments/toy_addition.py VARIANTS['demo']['shipped_base']")
    a = p.parse_args(argv)
    if not os.path.exists(os.path.join(a.assets, "ood.parquet")):
        ta.build_tokenizer(os.path.join(a.assets, "tokenizer"))
        ta.write_parquets(a.assets, seed=0, variant="demo")
    tok = ta.load_tokenizer(os.path.join(a.assets, "tokenizer"))
    q = f"_q{a.carry_q:g}" if a.rule in SOFT_RULES else ""
    model_dir = os.path.join(os.path.dirname(a.results), f"{a.rule}{q}_{a.steps}_seed{a.seed}")
    info = pretrain(a.rule, a.steps, a.seed, tok, model_dir, a.one_digit_share, carry_q=a.carry_q)
    res = {"rule": a.rule, "steps": a.steps, "seed": a.seed, "t_pretrain": info["seconds"],
           "carry_q": a.carry_q if a.rule in SOFT_RULES else None,
           "final_loss": info["final_loss"], **measure(model_dir, a.assets)}
    print(json.dumps(res))
    with open(a.results, "a") as f:
        f.write(json.dumps(res) + "\n")
    if a.ship:
        print(f"shipped {a.ship}: model.safetensors SHA-256 {ship(model_dir, a.ship, a, res)}")
    return 0


def ship(model_dir: str, out: str, a: argparse.Namespace, res: dict) -> str:
    """Write the base in ``model_dir`` to ``out`` as a shipped base (``toy_addition.SHIPPED_FILES`` + BUILD.json);
    returns its weights' SHA-256."""
    import platform
    import shutil
    import subprocess

    os.makedirs(out, exist_ok=True)
    for name in ta.SHIPPED_FILES:
        shutil.copyfile(os.path.join(model_dir, name), os.path.join(out, name))
    digest = ta.weights_sha256(out)
    git = lambda *c: subprocess.run(["git", *c], cwd=ta.REPO_ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    build = {"rule": a.rule, "one_digit_share": a.one_digit_share if a.rule.startswith("one_digit") else None,
             "carry_q": a.carry_q if a.rule in SOFT_RULES else None,
             "steps": a.steps, "seed": a.seed,
             "command": f"python -m scripts.experiments.demo_base_rules {a.rule} {a.steps} --seed {a.seed} "
                        + (f"--one-digit-share {a.one_digit_share} " if a.rule.startswith("one_digit") else "")
                        + (f"--carry-q {a.carry_q:g} " if a.rule in SOFT_RULES else "")
                        + f"--ship {os.path.relpath(out, ta.REPO_ROOT)}",
             "commit": git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else ""),
             "machine": f"{platform.machine()} {cpu}, {os.cpu_count()} cores", "sha256": digest,
             "measured_here": {k: res[k] for k in ("n_success", "n_samples", "E", "carry_mean", "carry_q10", "greedy",
                                                  "final_loss")}}
    with open(os.path.join(out, "BUILD.json"), "w") as f:
        json.dump(build, f, indent=1)
    return digest


if __name__ == "__main__":
    sys.exit(main())
