"""data_source -> rule reward. `default_compute_score` is what the RewardManager calls per sample.

A score function returns a float, or a dict with a "score" key plus extra fields (e.g. "acc")
that the manager reports as reward_extra_info.
"""
from engine.rewards import arith, gsm8k, math_verify, reasoning_gym


def _math(solution_str, ground_truth, extra_info=None):
    return math_verify.compute_score(solution_str, ground_truth)


def _gsm8k(solution_str, ground_truth, extra_info=None):
    return gsm8k.compute_score(solution_str, ground_truth)


def _arith(solution_str, ground_truth, extra_info=None):
    return arith.compute_score(solution_str, ground_truth)


_REWARDS = {
    "openai/gsm8k": _gsm8k,
    "gsm8k": _gsm8k,
    "lighteval/MATH": _math,
    "DigitalLearningGmbH/MATH-lighteval": _math,
    "HuggingFaceH4/MATH-500": _math,
    "math": _math,
    "arith": _arith,
    "copy": _arith,
}


def known_data_sources():
    return sorted(_REWARDS) + [reasoning_gym.PREFIX + "<task>"]


def register_reward(data_source, fn):
    """Add (or replace) the rule reward of `data_source`: fn(solution_str, ground_truth, extra_info)."""
    _REWARDS[data_source] = fn


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source not in _REWARDS and str(data_source).startswith(reasoning_gym.PREFIX):
        task = data_source[len(reasoning_gym.PREFIX):]
        return reasoning_gym.compute_score(task, solution_str, ground_truth, extra_info)
    fn = _REWARDS.get(data_source)
    if fn is None:
        raise ValueError(f"no rule reward for data_source={data_source!r}; known data sources: "
                         f"{known_data_sources()}. Register one with "
                         "engine.rewards.register_reward(data_source, fn) or pass compute_score=")
    return fn(solution_str, ground_truth, extra_info)
