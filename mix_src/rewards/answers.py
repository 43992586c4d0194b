"""Answer handling in the caller's process: the thinking part, ``\\boxed{}``, option labels, plain numbers.

Linear-time string scanning only (no backtracking regexes on unbounded input, no sympy), so it is safe in
verl's reward threads without a timeout; symbolic maths goes to :mod:`mix_src.rewards.grading` in a worker.
"""

from __future__ import annotations

import math
import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_response(response: str, starts_in_think: bool) -> tuple[str | None, bool]:
    """``(text after the last </think>, format_ok)``; ``(None, False)`` without a ``</think>`` or, unless
    ``starts_in_think`` (the prompt ended with ``<think>``), a ``<think>`` before it. (LUFFY takes the text
    between the first and the second ``</think>``.)"""
    close = response.rfind(THINK_CLOSE)
    opening = 0 if starts_in_think else response.find(THINK_OPEN)
    if close < 0 or not 0 <= opening <= close:
        return None, False
    return response[close + len(THINK_CLOSE):], True


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else ``None``."""
    best = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if best < 0:
        return None
    i = best + (len("\\boxed") if text.startswith("\\boxed", best) else len("\\fbox"))
    while text.startswith(" ", i):
        i += 1
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced


_LATEX_SPACING = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle")


def normalize_latex(s: str) -> str:
    """A conservative normal form for exact matching: it only removes things that never change the
    value (whitespace, ``$``, sizing/spacing commands, a trailing period, ``\\dfrac``/``\\tfrac``)."""
    s = s.strip().strip("$").strip()
    inner = last_boxed(s) if s.startswith(("\\boxed", "\\fbox")) else None
    if inner is not None:
        s = inner
    for tok in _LATEX_SPACING:
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split())
    return s.rstrip(".")


# Multiple choice: option labels A-Z or 1-26; why a number k also takes the k-th letter (ARC, OpenCompass,
# lm-eval) and a letter only itself: mix_src/rewards/README.md, "Multiple-choice labels".

_LETTER_ONLY = re.compile(r"\(?\s*([A-Z])\s*\)?\s*[.:)]?")
_LABEL_ONLY = re.compile(r"\(?\s*([A-Z]|[1-9][0-9]?)\s*\)?\s*[.:)]?")
# No two unbounded quantifiers can trade characters here, so matching stays linear on long inputs.
_ANSWER_IS = re.compile(r"answer(?:\s+is)?(?:\s*:)?\s*(?:option\s+)?\(?([A-Z])\b", re.IGNORECASE)
_ANSWER_IS_LABEL = re.compile(r"answer(?:\s+is)?(?:\s*:)?\s*(?:option\s+)?\(?([A-Z]|[0-9]{1,2})\b(?![.,]\d)",
                              re.IGNORECASE)
_MC_SCAN_CHARS = 4000  # "answer is X" is searched in the last 4,000 characters of the answer
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
MAX_NUMBER_LABEL = 26  # a number label k stands for the k-th letter


def normalize_choice(value: str, numbers: bool = False) -> str | None:
    """``"B"``, ``"(B)"``, ``"B."``, ``"B) 42"``, ``"\\text{B}"`` -> ``"B"``; with ``numbers`` also ``"4"``,
    ``"(4)"``, ``"4."`` -> ``"4"``; anything else -> ``None``."""
    s = _TEXT_WRAP.sub(r"\1", value.strip()).strip().strip("$").strip()
    m = (_LABEL_ONLY if numbers else _LETTER_ONLY).match(s)
    if m is None or s[m.end():m.end() + 1].strip():  # "Bob" is not the letter B, "42x" is not the label 42
        return None
    return m.group(1)


def gold_choice(ground_truth: str) -> str | None:
    """A ground truth's option label, ``"A"``-``"Z"`` or ``"1"``-``"26"`` (``"(B)"``, ``"4."`` are fine), else None."""
    label = normalize_choice(ground_truth, numbers=True)
    if label is not None and label.isdigit() and not 1 <= int(label) <= MAX_NUMBER_LABEL:
        return None
    return label


