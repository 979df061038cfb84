"""GSM8K rule reward: the final answer follows "####" (strict) or is the last number (flexible).

    no answer found               -> 0.0
    answer found but wrong        -> format_score (the response followed the format)
    answer equals the ground truth -> score

Commas and "$" are stripped before comparing, and numbers compare by value ("42.0" == "42").

Tests: tests/test_rewards.py
"""
import re
from fractions import Fraction

_STRICT = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_FLEXIBLE = re.compile(r"-?\$?[\d,]*\.?\d+")
# Only the end of a long chain of thought can hold the final answer; bounds the regex work.
_TAIL_CHARS = 1000


def _clean(number):
    return number.replace(",", "").replace("$", "").strip().rstrip(".")


def extract_solution(solution_str, method="strict"):
    """The final answer as a clean number string, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction method={method!r}; choose 'strict' or 'flexible'")
    text = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(text)
    else:
        matches = [m for m in _FLEXIBLE.findall(text) if any(c.isdigit() for c in m)]
    if not matches:
        return None
    return _clean(matches[-1]) or None


def _same_number(a, b):
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return a == b


def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, _clean(str(ground_truth))) else format_score
