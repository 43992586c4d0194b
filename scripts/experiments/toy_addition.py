"""Assets for the toy-addition experiment (LUFFY vs on-policy GRPO vs SFT in miniature, on CPU).

Task, traces and reward: :mod:`scripts.experiments.toy_tasks.addition`. This script builds, deterministically for a seed and
cached on disk (re-running is a no-op when the manifest matches):

    OUT/tokenizer/        character-level PreTrainedTokenizerFast with a ChatML template ("\\n" is one
                          token). Its own folder: transformers 5 swaps a custom tokenizer for Qwen2Tokenizer
                          when it sits next to a qwen2 config.json.
    OUT/train.parquet     4096 carry problems, verl's schema + LUFFY ``target`` (the expert trace)
    OUT/heldout.parquet   200 other carry problems (same schema): the validation set
    OUT/base_seed{S}/     the "base" model: a tiny Qwen2ForCausalLM (2 layers, hidden 128) pre-trained with a
                          plain torch loop on carry-free traces of random problems (column sums mod 10, carry
                          always 0). It knows the format, not the skill.
    OUT/base_seed{S}/eval.json   its greedy pass rate on the 200 held-out carry problems and on 200 carry-free
                          problems (the latter shows it learned the format and the mod-10 procedure).

Usage::

    python -m scripts.experiments.toy_addition prepare [--out outputs/toy_addition] [--seed 0]
    python -m scripts.experiments.toy_addition sft-data OUT/train.parquet MESSAGES.parquet   # verl SFT data
    python -m scripts.experiments.toy_addition eval MODEL_DIR [--tokenizer OUT/tokenizer] [--data OUT/heldout.parquet]

``evaluate()`` is a held-out greedy evaluator (HF ``generate``) for any HF-format checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import string
import sys
import time

from scripts.experiments.toy_tasks import addition as task
from scripts import make_tiny_assets as tiny_assets  # the char-level tokenizer builder

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_OUT = os.path.join(REPO_ROOT, "outputs", "toy_addition")
IM_START = "<|im_start|>"  # ChatML turn start (tokenizer: scripts/make_tiny_assets.py)
CHARS = list(string.digits + string.ascii_lowercase + "+=> \n")
MODEL_KW = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
# Pre-training of the base model: long enough to learn the format and the mod-10 procedure reliably.
PRETRAIN = dict(steps=800, batch_size=64, lr=1e-3, warmup=50, weight_decay=0.0)
# What a base is pre-trained on (a variant's ``pretrain_data``, default "carry_free"; pretrain_examples): random
# problems of a class (``carry`` for scripts.experiments.toy_tasks.addition.matches) written with a trace function. Neither shows a
# column receiving a carry, the skill the RL runs are about. "carry_free" (both variants'): any problem, column
# sums mod 10 with every carry written 0, so a problem with a carry gets a wrong trace. "no_incoming_carry" (a
# measured alternative for the demo, not used by default): only the problems no column of which receives a
# carry, each with its correct trace, so a carry out of the last column is written (``52+61`` -> ``30 11>113``)
# and nothing the base sees says a carry is 0 when a column sums to 10 or more. With it the demo's base meets
# GRPO's bound with a carry probability above the carry-free base's, but LUFFY reached only 12.5-13% in 40
# steps (seed 0; recipes/toy_addition/README.md, "Base-building rules"). Built bases use "carry_free"; `make
# demo`'s shipped base was built by scripts/experiments/demo_base_rules.py's "faint_carry" rule (carry-free
# traces plus a faint, one-token-deep prior for the correct carry; its BUILD.json).
PRETRAIN_DATA = {
    "carry_free": dict(carry=None, trace=task.carry_free_trace),
    "no_incoming_carry": dict(carry="no_incoming_carry", trace=task.expert_trace),
}
N_TRAIN, N_HELDOUT = 4096, 200
# Task variants. "addition3" is the experiment (3-digit operands, every problem has a carry; LUFFY needs
# ~300 steps). "demo" is the smaller variant `make demo` trains in minutes with the same property (the base
# model solves 0%, on-policy samples never earn a reward, LUFFY learns it): 2-digit operands whose only carry
# is out of the units column (units sum 10..15: 1092 problems, 200 held out, 892 for training), plus an
# out-of-distribution set (scripts.experiments.toy_tasks.addition.PROBLEM_CLASSES). 2-digit carry-free traces need 400
# pre-training steps, not 800.
VARIANTS = {
    "addition3": dict(n_digits=3, carry=True, ood=None, pretrain_steps=800),
    "demo": dict(n_digits=2, carry="units_carry", ood="units_carry_ood", pretrain_steps=400,
                 base_check=dict(grpo_steps=40, k=32, bound=1.0, extra_steps=25, max_rounds=0, carry_floor=5e-6),
                 shipped_base=dict(path=os.path.join(REPO_ROOT, "recipes", "toy_addition", "demo_base"),
                                   sha256="336bccfa77a43aeb83be1ca28cdbc2f0f42917da71cc8c10df534f360d2e042b")),
}
# ``shipped_base``: the base `make demo` trains from (prepare(..., base="shipped")), a checkpoint this repository
# ships rather than rebuilds. Its file's SHA-256 is checked before use. Why ship it: a base rebuilt on another CPU
# has other floats, and the demo's outcome follows the base (on another 2-core machine of CI's kind a rebuilt
# carry-free base let on-policy GRPO reach 55% where this machine's stayed at 0%). Shipped, every machine starts
# from the same weights; the demo still measures the base's property on the machine that runs it and prints it.
# How it was made (rule, steps, seed, command, commit, measurement): the BUILD.json beside it
# (scripts/experiments/demo_base_rules.py --ship). The comparison harness (compare.py) and luffy_vs_grpo.py
# still build the carry-free base (base="built"), the one scripts/experiments/README.md's Evidence was measured on.
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors")
# The demo's story rests on two properties of the base, measured after pre-training (check_base). GRPO's side:
# its sampled success rate p on the training problems at the rollout's temperature (every training problem x k
# samples, the rollout's own sampler) and the rewarded samples on-policy GRPO can expect from it over the whole
# run, p x grpo_steps x train_batch_size x n (40 x 32 x 8 = 10,240 samples); the bound is < 1, less than one
# expected reward in the whole run (892 x 32 = 28,544 measured samples resolve it: at most 2 successes; a
# bound of 0.1 would need 0 successes, and 0 of 28,544 only bounds the count by 1.08 at 95%). LUFFY's side:
# the teacher-forced probability the base gives the expert's units-carry token (teacher_forced_carry), which
# LUFFY's shaped term p/(p+0.1) raises with a gradient ~ p/0.1: its mean over the training problems must be
# >= carry_floor. Measured on this box (seed 0, 40 steps): 600 steps (one 200-step continuation) 1.3e-6,
# LUFFY 0 -> 0%; 525 steps 4.8e-6, 0 -> 0%; 475 steps 1.5e-5, 0 -> 8.5%: the floor (5e-6) is necessary, not
# sufficient for LUFFY >= 50% (recipes/toy_addition/README.md). The float results of pre-training depend on the
# CPU's kernels, so prepare() measures both (manifest ``base_property``) and the demo prints them. check_base
# can continue pre-training on carry-free traces ``extra_steps`` at a time (at most ``max_rounds`` times) while
# GRPO's bound is missed, stopping at the FIRST base that meets it or once the carry probability is below its
# floor; the demo sets max_rounds=0 (measure and report only): the continuation was measured to leave no base
# that meets both sides, and a base LUFFY cannot move in 40 steps demonstrates nothing.
OOD_SOURCE = "toy_addition_ood"  # data_source of the OOD rows: verl logs val-core/toy_addition_ood/acc/mean@1
MAX_NEW_TOKENS = 16  # a trace is 13 characters + EOS


# ------------------------------------------------------------------------------------------ tokenizer
def build_tokenizer(out_dir: str):
    """Character-level fast tokenizer over CHARS with ChatML specials and chat template (one token per
    character), saved to ``out_dir``: the tiny-asset builder's, with the toy alphabet and no word tokens."""
    return tiny_assets.build_tokenizer(out_dir, chars=CHARS, words=(), model_max_length=256)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return tok


