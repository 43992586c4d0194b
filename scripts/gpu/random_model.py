"""A model, tokenizer and data with no Hub: ``random:<shape>`` for ``make smoke-gpu MODEL=random:<shape>``.

Writes into OUT_DIR:

    model/        a random-initialised Qwen2ForCausalLM of the shape (SHAPES: Qwen2.5-0.5B-Instruct's and
                  Qwen2.5-1.5B's from mix_src/planner/presets.py in bf16, and ``tiny`` for the CPU backend in fp32),
                  saved as a Hugging Face model directory with its tokenizer beside it (vLLM loads both from the path).
    train.parquet, val.parquet
                  one-digit "a+b=?" questions (every prompt the same number of tokens) in verl's schema with LUFFY's
                  ``target`` column: a worked solution of exactly ``response_length - 1`` tokens, so that a prefix
                  row (the whole target + EOS, mix_src/algo/prefix.py ``build_prefix``) is as long as a sampled row
                  under ``actor_rollout_ref.rollout.ignore_eos=true``.
    assets.json   the paths and a fingerprint of the arguments (a second build with the same ones does nothing).

The tokenizer is generated, not shipped (it is ~10 MB; the tree travels to an air-gapped node): a Qwen2 byte-level
BPE (transformers' ``Qwen2Tokenizer``: Qwen2's pre-tokenizer regex, NFC, byte-level decoding) whose vocabulary is
rule-made: the 256 byte symbols, then every pair of them, then (pair, byte) triples up to id 151,642; Qwen's
``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>`` at Qwen2.5's ids 151,643-151,645; then ``<|reserved_k|>``
tokens up to the shapes' ``vocab_size``, 151,936 (Qwen2.5's tokenizer stops at 151,664; verl masks ids past the
tokenizer in vLLM, here none are). So every id the model can sample decodes, and ``decode(encode(text)) == text``.
It is a Qwen2 tokenizer in structure, so transformers' Qwen2 class, which replaces a custom tokenizer that sits next
to a qwen2 ``config.json`` (scripts/make_tiny_assets.py), leaves it unchanged. Chat template: ChatML (as Qwen2.5's,
without its default system message).

``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` are set before transformers is imported (:func:`offline`): a
build or run that reaches for the Hub raises instead of downloading.

Usage::

    python -m scripts.gpu.random_model random:qwen2.5-0.5b OUT_DIR [--response-length 512]
    from scripts.gpu.random_model import build; build("random:tiny", out_dir, response_length=32)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys

from mix_src.planner.presets import PRESETS

PREFIX = "random:"
VOCAB_SIZE = 151936  # Qwen2.5's config.json vocab_size (0.5B and 1.5B alike)
N_BPE = 151643  # Qwen2.5's BPE vocabulary: ids 0..151,642; its added tokens start at 151,643
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 151643, 151644, 151645 as in Qwen2.5
EOS, PAD = "<|im_end|>", "<|endoftext|>"  # Qwen2.5-Instruct's tokenizer_config.json
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DATA_SOURCE = "random_arith"


def _qwen(preset: str) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "tie_word_embeddings")
    return {k: PRESETS[preset][k] for k in keys} | {"dtype": "bfloat16"}


SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": _qwen("Qwen/Qwen2.5-0.5B-Instruct"),  # 494,032,768 parameters
    "qwen2.5-1.5b": _qwen("Qwen/Qwen2.5-1.5B"),  # 1,543,714,304 parameters
    # the CPU backend's: scripts/make_tiny_assets.py's shape (head 32: vLLM's CPU attention's smallest) with the
    # whole vocabulary, fp32 as the CPU backend trains
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                 tie_word_embeddings=True, dtype="float32"),
}


def offline() -> None:
    """No Hub from here on, in this process and its children: huggingface_hub raises on any download."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def shape_of(spec: str) -> str:
    """``random:<shape>`` -> the shape's name; anything else is refused, naming the shapes."""
    name = spec[len(PREFIX):] if spec.startswith(PREFIX) else None
    if name not in SHAPES:
        raise ValueError(f"model {spec!r}: expected random:<shape> with a shape of {sorted(SHAPES)} "
                         "(scripts/gpu/random_model.py SHAPES)")
    return name


def vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The rule-made BPE vocabulary (N_BPE entries) and its merges, in rank order: bytes, pairs, then triples."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())  # the 256 byte symbols of byte-level BPE, in byte order
    vocab = {s: i for i, s in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    pairs = [(a, b) for a in symbols for b in symbols]
    for left, right in itertools.chain(pairs, ((a + b, c) for a, b in pairs for c in symbols)):
        if len(vocab) == N_BPE:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    return vocab, merges


def build_tokenizer(out_dir: str, vocab_size: int = VOCAB_SIZE):
    """The tokenizer of the module docstring, ``len == vocab_size``, saved to ``out_dir``; returns it."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab, merges = vocabulary()
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)  # adds <|endoftext|> (its unk/eos/pad default) at N_BPE
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tok.eos_token, tok.pad_token = EOS, PAD
    tok.add_tokens([f"<|reserved_{k}|>" for k in range(vocab_size - len(tok))])
    got = tok.convert_tokens_to_ids(SPECIALS)
    if got != list(range(N_BPE, N_BPE + len(SPECIALS))) or len(tok) != vocab_size:
        raise RuntimeError(f"tokenizer: specials at {got}, {len(tok)} ids; expected {N_BPE}.. and {vocab_size}")
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    tok.save_pretrained(out_dir)
    return tok


def build_model(shape: str, out_dir: str, tokenizer, seed: int) -> None:
    """A random-initialised Qwen2ForCausalLM of ``SHAPES[shape]`` (transformers' own init), on the CPU."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(SHAPES[shape])
    dtype = kw.pop("dtype")
    cfg = Qwen2Config(**kw, dtype=dtype, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM._from_config(cfg, dtype=getattr(torch, dtype))
    # No sampling defaults in generation_config.json: rollouts get exactly the caller's params.
    gen = model.generation_config
    gen.do_sample, gen.top_k, gen.top_p, gen.temperature = False, None, None, None
    model.save_pretrained(out_dir)


def full_length_target(tokenizer, answer: int, n_tokens: int) -> str:
    """``<think>`` + digits + ``</think> \\boxed{answer}`` of exactly ``n_tokens`` tokens (each digit is one token:
    Qwen2's pre-tokenizer splits numbers into single digits)."""
    head, tail = "<think>", f"</think> \\boxed{{{answer}}}"
    room = n_tokens - len(tokenizer.encode(head + tail, add_special_tokens=False))
    if room < 1:
        raise ValueError(f"a full-length target needs more than {n_tokens} tokens: raise the response length "
                         f"(data.max_response_length) to at least {n_tokens - room + 2}")
    text = head + ("0123456789" * (room // 10 + 1))[:room] + tail
    got = len(tokenizer.encode(text, add_special_tokens=False))
    if got != n_tokens:
        raise RuntimeError(f"target {text!r}: {got} tokens, expected {n_tokens}")
    return text


def make_rows(split: str, n: int, rng: random.Random, tokenizer, target_tokens: int) -> list[dict]:
    """``n`` one-digit addition rows (every prompt the same length) with full-length targets."""
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({
            "data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}+{b}=?"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"split": split, "index": i},
            "target": [{"role": "assistant", "content": full_length_target(tokenizer, a + b, target_tokens)}],
        })  # fmt: skip
    return rows


def build(spec: str, out_dir: str, *, response_length: int, seed: int = 0, n_train: int = 32, n_val: int = 8,
          force: bool = False) -> dict:
    """Write ``random:<shape>``'s model (with its tokenizer) and data into ``out_dir``; return ``{model, tokenizer,
    train, val}`` (absolute paths; the tokenizer is the model directory). Deterministic for the arguments; nothing
    is done when ``out_dir/assets.json`` records the same arguments and the paths exist (``force`` rebuilds)."""
    offline()
    shape = shape_of(spec)
    out_dir = os.path.abspath(out_dir)
    model_dir = os.path.join(out_dir, "model")
    paths = {"model": model_dir, "tokenizer": model_dir, "train": os.path.join(out_dir, "train.parquet"),
             "val": os.path.join(out_dir, "val.parquet")}
    manifest = os.path.join(out_dir, "assets.json")
    fingerprint = {"version": 1, "shape": SHAPES[shape], "response_length": response_length, "seed": seed,
                   "n_train": n_train, "n_val": n_val}
    if not force and os.path.exists(manifest) and all(os.path.exists(p) for p in paths.values()):
        with open(manifest) as f:
            if json.load(f).get("fingerprint") == fingerprint:
                return paths

    import pandas as pd

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(model_dir, SHAPES[shape]["vocab_size"])
    build_model(shape, model_dir, tokenizer, seed)
    rng = random.Random(seed)
    for split, n, path in (("train", n_train, paths["train"]), ("test", n_val, paths["val"])):
        pd.DataFrame(make_rows(split, n, rng, tokenizer, response_length - 1)).to_parquet(path, index=False)
    with open(manifest, "w") as f:
        json.dump({"fingerprint": fingerprint, "paths": paths}, f, indent=1)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help=f"random:<shape>, a shape of {sorted(SHAPES)}")
    p.add_argument("out_dir")
    p.add_argument("--response-length", type=int, default=512, help="data.max_response_length of the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if the assets exist")
    a = p.parse_args(argv)
    print(json.dumps(build(a.model, a.out_dir, response_length=a.response_length, seed=a.seed, force=a.force),
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
