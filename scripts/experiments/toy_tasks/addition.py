"""Toy task for LUFFY-in-miniature: 3-digit addition with a step-by-step, least-significant-digit-first trace.

Prompt (the user message): ``"123+459"``. Expert solution (the ``target``), one ``<digit><carry>`` pair per
column from the units up, then ``>`` and the 4-digit sum::

    123+459  ->  "21 80 50>0582"      (3+9=12: digit 2 carry 1; 2+5+1=8: 8 0; 1+4=5: 5 0; answer 0582)

The "base" model is pre-trained on *carry-free* traces of the same problems: every column is written as
``(a_i + b_i) mod 10`` with carry 0, and the answer is those digits (``"20 70 50>0572"`` for the problem above).
It knows the format but not the skill, so its pass rate on problems with a carry is about 0. Training and
held-out problems all have at least one carry.

Reward: :func:`compute_score` (verl's custom-reward signature), 1 when the digits right after the first ``>``
equal the sum. Select it with ``reward.custom_reward_function.path=pkg://scripts.experiments.toy_tasks.addition`` and
``reward.custom_reward_function.name=compute_score``.

Pure: standard library only (no torch, no verl), so it loads in milliseconds in every reward worker.
"""

from __future__ import annotations

import random
import re
from typing import Iterable, Optional, Union

DATA_SOURCE = "toy_addition"
N_DIGITS = 3  # the experiment's operands are 100..999; the demo variant (scripts/experiments/demo.py) uses 2
ANSWER_SEP = ">"
_ANSWER_RE = re.compile(re.escape(ANSWER_SEP) + r"(\d+)")


def operand_range(n_digits: int = N_DIGITS) -> tuple[int, int]:
    """Smallest and largest ``n_digits``-digit operand (100..999 for 3)."""
    return 10 ** (n_digits - 1), 10**n_digits - 1


def n_columns(a: int, b: int) -> int:
    """Columns of the trace: the digit count of the longer operand."""
    return max(len(str(a)), len(str(b)))