def prompt_ids(tokenizer, a: int, b: int) -> list[int]:
    """Token ids of the chat-templated prompt with the generation prompt, as verl's agent loop builds them."""
    msgs = [{"role": "user", "content": task.prompt_text(a, b)}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


# ------------------------------------------------------------------------------------------ data
def variant_splits(variant: str, seed: int = 0) -> dict[str, list[tuple[int, int]]]:
    """train / heldout (and ood) problems of ``variant``. addition3: sampled (task.splits); demo: its class is
    small, so every problem is used: 200 held out at random, the rest train; ood = the whole OOD class."""
    v = VARIANTS[variant]
    if v["ood"] is None:
        return task.splits(seed=seed, n_train=N_TRAIN, n_heldout=N_HELDOUT, n_digits=v["n_digits"], carry=v["carry"])
    pool = task.all_problems(v["carry"], v["n_digits"])
    random.Random(seed).shuffle(pool)
    return {"heldout": pool[:N_HELDOUT], "train": pool[N_HELDOUT:], "ood": task.all_problems(v["ood"], v["n_digits"])}


def write_parquets(out_dir: str, seed: int, variant: str = "addition3") -> dict:
    import pandas as pd

    sp = variant_splits(variant, seed)
    paths = {}
    for name, split, source in (("train", "train", task.DATA_SOURCE), ("heldout", "test", task.DATA_SOURCE),
                                ("ood", "test", OOD_SOURCE)):
        if name not in sp:
            continue
        rows = [task.make_row(a, b, split, i, data_source=source) for i, (a, b) in enumerate(sp[name])]
        paths[name] = os.path.join(out_dir, f"{name}.parquet")
        pd.DataFrame(rows).to_parquet(paths[name], index=False)
    return paths


def write_sft_messages(train_parquet: str, out_parquet: str, seed: int = 0) -> int:
    """verl SFT-trainer data (a ``messages`` column): each row's prompt + [assistant: its target].

    Rows are shuffled with ``seed``: verl 0.9.1's SFT trainer draws batches with a DistributedSampler of fixed
    seed 0 (``trainer.seed`` is not used there), so this is what makes two SFT seeds see different batches.
    """
    import pandas as pd

    df = pd.read_parquet(train_parquet).sample(frac=1.0, random_state=seed).reset_index(drop=True)
    messages = [list(p) + [{"role": "assistant", "content": t[0]["content"]}] for p, t in zip(df["prompt"], df["target"])]
    pd.DataFrame({"messages": messages}).to_parquet(out_parquet, index=False)
    return len(messages)


def read_problems(parquet: str) -> list[tuple[int, int]]:
    import pandas as pd

    df = pd.read_parquet(parquet)
    return [task.parse_prompt(p[0]["content"]) for p in df["prompt"]]


# ------------------------------------------------------------------------------------------ base model
def _encode_example(tokenizer, a: int, b: int, trace: str) -> tuple[list[int], int]:
    p = prompt_ids(tokenizer, a, b)
    r = tokenizer.encode(trace, add_special_tokens=False) + [tokenizer.eos_token_id]
    return p + r, len(p)


def pretrain_examples(data: str, n: int, rng: random.Random, n_digits: int = task.N_DIGITS) -> list[tuple]:
    """One pre-training batch of ``data`` (a :data:`PRETRAIN_DATA` name): ``n`` distinct random problems of its
    class, each with its trace, as ``(a, b, trace)``."""
    if data not in PRETRAIN_DATA:
        raise ValueError(f"unknown pre-training data {data!r} (VARIANTS[...]['pretrain_data']); known: "
                         f"{sorted(PRETRAIN_DATA)}")
    d = PRETRAIN_DATA[data]
    return [(a, b, d["trace"](a, b)) for a, b in task.sample_problems(n, rng, carry=d["carry"], n_digits=n_digits)]


def pretrain_base(model_dir: str, tokenizer, seed: int, log=print, n_digits: int = task.N_DIGITS,
                  init_from: str | None = None, stream: int = 0, data: str = "carry_free", **overrides) -> dict:
    """Pre-train a tiny Qwen2 on the traces of ``data`` (:data:`PRETRAIN_DATA`; loss on response tokens only).
    Deterministic for ``seed``.

    ``init_from``: continue from that checkpoint (fresh optimiser and schedule) instead of a new model;
    ``stream``: which stream of random problems (0 = the first pre-training's; a continuation takes another).
    """
    import torch

    pretrain_examples(data, 0, random.Random(0))  # an unknown name fails here, before the model is built
    hp = {**PRETRAIN, **overrides}
    model, opt, sched = new_base(tokenizer, seed, hp, init_from=init_from)
    rng = random.Random(seed + 1000 + 7919 * stream)  # pre-training problems: fresh every step
    t0 = time.time()
    for step in range(hp["steps"]):
        seqs, plens = zip(*(_encode_example(tokenizer, a, b, trace)
                            for a, b, trace in pretrain_examples(data, hp["batch_size"], rng, n_digits)))
        assert len(set(map(len, seqs))) == 1, "all examples have the same length (no padding needed)"
        ids = torch.tensor(seqs)
        labels = ids.clone()
        labels[:, : plens[0]] = -100  # learn the response only, as SFT would
        loss = pretrain_step(model, opt, sched, ids, labels)
        if step % 100 == 0 or step == hp["steps"] - 1:
            log(f"pretrain step {step:5d} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    return save_base(model, model_dir, hp, t0, loss)


def new_base(tokenizer, seed: int, hp: dict, model_kw: dict = MODEL_KW, init_from: str | None = None):
    """A toy base to pre-train (every toy task's): a tiny float32 Qwen2 of ``model_kw`` over ``tokenizer`` (or
    ``init_from``'s weights), seeded, with AdamW and a warm-up then square-root decay schedule over
    ``hp["steps"]``. Returns ``(model, optimiser, schedule)``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    if init_from is not None:
        model = Qwen2ForCausalLM.from_pretrained(init_from, dtype=torch.float32)
    else:
        cfg = Qwen2Config(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.convert_tokens_to_ids(IM_START), torch_dtype="float32", **model_kw,
        )  # fmt: skip
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / hp["warmup"]) * max(0.0, 1 - s / hp["steps"]) ** 0.5
    )
    return model, opt, sched


def pretrain_step(model, opt, sched, ids, labels, attention_mask=None):
    """One step of a toy base's pre-training (every toy task's loop): next-token cross-entropy on the labels
    that are not -100, gradient norm clipped to 1.0, optimiser and schedule stepped. Returns the loss tensor."""
    kw = {} if attention_mask is None else {"attention_mask": attention_mask}
    return optimiser_step(model, opt, sched, model(input_ids=ids, labels=labels, **kw).loss)


def optimiser_step(model, opt, sched, loss):
    """Back-propagate ``loss``, clip the gradient norm to 1.0, step the optimiser and the schedule; returns ``loss``
    (every toy pre-training loop's step, whatever its loss)."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def save_base(model, model_dir: str, hp: dict, t0: float, loss) -> dict:
    """Save a pre-trained toy base (HF format) and return its pre-training record."""
    model.eval()
    # No sampling defaults in generation_config.json: rollouts must get exactly the caller's params.
    gc = model.generation_config
    gc.do_sample, gc.top_k, gc.top_p, gc.temperature = False, None, None, None
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"hparams": hp, "seconds": round(time.time() - t0, 1), "final_loss": float(loss.item())}


# ------------------------------------------------------------------------------------------ evaluation
def generate_greedy(model, tokenizer, problems, batch_size: int = 200) -> list[str]:
    """Greedy responses (special tokens dropped) for ``problems`` [(a, b)]."""
    import torch

    outs = []
    for i in range(0, len(problems), batch_size):
        chunk = [prompt_ids(tokenizer, a, b) for a, b in problems[i : i + batch_size]]
        width = max(map(len, chunk))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(c)) + c for c in chunk])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(c) for c in chunk])[:, None]).long()
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
        outs += tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
    return outs


