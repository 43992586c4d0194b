"""Second toy task family for the comparison harness: sort the digits of a 5-digit string, by counting.

Prompt (the user message): ``"31415"``. Expert solution (the ``target``): one ``<digit><count>`` pair per
distinct digit in ascending order, then ``>`` and the sorted string::

    31415  ->  "12 31 41 51>11345"      (1 twice; 3, 4 and 5 once)

The structure differs from addition (:mod:`scripts.experiments.toy_tasks.addition`): no columns or carries, but a histogram
of the input then its expansion, whose length depends on the counts.

The "base" model is pre-trained on strings whose 5 digits are all **distinct** (every count is 1). It knows
the format, and writes every present digit once: on a string with a repeated digit its answer is one digit
short, so its pass rate on the training / held-out class is about 0.

* training and held-out class ``pair``: exactly one digit appears twice, the other three once
  (10 * C(9,3) * 5!/2! = 50,400 strings);
* out-of-distribution class ``triple``: one digit appears three times, two others once (a count of 3 never
  appears in training; 7,200 strings).

Reward: :func:`compute_score` (verl's custom-reward signature): 1 when the characters right after the first
``>`` are exactly the sorted string (the histogram before it is not graded). Standard library only.

RL runs on this task add ``+task=sort`` to the toy recipes (``recipes/toy_addition/task/sort.yaml``: this
reward, 24-token responses, lr 1e-4; at addition's 5e-4 every RL run lost accuracy, scripts/experiments/README.md).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from typing import Optional

DATA_SOURCE = "toy_sort"
OOD_SOURCE = "toy_sort_ood"
LENGTH = 5
ANSWER_SEP = ">"
_ANSWER_RE = re.compile(re.escape(ANSWER_SEP) + r"(\d+)")
CLASSES = {"distinct": (1, 1, 1, 1, 1), "pair": (2, 1, 1, 1), "triple": (3, 1, 1)}  # sorted count profile


def count_profile(s: str) -> tuple[int, ...]:
    return tuple(sorted(Counter(s).values(), reverse=True))


def expert_trace(s: str) -> str:
    """``<digit><count>`` for each distinct digit ascending, ``>``, the sorted string."""
    c = Counter(s)
    return " ".join(f"{d}{c[d]}" for d in sorted(c)) + ANSWER_SEP + "".join(sorted(s))


def extract_answer(solution: str) -> Optional[str]:
    m = _ANSWER_RE.search(solution)
    return m.group(1) if m else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """``score`` = ``acc`` = 1.0 when the digits after the first ``>`` are exactly ``ground_truth``;
    ``format_ok``: the whole response is one well-formed trace (logged only)."""
    answer = extract_answer(solution_str)
    correct = answer is not None and answer == str(ground_truth)
    text = solution_str.strip()
    pairs, sep, ans = text.partition(ANSWER_SEP)
    cols = pairs.split(" ")
    fmt = bool(sep) and all(len(x) == 2 and x.isdigit() for x in cols) and ans.isdigit()
    return {"score": float(correct), "acc": float(correct), "format_ok": float(fmt)}


def sample(n: int, rng: random.Random, cls: str, exclude=()) -> list[str]:
    """``n`` distinct 5-digit strings (leading zeros allowed) of count profile ``cls``."""
    want, seen, out = CLASSES[cls], set(exclude), []
    while len(out) < n:
        s = "".join(rng.choice("0123456789") for _ in range(LENGTH))
        if s in seen or count_profile(s) != want:
            continue
        seen.add(s)
        out.append(s)
    return out


def splits(seed: int = 0, n_train: int = 4096, n_heldout: int = 200, n_ood: int = 200) -> dict[str, list[str]]:
    rng = random.Random(seed)
    heldout = sample(n_heldout, rng, "pair")
    train = sample(n_train, rng, "pair", exclude=heldout)
    return {"train": train, "heldout": heldout, "ood": sample(n_ood, rng, "triple")}


def make_row(s: str, split: str, index: int, data_source: str = DATA_SOURCE) -> dict:
    """verl's RL schema plus LUFFY's ``target`` column."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": s}],
        "ability": "sorting",
        "reward_model": {"style": "rule", "ground_truth": "".join(sorted(s))},
        "extra_info": {"split": split, "index": index, "digits": s},
        "target": [{"role": "assistant", "content": expert_trace(s)}],
    }