def digits_lsd(x: int, n: int = N_DIGITS) -> list[int]:
    """Digits of ``x``, least significant first, zero-padded to ``n``."""
    return [(x // 10**i) % 10 for i in range(n)]


def carries(a: int, b: int) -> list[int]:
    """Carry out of each column (units first) when adding ``a + b`` column by column."""
    out, c, n = [], 0, n_columns(a, b)
    for da, db in zip(digits_lsd(a, n), digits_lsd(b, n)):
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
    """The correct step-by-step solution (the LUFFY ``target``): digit/carry pairs, ``>``, the sum with one
    digit more than the operands (4 digits for 3-digit operands)."""
    pairs, c, n = [], 0, n_columns(a, b)
    for da, db in zip(digits_lsd(a, n), digits_lsd(b, n)):
        s = da + db + c
        c = s // 10
        pairs.append(f"{s % 10}{c}")
    return " ".join(pairs) + f"{ANSWER_SEP}{a + b:0{n + 1}d}"


def carry_free_trace(a: int, b: int) -> str:
    """The base model's (wrong on carry problems) procedure: column sums mod 10, carries always 0."""
    n = n_columns(a, b)
    ds = [(da + db) % 10 for da, db in zip(digits_lsd(a, n), digits_lsd(b, n))]
    answer = "0" + "".join(str(d) for d in reversed(ds))
    return " ".join(f"{d}0" for d in ds) + f"{ANSWER_SEP}{answer}"


def extract_answer(solution: str) -> Optional[int]:
    """The integer written right after the first ``>`` (None when there is none)."""
    m = _ANSWER_RE.search(solution)
    return int(m.group(1)) if m else None


def _is_trace(text: str) -> bool:
    """One well-formed trace: k ``<digit><carry>`` pairs, ``>``, then a (k+1)-digit answer."""
    pairs, sep, answer = text.partition(ANSWER_SEP)
    cols = pairs.split(" ")
    return (bool(sep) and all(len(c) == 2 and c.isdigit() for c in cols)
            and len(answer) == len(cols) + 1 and answer.isdigit())


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl custom reward: ``score`` = ``acc`` = 1.0 when the final answer equals ``ground_truth``.

    ``format_ok`` (1.0/0.0) says whether the whole response is one well-formed trace (logged only).
    """
    answer = extract_answer(solution_str)
    correct = answer is not None and answer == int(ground_truth)
    format_ok = _is_trace(solution_str.strip())
    return {"score": float(correct), "acc": float(correct), "format_ok": float(format_ok)}


def no_incoming_carry(a: int, b: int) -> bool:
    """No column receives a carry: every column's carry but the last one's (which only writes the sum's
    leading digit) is 0. ``52+61`` (``30 11>113``) qualifies, ``27+48`` (units carry into the tens) does not."""
    return not any(carries(a, b)[:-1])


def _units_only_carry(a: int, b: int) -> bool:
    c = carries(a, b)
    return c[0] == 1 and not any(c[1:])


# Named problem classes (``carry=<name>``). The demo's pair: training and in-distribution problems carry
# out of the units column only, with units digits summing to 10..15; the out-of-distribution class carries
# the same way but from the 6 digit pairs summing to 16..18 (7+9, 8+8, 9+7, 8+9, 9+8, 9+9), which no
# training problem contains: the carry rule has to transfer to digit pairs it was never shown for.
# ``no_incoming_carry`` is the demo base's pre-training class (scripts/experiments/toy_addition.py PRETRAIN_DATA):
# its expert traces write carries only out of the last column, so they never show a carry being added.
PROBLEM_CLASSES = {
    "no_incoming_carry": no_incoming_carry,
    "units_carry": lambda a, b: _units_only_carry(a, b) and a % 10 + b % 10 <= 15,
    "units_carry_ood": lambda a, b: _units_only_carry(a, b) and a % 10 + b % 10 >= 16,
}
CarrySpec = Optional[Union[bool, str]]


def matches(a: int, b: int, carry: CarrySpec) -> bool:
    """``carry``: None = any problem, True = at least one carry, False = none, a name = a
    :data:`PROBLEM_CLASSES` entry."""
    if carry is None:
        return True
    if isinstance(carry, bool):
        return has_carry(a, b) == carry
    if carry not in PROBLEM_CLASSES:
        raise ValueError(f"unknown problem class {carry!r}; known: {sorted(PROBLEM_CLASSES)}")
    return PROBLEM_CLASSES[carry](a, b)


def all_problems(carry: CarrySpec, n_digits: int = N_DIGITS) -> list[tuple[int, int]]:
    """Every ``n_digits``-digit problem matching ``carry``, in order (for small classes: 2 digits)."""
    lo, hi = operand_range(n_digits)
    return [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1) if matches(a, b, carry)]


def sample_problems(n: int, rng: random.Random, *, carry: CarrySpec = True,
                    exclude: Iterable[tuple[int, int]] = (), n_digits: int = N_DIGITS) -> list[tuple[int, int]]:
    """``n`` distinct problems ``(a, b)`` with ``n_digits``-digit operands whose carries match ``carry``
    (see :func:`matches`). Problems in ``exclude`` are never drawn."""
    seen = set(exclude)
    lo, hi = operand_range(n_digits)
    out = []
    while len(out) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen or not matches(a, b, carry):
            continue
        seen.add((a, b))
        out.append((a, b))
    return out


def make_row(a: int, b: int, split: str, index: int, data_source: str = DATA_SOURCE) -> dict:
    """One row in verl's RL schema plus LUFFY's ``target`` column (the expert trace). ``data_source`` names
    the row's metric group (verl logs ``val-core/<data_source>/acc/mean@1``)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt_text(a, b)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
        "target": [{"role": "assistant", "content": expert_trace(a, b)}],
    }


def splits(seed: int = 0, n_train: int = 4096, n_heldout: int = 200, n_digits: int = N_DIGITS,
           carry: CarrySpec = True) -> dict[str, list[tuple[int, int]]]:
    """Held-out problems first (fixed by ``seed``), then disjoint training problems, both with carries
    matching ``carry`` (:func:`matches`)."""
    rng = random.Random(seed)
    heldout = sample_problems(n_heldout, rng, carry=carry, n_digits=n_digits)
    train = sample_problems(n_train, rng, carry=carry, exclude=heldout, n_digits=n_digits)
    return {"train": train, "heldout": heldout}