def evaluate(model_dir_or_model, tokenizer, problems) -> dict:
    """Held-out greedy accuracy of an HF checkpoint (path or loaded model) on ``problems`` [(a, b)]."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = model_dir_or_model
    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    responses = generate_greedy(model, tokenizer, problems)
    scores = [task.compute_score(task.DATA_SOURCE, r, str(a + b)) for r, (a, b) in zip(responses, problems)]
    n = len(problems)
    return {
        "n": n,
        "acc": sum(s["acc"] for s in scores) / n,
        "format_ok": sum(s["format_ok"] for s in scores) / n,
        "examples": [f"{task.prompt_text(a, b)} -> {r!r}" for r, (a, b) in list(zip(responses, problems))[:5]],
    }


# ------------------------------------------------------------------------------------------ base property
def rollout_settings(recipe: str = "on_policy_grpo") -> dict:
    """What an RL run of ``recipe`` (recipes/toy_addition) samples with: prompts per step, samples per
    prompt, the rollout's temperature / top-k / top-p and response length (the composed recipe config)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=os.path.join(REPO_ROOT, "recipes", "toy_addition"), version_base=None):
        cfg = compose(config_name=recipe)
    OmegaConf.resolve(cfg)
    r = cfg.actor_rollout_ref.rollout
    return {"train_batch_size": int(cfg.data.train_batch_size), "n": int(r.n), "temperature": float(r.temperature),
            "top_k": int(r.top_k), "top_p": float(r.top_p), "max_tokens": int(cfg.data.max_response_length)}


