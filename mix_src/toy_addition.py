"""Toy task for LUFFY-in-miniature: 3-digit addition with a step-by-step, least-significant-digit-first trace.

Prompt (the user message): ``"123+459"``. Expert solution (the ``target``), one ``<digit><carry>`` pair per
column from the units up, then ``>`` and the 4-digit sum::

    123+459  ->  "21 80 50>0582"      (3+9=12: digit 2 carry 1; 2+5+1=8: 8 0; 1+4=5: 5 0; answer 0582)

The "base" model is pre-trained on *carry-free* traces of the same problems: every column is written as
``(a_i + b_i) mod 10`` with carry 0, and the answer is those digits (``"20 70 50>0572"`` for the problem above).
It knows the format but not the skill, so its pass rate on problems with a carry is about 0. Training and
held-out problems all have at least one carry.

Reward: :func:`compute_score` (verl's custom-reward signature), 1 when the digits right after the first ``>``
equal the sum. Select it with ``reward.custom_reward_function.path=pkg://mix_src.toy_addition`` and
``reward.custom_reward_function.name=compute_score``.

Pure: standard library only (no torch, no verl), so it loads in milliseconds in every reward worker.
"""

from __future__ import annotations

import random
import re
from typing import Iterable, Optional

DATA_SOURCE = "toy_addition"
N_DIGITS = 3
LO, HI = 10 ** (N_DIGITS - 1), 10**N_DIGITS - 1  # operands are 100..999
ANSWER_SEP = ">"
_ANSWER_RE = re.compile(re.escape(ANSWER_SEP) + r"(\d+)")
_TRACE_RE = re.compile(r"^\d\d \d\d \d\d" + re.escape(ANSWER_SEP) + r"\d{4}$")


def digits_lsd(x: int, n: int = N_DIGITS) -> list[int]:
    """Digits of ``x``, least significant first, zero-padded to ``n``."""
    return [(x // 10**i) % 10 for i in range(n)]


def carries(a: int, b: int) -> list[int]:
    """Carry out of each column (units first) when adding ``a + b`` column by column."""
    out, c = [], 0
    for da, db in zip(digits_lsd(a), digits_lsd(b)):
        c = (da + db + c) // 10
        out.append(c)
    return out


def has_carry(a: int, b: int) -> bool:
    return any(carries(a, b))


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}"


def parse_prompt(text: str) -> tuple[int, int]:
    a, b = text.strip().split("+")
    return int(a), int(b)


def expert_trace(a: int, b: int) -> str:
    """The correct step-by-step solution (the LUFFY ``target``): digit/carry pairs, ``>``, 4-digit sum."""
    pairs, c = [], 0
    for da, db in zip(digits_lsd(a), digits_lsd(b)):
        s = da + db + c
        c = s // 10
        pairs.append(f"{s % 10}{c}")
    return " ".join(pairs) + f"{ANSWER_SEP}{a + b:0{N_DIGITS + 1}d}"


def carry_free_trace(a: int, b: int) -> str:
    """The base model's (wrong on carry problems) procedure: column sums mod 10, carries always 0."""
    ds = [(da + db) % 10 for da, db in zip(digits_lsd(a), digits_lsd(b))]
    answer = "0" + "".join(str(d) for d in reversed(ds))
    return " ".join(f"{d}0" for d in ds) + f"{ANSWER_SEP}{answer}"


def extract_answer(solution: str) -> Optional[int]:
    """The integer written right after the first ``>`` (None when there is none)."""
    m = _ANSWER_RE.search(solution)
    return int(m.group(1)) if m else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl custom reward: ``score`` = ``acc`` = 1.0 when the final answer equals ``ground_truth``.

    ``format_ok`` (1.0/0.0) says whether the whole response is one well-formed trace (logged only).
    """
    answer = extract_answer(solution_str)
    correct = answer is not None and answer == int(ground_truth)
    format_ok = bool(_TRACE_RE.match(solution_str.strip()))
    return {"score": float(correct), "acc": float(correct), "format_ok": float(format_ok)}


def sample_problems(n: int, rng: random.Random, *, carry: Optional[bool] = True,
                    exclude: Iterable[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """``n`` distinct problems ``(a, b)`` with 3-digit operands; ``carry``: True = at least one carry,
    False = none, None = any. Problems in ``exclude`` are never drawn."""
    seen = set(exclude)
    out = []
    while len(out) < n:
        a, b = rng.randint(LO, HI), rng.randint(LO, HI)
        if (a, b) in seen or (carry is not None and has_carry(a, b) != carry):
            continue
        seen.add((a, b))
        out.append((a, b))
    return out


def make_row(a: int, b: int, split: str, index: int) -> dict:
    """One row in verl's RL schema plus LUFFY's ``target`` column (the expert trace)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt_text(a, b)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
        "target": [{"role": "assistant", "content": expert_trace(a, b)}],
    }


def splits(seed: int = 0, n_train: int = 4096, n_heldout: int = 200) -> dict[str, list[tuple[int, int]]]:
    """Held-out carry problems first (fixed by ``seed``), then disjoint carry training problems."""
    rng = random.Random(seed)
    heldout = sample_problems(n_heldout, rng, carry=True)
    train = sample_problems(n_train, rng, carry=True, exclude=heldout)
    return {"train": train, "heldout": heldout}
