"""Pure-Python answer handling that runs in the caller's process: splitting off the thinking part,
``\\boxed{}`` extraction, multiple-choice letters and plain numbers.

Everything here is linear-time string scanning (no backtracking regexes on unbounded input, no sympy),
so it is safe to run in verl's reward threads without a timeout. Anything that needs symbolic maths
goes to :mod:`mix_src.rewards.grading` inside a worker process with a hard deadline.
"""

from __future__ import annotations

import math
import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_response(response: str, starts_in_think: bool) -> tuple[str | None, bool]:
    """Return ``(answer_segment, format_ok)`` for a decoded response.

    The answer is the text after the **last** ``</think>``; the response is well formed when it has a
    ``</think>`` and, unless it ``starts_in_think`` (the prompt ended with ``<think>``), a ``<think>``
    before it. Without a well-formed think block the answer segment is ``None``.
    (LUFFY takes the text between the first and the second ``</think>``.)
    """
    close = response.rfind(THINK_CLOSE)
    if close < 0:
        return None, False
    if not starts_in_think:
        opening = response.find(THINK_OPEN)
        if opening < 0 or opening > close:
            return None, False
    return response[close + len(THINK_CLOSE):], True


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else ``None``."""
    best = -1
    for tag in ("\\boxed", "\\fbox"):
        best = max(best, text.rfind(tag))
    if best < 0:
        return None
    i = best + (len("\\boxed") if text.startswith("\\boxed", best) else len("\\fbox"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth, start = 0, i + 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:j]
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


# ----------------------------------------------------------------------------------------------------
# Multiple choice
#
# An option label is a letter A-Z, or a number 1-26 (public ARC files label some questions' options 1-4).
# A number gold k is answered by the number k or by the k-th letter (1 = A, 2 = B, ...): ARC numbers its
# options in order, and OpenCompass's and lm-eval's ARC loaders turn label k into the k-th letter in the
# same way. A letter gold is answered by that letter only (LUFFY's and OpenCompass's graders accept no
# number for it). The text of an option is never matched: the reward does not see the options.

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
    """``"B"``, ``"(B)"``, ``"B."``, ``"B) 42"``, ``"\\text{B}"`` -> ``"B"``; with ``numbers`` also
    ``"4"``, ``"(4)"``, ``"4."`` -> ``"4"``; anything else -> ``None``."""
    s = _TEXT_WRAP.sub(r"\1", value.strip()).strip().strip("$").strip()
    m = (_LABEL_ONLY if numbers else _LETTER_ONLY).match(s)
    if m is None:
        return None
    rest = s[m.end():]
    if rest and not rest[0].isspace():  # "Bob" is not the letter B, "42x" is not the label 42
        return None
    return m.group(1)


def gold_choice(ground_truth: str) -> str | None:
    """The option label of a multiple-choice ground truth: a letter ``"A"``-``"Z"`` or a number
    ``"1"``-``"26"`` (``"(B)"``, ``"4."`` are fine); ``None`` when it is neither."""
    label = normalize_choice(ground_truth, numbers=True)
    if label is not None and label.isdigit() and not 1 <= int(label) <= MAX_NUMBER_LABEL:
        return None
    return label


def extract_choice(answer: str, numbers: bool = False) -> str | None:
    """The chosen label: the last ``\\boxed{}``, else the last "answer is X" / "Answer: X", else an
    answer that is only a label. Labels are letters, and with ``numbers`` also numbers 1-99. ``None``
    when no label is found."""
    boxed = last_boxed(answer)
    if boxed is not None:
        label = normalize_choice(boxed, numbers)
        if label is not None:
            return label
    found = None
    for m in (_ANSWER_IS_LABEL if numbers else _ANSWER_IS).finditer(answer[-_MC_SCAN_CHARS:]):
        if m.group(1).isupper() or m.group(1).isdigit():
            found = m.group(1)
    if found is not None:
        return found
    return normalize_choice(answer, numbers) if len(answer) < 64 else None


def choice_correct(answer: str, gold: str) -> bool:
    """Does ``answer`` choose the option labelled ``gold`` (from :func:`gold_choice`)? A letter gold
    needs that letter; a number gold k takes k or the k-th letter."""
    if not gold.isdigit():
        return extract_choice(answer) == gold
    chosen = extract_choice(answer, numbers=True)
    if chosen is None:
        return False
    if chosen.isdigit():
        return int(chosen) == int(gold)
    return ord(chosen) - ord("A") + 1 == int(gold)


# ----------------------------------------------------------------------------------------------------
# Plain numbers

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_NUMBER_FULL = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(s: str) -> float | None:
    """``"1,234"``, ``"$72$"``, ``"3.5\\%"``, ``"72."`` -> float; anything that is not just a number ->
    ``None``. Never evaluates expressions."""
    t = _TEXT_WRAP.sub(r"\1", s).strip().strip("$").strip()
    t = t.replace("\\%", "").replace("%", "").replace("\\$", "").replace("\\!", "").replace("{,}", ",")
    t = "".join(t.split()).rstrip(".")
    if not t or len(t) > 64 or _NUMBER_FULL.fullmatch(t) is None:
        return None
    if "," in t and not re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d*)?", t):
        return None  # "1,2" is a tuple, not a number
    try:
        value = float(t.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def extract_number(answer: str) -> str | None:
    """The candidate number text: the last ``\\boxed{}`` content, else the last number in the text."""
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed
    last = None
    for m in _NUMBER.finditer(answer):
        last = m.group(0)
    return last


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


def ground_truth_problem(value) -> str | None:
    """Why ``reward_model.ground_truth`` cannot be graded, or ``None`` when it can: it must be a non-empty
    string (or an int / finite float, read as its text) that is not a NaN/inf spelling (:data:`NONFINITE_TEXTS`).
    One rule for the data check (mix_src/config/data_check.py) and the reward."""
    if hasattr(value, "tolist") and not isinstance(value, str):  # numpy scalars and arrays
        value = value.tolist()
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
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