def sampled_success(model, tokenizer, problems, k: int, temperature: float = 1.0, top_k: int = -1,
                    top_p: float = 1.0, max_tokens: int = MAX_NEW_TOKENS, seed: int = 0, rows: int = 1024,
                    stop_at: int | None = None) -> dict:
    """Sample ``k`` responses to every problem [(a, b)] with the rollout's own sampler (mix_src.cpu.sampling,
    what the hf rollout server runs; one seeded generator per sample) and grade them with the task's reward.

    Returns ``n_samples`` (= len(problems) x k), ``n_success`` (reward 1), ``problems_with_success`` and
    ``p`` = n_success / n_samples, the sampled success rate. ``stop_at``: stop after the chunk of ``rows``
    samples in which the successes reach this count (``n_samples`` then counts the samples drawn so far,
    ``stopped_early`` is True): enough to know a bound is missed.
    """
    import torch

    from mix_src.cpu.sampling import SamplingSpec, generate_batch

    torch.set_num_threads(1)
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    eos = {tokenizer.eos_token_id}
    prompts = [prompt_ids(tokenizer, a, b) for a, b in problems]
    width = max(map(len, prompts))
    jobs = [(i, j) for i in range(len(problems)) for j in range(k)]
    wins = [0] * len(problems)
    for start in range(0, len(jobs), rows):
        chunk = jobs[start : start + rows]
        specs = [SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=(seed * len(problems) + i) * k + j) for i, j in chunk]  # fmt: skip
        outs = generate_batch(model, [prompts[i] for i, _ in chunk], specs, eos, tokenizer.pad_token_id, width=width)
        for (i, _), (ids, _) in zip(chunk, outs):
            a, b = problems[i]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            wins[i] += int(task.compute_score(task.DATA_SOURCE, text, str(a + b))["score"] == 1.0)
        if stop_at is not None and sum(wins) >= stop_at and start + rows < len(jobs):
            n = start + len(chunk)
            return {"n_problems": len(problems), "k": k, "n_samples": n, "n_success": sum(wins),
                    "problems_with_success": sum(w > 0 for w in wins), "p": sum(wins) / n, "stopped_early": True}
    n = len(jobs)
    return {"n_problems": len(problems), "k": k, "n_samples": n, "n_success": sum(wins),
            "problems_with_success": sum(w > 0 for w in wins), "p": sum(wins) / n, "stopped_early": False}


