"""Build tiny, offline, seed-deterministic assets for CPU tests and demos.

Writes into OUT_DIR:

    tokenizer/    a character-level tokenizer (PreTrainedTokenizerFast) with a ChatML template.
                  It lives in its own folder: transformers 5 replaces a custom tokenizer with
                  Qwen2Tokenizer when it sits next to a qwen2 config.json, so point verl at it with
                  ``+actor_rollout_ref.model.tokenizer_path=OUT_DIR/tokenizer``.
    model/        a random Qwen2ForCausalLM (hidden 64, 2 layers, 2 heads of 32, 1 kv-head, fp32).
    train.parquet, val.parquet
                  "a + b" / "a - b" / "a * b" questions in verl's schema (data_source, prompt, ability,
                  reward_model {style, ground_truth}, extra_info {split, index}) plus LUFFY's
                  ``target`` column: [{"role": "assistant", "content": "<think>3+4=7</think> \\boxed{7}"}].
    assets.json   the dict returned by build() and a fingerprint of the arguments.

The tokenizer is a BPE model with single characters only (no merges) plus three multi-character
added tokens (``<think>``, ``</think>``, ``\\boxed{``) that keep targets short (about 14 tokens).
Decoding concatenates tokens, so ``decode(encode(text)) == text`` for any printable-ASCII text, and
``"\\n"`` is exactly one token, as verl's Qwen continuous-token builder requires.

Usage::

    python scripts/make_tiny_assets.py OUT_DIR [--seed N]      # no-op if OUT_DIR already holds them

    from scripts.make_tiny_assets import build                  # or importlib by file path
    assets = build(out_dir, seed=0)  # {"tokenizer", "model", "train", "val"} -> absolute paths
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys

DATA_SOURCE = "tiny_arith"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, bos-of-turn, eos
WORD_TOKENS = ["<think>", "</think>", "\\boxed{"]  # multi-char, non-special: kept by decode
CHARS = list(string.printable)  # digits, letters, punctuation, space, \t \n \r \x0b \x0c
UNK = "<unk>"

# ChatML, as Qwen2 uses it, minus tools/system defaults.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_KW = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    # head_dim = 64 / 2 = 32: the smallest head size vLLM's CPU attention accepts
    # (CPUAttentionBackend.get_supported_head_sizes, vllm/v1/attention/backends/cpu_attn.py:59).
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _fingerprint(seed: int, n_train: int, n_val: int, max_operand: int) -> dict:
    return {"version": 2, "seed": seed, "n_train": n_train, "n_val": n_val, "max_operand": max_operand,
            "model": MODEL_KW}


def build_tokenizer(out_dir: str, chars=CHARS, words=WORD_TOKENS, model_max_length: int = 4096):
    """Character-level fast tokenizer (BPE with no merges: one token per character of ``chars``, plus the
    multi-character ``words``) with ChatML specials and chat template, saved to ``out_dir``; returns it.
    Also the toy-addition task's tokenizer (scripts/experiments/toy_addition.py, its own ``chars``)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([UNK, *dict.fromkeys(chars)])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()  # plain concatenation: decode gives the text back
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        pad_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[2],
        bos_token=None,
        additional_special_tokens=[SPECIAL_TOKENS[1]],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    if words:
        fast.add_tokens(list(words))
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: str, tokenizer, seed: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        torch_dtype="float32",
        **MODEL_KW,
    )
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    # No sampling defaults in generation_config.json: rollouts must get exactly the caller's params.
    model.generation_config.do_sample = False
    model.generation_config.top_k = None
    model.generation_config.top_p = None
    model.generation_config.temperature = None
    model.save_pretrained(out_dir, safe_serialization=True)


def make_rows(split: str, n: int, rng: random.Random, max_operand: int) -> list[dict]:
    """``n`` arithmetic rows; the target is a correct worked solution in LUFFY's format."""
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-*")
        ans = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"{a}{op}{b}=?"
        target = f"<think>{a}{op}{b}={ans}</think> \\boxed{{{ans}}}"
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(ans)},
                "extra_info": {"split": split, "index": i},
                "target": [{"role": "assistant", "content": target}],
            }
        )
    return rows


def _paths(out_dir: str) -> dict:
    out_dir = os.path.abspath(out_dir)
    return {
        "tokenizer": os.path.join(out_dir, "tokenizer"),
        "model": os.path.join(out_dir, "model"),
        "train": os.path.join(out_dir, "train.parquet"),
        "val": os.path.join(out_dir, "val.parquet"),
    }


def build(out_dir: str, seed: int = 0, n_train: int = 32, n_val: int = 8, max_operand: int = 9,
          force: bool = False) -> dict:
    """Write the tiny assets into ``out_dir`` and return ``{tokenizer, model, train, val}`` (absolute).

    Deterministic for the arguments. Skips all work when ``out_dir/assets.json`` records the same
    arguments and every path exists (``force=True`` rebuilds).
    """
    import pandas as pd

    paths = _paths(out_dir)
    manifest = os.path.join(os.path.abspath(out_dir), "assets.json")
    fp = _fingerprint(seed, n_train, n_val, max_operand)
    if not force and os.path.exists(manifest) and all(os.path.exists(p) for p in paths.values()):
        with open(manifest) as f:
            if json.load(f).get("fingerprint") == fp:
                return paths

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(paths["tokenizer"])
    build_model(paths["model"], tokenizer, seed)
    rng = random.Random(seed)
    pd.DataFrame(make_rows("train", n_train, rng, max_operand)).to_parquet(paths["train"], index=False)
    pd.DataFrame(make_rows("test", n_val, rng, max_operand)).to_parquet(paths["val"], index=False)
    with open(manifest, "w") as f:
        json.dump({"fingerprint": fp, "paths": paths}, f, indent=1)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=32)
    p.add_argument("--n-val", type=int, default=8)
    p.add_argument("--force", action="store_true", help="rebuild even if the assets exist")
    a = p.parse_args(argv)
    paths = build(a.out_dir, seed=a.seed, n_train=a.n_train, n_val=a.n_val, force=a.force)
    print(json.dumps(paths, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
