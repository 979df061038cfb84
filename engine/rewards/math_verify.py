"""Rule reward for MATH-style answers: the last \\boxed{...} of the response vs the ground truth.

Both sides are normalised (spacing, \\left/\\right, \\dfrac, units in \\text{}, degrees, percent,
"x = ", trailing ".0", thousands commas ...) and compared as strings, then as exact rationals
(integers, decimals, a/b, \\frac{a}{b}), then, when sympy is importable, symbolically for short
expressions (\\sqrt, \\pi, products, powers) only: the size limits keep sympy from hanging.

Tests: tests/test_rewards.py
"""
import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_SYMPY_MAX_CHARS = 80
_SYMPY_MAX_EXPONENT = 64


def last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}, or "\\boxed 5"), or None."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed"):] if rest.startswith("\\boxed") else rest[len("\\fbox"):]
    if rest.startswith(" "):  # "\boxed 5": the argument runs to the next "$" or space
        return rest[1:].split("$")[0].split(" ")[0] or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += char == "{"
        depth -= char == "}"
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced braces: the answer was cut off


def _strip_text_wrappers(s):
    # A trailing \text{...} after a number is a unit ("5\text{ cm}"); any other \text{X} is X.
    s = re.sub(r"^(.*?\d)\s*\\(?:text|mbox|mathrm)\{[^{}]*\}$", r"\1", s)
    return re.sub(r"\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}", r"\1", s)


def _fix_fracs(s):
    # \frac12 -> \frac{1}{2}, \frac1{b} -> \frac{1}{b}, \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\w)(\w)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\w)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\w)", r"\\frac{\1}{\2}", s)
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize(answer):
    """Canonical string form of a math answer."""
    s = str(answer).strip()
    s = s.replace("\n", "").rstrip(".").strip("$")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle"):
        s = s.replace(token, "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("\\circ", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = _strip_text_wrappers(s.replace("\\ ", " ")).replace(" ", "")
    s = re.sub(r"^[a-zA-Z]\w*=", "", s)  # "x=5" -> "5"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators, not tuples
        s = s.replace(",", "")
    s = re.sub(r"(\d)\.0+$", r"\1", s)  # "5.00" -> "5"
    s = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", s)  # ".5" -> "0.5"
    return _fix_fracs(s)


def _as_rational(s):
    """Exact value of an integer, decimal, a/b or \\frac{a}{b} (optionally negated), else None."""
    sign = 1
    if s.startswith("-"):
        sign, s = -1, s[1:]
    match = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(r"(-?[\d.]+)/(-?[\d.]+)", s)
    try:
        if match:
            return sign * Fraction(match.group(1)) / Fraction(match.group(2))
        if re.fullmatch(r"\d*\.?\d+", s):
            return sign * Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _latex_to_sympy_text(s):
    for _ in range(4):  # nested fractions, innermost first
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    return s.replace("{", "(").replace("}", ")")


def _sympy_equal(a, b):
    """Symbolic equality for short, simple expressions; False when sympy is missing or unsure."""
    if max(len(a), len(b)) > _SYMPY_MAX_CHARS:
        return False
    texts = [_latex_to_sympy_text(x) for x in (a, b)]
    if any("\\" in t or not re.fullmatch(r"[\w\s.+\-*/()]*", t) for t in texts):
        return False
    if any(int(e) > _SYMPY_MAX_EXPONENT for t in texts for e in re.findall(r"\*\*\(?(\d+)", t)):
        return False
    try:
        import sympy
        from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                                standard_transformations)
        transforms = standard_transformations + (implicit_multiplication_application,)
        x, y = (parse_expr(t, transformations=transforms, evaluate=True) for t in texts)
        return bool(sympy.expand(x - y) == 0)
    except Exception:  # unparsable input is simply "not equal"
        return False


def is_equiv(answer, ground_truth):
    a, b = normalize(answer), normalize(ground_truth)
    if a == b:
        return True
    ra, rb = _as_rational(a), _as_rational(b)
    if ra is not None and rb is not None:
        return ra == rb
    return _sympy_equal(a, b)


def compute_score(solution_str, ground_truth):
    """1.0 when the last boxed answer equals the ground truth (itself boxed or plain), else 0.0."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = last_boxed(str(ground_truth)) or str(ground_truth)
    return 1.0 if is_equiv(answer, truth) else 0.0