def teacher_forced_carry(model, tokenizer, problems, batch_size: int = 256) -> dict:
    """Teacher-forced odds the base gives the expert trace of each problem [(a, b)] (prompt + trace + EOS,
    one forward pass, temperature 1): ``carry`` = the probability of the expert's units-carry token (the
    2nd response token, ``1`` in ``51 70>075``), the token LUFFY's shaped term f(p) = p/(p+0.1) must raise,
    with gradient ~ p/0.1 while p is small; ``trace`` = the probability of the whole expert trace + EOS (a
    lower bound on the sampled success rate of that problem). Returns per-problem lists and their summaries
    (``carry_mean``, ``carry_q10`` = 10% quantile, ``carry_median``, ``trace_mean``)."""
    import torch

    torch.set_num_threads(1)
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    carry, trace = [], []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        seqs, plens = zip(*(_encode_example(tokenizer, a, b, task.expert_trace(a, b)) for a, b in chunk))
        width = max(map(len, seqs))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(s)) + list(s) for s in seqs])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(s) for s in seqs])[:, None]).long()
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        tok_lp = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]: log p(token t+1 | ..t)
        for r, (s, pl) in enumerate(zip(seqs, plens)):
            start = width - len(s) + pl - 1  # position predicting the 1st response token
            resp = tok_lp[r, start:]
            carry.append(float(resp[1].exp()))
            trace.append(float(resp.sum().exp()))
    srt = sorted(carry)
    q = lambda f: srt[min(len(srt) - 1, int(f * len(srt)))]  # noqa: E731
    return {"n_problems": len(problems), "carry": carry, "trace": trace, "carry_mean": sum(carry) / len(carry),
            "carry_q10": q(0.1), "carry_median": q(0.5), "trace_mean": sum(trace) / len(trace)}


def expected_rewarded(p: float, steps: int, train_batch_size: int, n: int) -> float:
    """Rewarded samples on-policy GRPO expects over a run from a policy of sampled success rate ``p``:
    p x steps x train_batch_size x n (the run's samples)."""
    return p * steps * train_batch_size * n


def poisson_upper95(x: int) -> float:
    """The one-sided 95% upper confidence limit of a Poisson mean from an observed count ``x``: the mean whose
    P(X <= x) is 0.05 (exact, by bisection), 3 for ``x`` = 0 (the rule of three; exactly -ln 0.05 = 2.996).
    A success count of a base is binomial with a tiny p, so Poisson is its law; the normal approximation it
    replaces put the bound of 1 success (2.96) below that of 0."""
    if x == 0:
        return 3.0

    def cdf(lam: float) -> float:
        return sum(math.exp(-lam + k * math.log(lam) - math.lgamma(k + 1)) for k in range(x + 1))

    lo, hi = float(x), x + 10.0 * math.sqrt(x) + 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 0.05 else (lo, mid)
    return (lo + hi) / 2


def base_property(success: dict, steps: int, settings: dict, bound: float) -> dict:
    """The demo's property of a base: ``success`` (from :func:`sampled_success`), the expected rewarded samples of
    a ``steps``-step GRPO run with ``settings`` (:func:`rollout_settings`) and whether it is below ``bound``.

    ``upper95``: the expected count at the one-sided 95% upper confidence bound of p (:func:`poisson_upper95`
    / n_samples: 3 / n_samples when no sample succeeded, the "rule of three"): what the measurement can rule out.
    """
    n, x = success["n_samples"], success["n_success"]
    run = steps * settings["train_batch_size"] * settings["n"]
    p_hi = min(1.0, poisson_upper95(x) / n)
    expected = expected_rewarded(success["p"], steps, settings["train_batch_size"], settings["n"])
    return {**success, "temperature": settings["temperature"], "grpo_steps": steps, "grpo_samples": run,
            "expected_rewarded": expected, "upper95": p_hi * run, "bound": bound, "meets_bound": expected < bound}