def extract_choice(answer: str, numbers: bool = False) -> str | None:
    """The chosen label (letters; with ``numbers`` also 1-99): the last ``\\boxed{}``, else the last "answer is X"
    / "Answer: X", else an answer that is only a label; ``None`` when there is none."""
    boxed = last_boxed(answer)
    label = normalize_choice(boxed, numbers) if boxed is not None else None
    if label is not None:
        return label
    found = [m.group(1) for m in (_ANSWER_IS_LABEL if numbers else _ANSWER_IS).finditer(answer[-_MC_SCAN_CHARS:])
             if m.group(1).isupper() or m.group(1).isdigit()]
    if found:
        return found[-1]
    return normalize_choice(answer, numbers) if len(answer) < 64 else None


def choice_correct(answer: str, gold: str) -> bool:
    """Does ``answer`` choose the option ``gold`` (:func:`gold_choice`)? A number gold k takes k or the k-th letter."""
    if not gold.isdigit():
        return extract_choice(answer) == gold
    chosen = extract_choice(answer, numbers=True)
    return chosen is not None and (int(chosen) if chosen.isdigit() else ord(chosen) - ord("A") + 1) == int(gold)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")  # plain numbers in a text
_NUMBER_FULL = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(s: str) -> float | None:
    """``"1,234"``, ``"$72$"``, ``"3.5\\%"``, ``"72."`` -> float; anything but a number -> None (never evaluates)."""
    t = _TEXT_WRAP.sub(r"\1", s).strip().strip("$").strip()
    t = t.replace("\\%", "").replace("%", "").replace("\\$", "").replace("\\!", "").replace("{,}", ",")
    t = "".join(t.split()).rstrip(".")
    if not t or len(t) > 64 or _NUMBER_FULL.fullmatch(t) is None:
        return None
    if "," in t and not re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d*)?", t):
        return None  # "1,2" is a tuple, not a number
    value = float(t.replace(",", ""))  # cannot fail: t matched _NUMBER_FULL (float reads every \d, as the regex)
    return value if math.isfinite(value) else None


def numbers_equal(a: float, b: float) -> bool:
    if a.is_integer() and b.is_integer() and max(abs(a), abs(b)) < 2**53:
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


_PLAIN_INT = re.compile(r"[-+]?\d{1,50}")


def plain_int(s: str) -> int | None:
    """``"42"``, ``" -7 "``, ``"$12$"`` -> int; anything else (decimals, commas, LaTeX) -> ``None``."""
    t = s.strip().strip("$").strip()
    return int(t) if _PLAIN_INT.fullmatch(t) else None


# Texts that float() reads as NaN or infinity: a ground truth like these came from a lost value (pandas writes a
# missing answer as NaN, str() makes it 'nan'), never from a benchmark; infinity as an answer is written \infty.
NONFINITE_TEXTS = frozenset({"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"})


def unwrap(value):
    """A numpy scalar or array as Python; a one-item list or tuple as its item."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def ground_truth_problem(value) -> str | None:
    """Why ``reward_model.ground_truth`` cannot be graded, or ``None`` when it can: it must be a non-empty
    string (or an int / finite float, read as its text) that is not a NaN/inf spelling (:data:`NONFINITE_TEXTS`).
    One rule for the data check (mix_src/config/data_check.py) and the reward."""
    value = unwrap(value)
    if isinstance(value, bool) or value is None:
        return f"is {value!r}; it must be a non-empty string"
    if isinstance(value, float) and not math.isfinite(value):
        return f"is {value!r} (a missing or non-finite number)"
    if isinstance(value, (int, float)):
        return None
    if not isinstance(value, str):
        return f"is a {type(value).__name__} ({str(value)[:40]!r}); it must be a non-empty string"
    if not value.strip():
        return "is empty"
    if value.strip().lower() in NONFINITE_TEXTS:
        return f"is {value.strip()!r}, the text of a missing or non-finite number (write infinity as \\infty)"
    return None