def describe_property(prop: dict) -> str:
    """One line for a log: p, the expected rewarded samples, the bound."""
    drawn = (f"the first {prop['n_samples']} of {prop['n_problems']} training problems x {prop['k']} samples, "
             "stopped once the bound was missed" if prop.get("stopped_early")
             else f"{prop['n_problems']} training problems x {prop['k']} samples")
    return (f"sampled success rate p = {prop['n_success']}/{prop['n_samples']} = {prop['p']:.2e} "
            f"({drawn} at temperature {prop['temperature']:g}; "
            f"{prop['problems_with_success']} problems solved at least once); expected rewarded samples over "
            f"GRPO's {prop['grpo_steps']} steps x {prop['grpo_samples'] // prop['grpo_steps']} samples = "
            f"{prop['expected_rewarded']:.2f} (95% upper bound {prop['upper95']:.2f}); bound: < {prop['bound']:g} "
            + ("-- met" if prop["meets_bound"] else "-- NOT met")
            + ("" if "carry_mean" not in prop else
               f"; LUFFY's side: teacher-forced probability of the expert's carry token, mean {prop['carry_mean']:.2e}"
               f" (10% quantile {prop['carry_q10']:.2e}); floor: >= {prop['carry_floor']:g} "
               + ("-- met" if prop["luffy_ok"] else "-- NOT met")))


# ------------------------------------------------------------------------------------------ all together
def _pretrain_hparams(variant: str, steps: int | None = None) -> dict:
    return {**PRETRAIN, "steps": steps or VARIANTS[variant]["pretrain_steps"]}


def _fingerprint(seed: int, variant: str, pretrain_steps: int | None = None) -> dict:
    fp = {"version": 1, "seed": seed, "chars": "".join(CHARS), "model": MODEL_KW,
          "pretrain": _pretrain_hparams(variant, pretrain_steps), "n_train": N_TRAIN, "n_heldout": N_HELDOUT}
    if variant != "addition3":  # caches of the experiment's assets stay valid
        # the shipped base's path and digest are not part of a built base's identity (a shipped one adds its digest)
        fp["variant"] = {"name": variant, **{k: x for k, x in VARIANTS[variant].items() if k != "shipped_base"}}
    return fp


def weights_sha256(model_dir: str) -> str:
    """SHA-256 of ``model_dir/model.safetensors``: the digest a shipped base is recorded and checked by
    (``demo_base_rules --ship`` writes it, :func:`install_shipped_base` checks it)."""
    import hashlib

    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def install_shipped_base(variant: str, model_dir: str, tokenizer) -> dict:
    """Copy ``VARIANTS[variant]["shipped_base"]`` (the variant must ship one: prepare checks) into ``model_dir``
    after checking its weights' SHA-256 and that its vocabulary is ``tokenizer``'s. Returns its BUILD.json (how it
    was made). Raises ValueError naming the file and what to do when a check fails (a truncated or
    Git-LFS-pointer checkout, an edited file)."""
    import shutil

    sb = VARIANTS[variant]["shipped_base"]
    weights = os.path.join(sb["path"], "model.safetensors")
    missing = [f for f in SHIPPED_FILES + ("BUILD.json",) if not os.path.isfile(os.path.join(sb["path"], f))]
    if missing:
        raise ValueError(f"the shipped demo base {sb['path']} lacks {missing}: restore it with `git checkout -- "
                         f"{os.path.relpath(sb['path'], REPO_ROOT)}`")
    digest = weights_sha256(sb["path"])
    if digest != sb["sha256"]:
        raise ValueError(f"{weights}: SHA-256 {digest} is not the shipped base's {sb['sha256']} (a truncated or "
                         f"Git-LFS-pointer checkout, or an edited file): restore it with `git checkout -- "
                         f"{os.path.relpath(sb['path'], REPO_ROOT)}`, or rebuild it with the command in its "
                         "BUILD.json and put the new digest in VARIANTS['demo']['shipped_base']")
    with open(os.path.join(sb["path"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if vocab != len(tokenizer):
        raise ValueError(f"{sb['path']}/config.json: vocab_size {vocab} != the toy tokenizer's {len(tokenizer)} "
                         "(CHARS changed since the base was built): rebuild the base (its BUILD.json's command)")
    os.makedirs(model_dir, exist_ok=True)
    for name in SHIPPED_FILES:
        shutil.copyfile(os.path.join(sb["path"], name), os.path.join(model_dir, name))
    with open(os.path.join(sb["path"], "BUILD.json")) as f:
        return json.load(f)


def prepare(out_dir: str = DEFAULT_OUT, seed: int = 0, force: bool = False, log=print,
            variant: str = "addition3", pretrain_steps: int | None = None, base: str = "built") -> dict:
    """Build (or reuse) tokenizer, parquets and the base model for ``seed``; returns paths and base eval.

    The data split is always seed 0 (the same held-out set for every run); ``seed`` picks the base model's
    initialisation and pre-training stream (``base_seed{seed}``). ``pretrain_steps`` overrides the variant's
    (tests build a barely trained base with it). ``base="shipped"``: use the variant's shipped checkpoint
    (``VARIANTS[variant]["shipped_base"]``, checksum-checked, in ``base_shipped``) instead of pre-training one;
    its property is measured here all the same.
    """
    if base not in ("built", "shipped"):
        raise ValueError(f"base={base!r}: 'built' (pre-train here) or 'shipped' (the variant's shipped checkpoint)")
    out_dir = os.path.abspath(out_dir)
    paths = {
        "tokenizer": os.path.join(out_dir, "tokenizer"),
        "train": os.path.join(out_dir, "train.parquet"),
        "heldout": os.path.join(out_dir, "heldout.parquet"),
        "model": os.path.join(out_dir, "base_shipped" if base == "shipped" else f"base_seed{seed}"),
    }
    manifest = os.path.join(paths["model"], "eval.json")
    if variant not in VARIANTS:
        raise ValueError(f"unknown toy-addition variant {variant!r}; known: {sorted(VARIANTS)}")
    v = VARIANTS[variant]
    if v["ood"] is not None:
        paths["ood"] = os.path.join(out_dir, "ood.parquet")
    fp = _fingerprint(seed, variant, pretrain_steps)
    if base == "shipped":
        if "shipped_base" not in v:
            raise ValueError(f"toy-addition variant {variant!r} ships no base; use base='built' (variants with "
                             f"one: {sorted(k for k, x in VARIANTS.items() if 'shipped_base' in x)})")
        fp = {**fp, "pretrain": None, "shipped_sha256": v["shipped_base"]["sha256"]}
    if not force and os.path.exists(manifest) and all(os.path.exists(p) for p in paths.values()):
        with open(manifest) as f:
            info = json.load(f)
        if info.get("fingerprint") == fp:
            return {**paths, "base_eval": info["eval"],
                    **({"base_property": info["base_property"]} if "base_property" in info else {}),
                    **({"base_build": info["pretrain"]["shipped"]} if "shipped" in info["pretrain"] else {})}

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(paths["tokenizer"])
    tokenizer = load_tokenizer(paths["tokenizer"])  # evaluate exactly what verl will load
    assert tokenizer.encode("\n", add_special_tokens=False) != [] and len(tokenizer.encode("\n")) == 1
    write_parquets(out_dir, seed=0, variant=variant)
    if base == "shipped":
        train_info = {"shipped": install_shipped_base(variant, paths["model"], tokenizer)}
        steps, rounds = train_info["shipped"]["steps"], 0  # measured as shipped, never trained further
    else:
        train_info = pretrain_base(paths["model"], tokenizer, seed, log=log, n_digits=v["n_digits"],
                                   data=v.get("pretrain_data", "carry_free"), **_pretrain_hparams(variant, pretrain_steps))
        steps, rounds = None, None
    prop = None
    if "base_check" in v:
        prop, cont = check_base(paths["model"], tokenizer, paths["train"], seed, variant, log=log,
                                pretrain_steps=steps, max_rounds=rounds, full_count=base == "shipped")
        train_info["continued"] = cont
    heldout = read_problems(paths["heldout"])
    carry_free = task.sample_problems(N_HELDOUT, random.Random(12345), carry=False, n_digits=v["n_digits"])
    ev = {"heldout_carry": evaluate(paths["model"], tokenizer, heldout),
          "carry_free": evaluate(paths["model"], tokenizer, carry_free)}
    if "ood" in paths:
        ev["ood"] = evaluate(paths["model"], tokenizer, read_problems(paths["ood"]))
    info = {"fingerprint": fp, "pretrain": train_info, "eval": ev}
    if prop is not None:
        info["base_property"] = prop
    with open(manifest, "w") as f:
        json.dump(info, f, indent=1)
    return {**paths, "base_eval": ev, **({"base_property": prop} if prop is not None else {}),
            **({"base_build": train_info["shipped"]} if "shipped" in train_info else {})}


def check_base(model_dir: str, tokenizer, train_parquet: str, seed: int, variant: str, log=print,
               measure=None, measure_carry=None, pretrain_steps: int | None = None,
               max_rounds: int | None = None, full_count: bool = False) -> tuple[dict, list[dict]]:
    """Measure the base's property (``VARIANTS[variant]["base_check"]``) and, while its expected rewarded GRPO
    samples are not below the bound, continue pre-training ``model_dir`` in place for ``extra_steps`` more
    carry-free steps (at most ``max_rounds`` times). Returns the last measurement (with ``pretrain_steps``
    and ``history``: every round's steps, p and expected count) and the continuation rounds' train infos.
    ``measure(model_dir) -> sampled_success dict`` replaces the sampler and ``measure_carry(model_dir) ->
    teacher_forced_carry dict`` the carry measurement (tests). Stops at the first base meeting GRPO's bound, or
    once the carry probability is below ``carry_floor`` (no window: more training only lowers it), or after
    ``max_rounds``; ``luffy_ok`` / ``window`` say which held. ``pretrain_steps`` / ``max_rounds``: the base's
    steps so far and the rounds allowed, when not the variant's (a shipped base is measured, never continued).
    ``full_count``: draw every sample even once the bound is missed (the shipped base's E is reported unbiased)."""
    v, c = VARIANTS[variant], VARIANTS[variant]["base_check"]
    if max_rounds is not None:
        c = {**c, "max_rounds": max_rounds}
    settings = rollout_settings()
    if measure is None:
        problems = read_problems(train_parquet)

        run = c["grpo_steps"] * settings["train_batch_size"] * settings["n"]
        # successes among all len(problems) x k samples that put the expected count at the bound: once
        # reached, the rest of the measurement cannot change the verdict (a base that misses costs one chunk)
        stop_at = None if full_count else max(1, math.ceil(c["bound"] * len(problems) * c["k"] / run))

        def measure(path):
            return sampled_success(path, tokenizer, problems, c["k"], settings["temperature"], settings["top_k"],
                                   settings["top_p"], settings["max_tokens"], seed=seed, stop_at=stop_at)

        def measure_carry(path):
            return teacher_forced_carry(path, tokenizer, problems)

    steps, rounds, history = pretrain_steps or v["pretrain_steps"], [], []
    while True:
        t0 = time.time()
        tf = measure_carry(model_dir)
        prop = {**base_property(measure(model_dir), c["grpo_steps"], settings, c["bound"]),
                "carry_mean": tf["carry_mean"], "carry_q10": tf["carry_q10"], "carry_floor": c["carry_floor"]}
        prop["luffy_ok"] = prop["carry_mean"] >= c["carry_floor"]
        prop["window"] = prop["meets_bound"] and prop["luffy_ok"]
        history.append({"pretrain_steps": steps, "n_samples": prop["n_samples"], "n_success": prop["n_success"],
                        "stopped_early": prop.get("stopped_early", False), "p": prop["p"],
                        "expected_rewarded": prop["expected_rewarded"], "carry_mean": prop["carry_mean"],
                        "carry_q10": prop["carry_q10"], "seconds": round(time.time() - t0, 1)})
        log(f"base after {steps} pre-training steps: " + describe_property(prop))
        if prop["meets_bound"] or not prop["luffy_ok"] or len(rounds) == c["max_rounds"]:
            return {**prop, "pretrain_steps": steps, "history": history}, rounds
        hparams = {**_pretrain_hparams(variant), "steps": c["extra_steps"]}
        rounds.append(pretrain_base(model_dir, tokenizer, seed, log=log, n_digits=v["n_digits"],
                                    data=v.get("pretrain_data", "carry_free"), init_from=model_dir,
                                    stream=len(rounds) + 1, **hparams))
        steps += c["extra_steps"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="build tokenizer, parquets and the base model (cached)")
    pp.add_argument("--out", default=DEFAULT_OUT)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--force", action="store_true")
    pp.add_argument("--variant", default="addition3", choices=sorted(VARIANTS),
                    help="addition3: the experiment; demo: the 2-digit variant `make demo` trains")
    pp.add_argument("--base", default="built", choices=["built", "shipped"],
                    help="built: pre-train the base here (base_seedS); shipped: the variant's shipped checkpoint, "
                         "checksum-checked (base_shipped; demo only)")
    pe = sub.add_parser("eval", help="greedy held-out accuracy of an HF checkpoint")
    pe.add_argument("model")
    pe.add_argument("--tokenizer", default=os.path.join(DEFAULT_OUT, "tokenizer"))
    pe.add_argument("--data", default=os.path.join(DEFAULT_OUT, "heldout.parquet"))
    ps = sub.add_parser("sft-data", help="write verl SFT messages (prompt + target) from a training parquet")
    ps.add_argument("train_parquet")
    ps.add_argument("out_parquet")
    ps.add_argument("--seed", type=int, default=0, help="row shuffle (the SFT run's data order)")
    a = p.parse_args(argv)
    if a.cmd == "sft-data":
        res = {"rows": write_sft_messages(a.train_parquet, a.out_parquet, a.seed), "path": a.out_parquet}
    elif a.cmd == "prepare":
        res = prepare(a.out, seed=a.seed, force=a.force, variant=a.variant, base=a.base)
    else:
        res = evaluate(a.model, a.tokenizer, read_problems(a.data))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
