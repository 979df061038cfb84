"""data_source -> rule reward. `default_compute_score` is what the RewardManager calls per sample.

A score function returns a float, or a dict with a "score" key plus extra fields (e.g. "acc")
that the manager reports as reward_extra_info.

Tests: tests/test_rewards.py, tests/test_sandbox.py
"""
from engine.rewards import arith, code, gsm8k, math_verify, reasoning_gym


def _math(solution_str, ground_truth, extra_info=None):
    return math_verify.compute_score(solution_str, ground_truth)


def _gsm8k(solution_str, ground_truth, extra_info=None):
    return gsm8k.compute_score(solution_str, ground_truth)


def _arith(solution_str, ground_truth, extra_info=None):
    return arith.compute_score(solution_str, ground_truth)


def _code(solution_str, ground_truth, extra_info=None):
    return code.compute_score(solution_str, ground_truth, extra_info)


def _code_batch(items):
    return code.compute_scores(items)


REWARDS = {
    "openai/gsm8k": _gsm8k,
    "gsm8k": _gsm8k,
    "lighteval/MATH": _math,
    "DigitalLearningGmbH/MATH-lighteval": _math,
    "HuggingFaceH4/MATH-500": _math,
    "math": _math,
    "arith": _arith,
    "copy": _arith,
    "multiply": _arith,  # the final answer, exactly
    code.DATA_SOURCE: _code,
}
# data sources whose samples are better scored together (e.g. concurrently):
# fn([(solution_str, ground_truth, extra_info), ...]) -> list of results
_BATCH_REWARDS = {code.DATA_SOURCE: _code_batch}


def known_data_sources():
    return sorted(REWARDS) + [reasoning_gym.PREFIX + "<task>"]


def register_reward(data_source, fn, batch_fn=None):
    """Add (or replace) the rule reward of `data_source`: fn(solution_str, ground_truth, extra_info);
    optionally batch_fn(list of (solution_str, ground_truth, extra_info)) -> list of results,
    used by `compute_scores` for a batch's samples of that data source."""
    REWARDS[data_source] = fn
    if batch_fn is None:
        _BATCH_REWARDS.pop(data_source, None)
    else:
        _BATCH_REWARDS[data_source] = batch_fn


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source not in REWARDS and str(data_source).startswith(reasoning_gym.PREFIX):
        task = data_source[len(reasoning_gym.PREFIX):]
        return reasoning_gym.compute_score(task, solution_str, ground_truth, extra_info)
    fn = REWARDS.get(data_source)
    if fn is None:
        raise ValueError(f"no rule reward for data_source={data_source!r}; known data sources: "
                         f"{known_data_sources()}. Register one with "
                         "engine.rewards.register_reward(data_source, fn) or pass compute_score=")
    return fn(solution_str, ground_truth, extra_info)


def compute_scores(items):
    """default_compute_score over (data_source, solution_str, ground_truth, extra_info) items,
    in order; the samples of a data source with a batch reward go to it in one call."""
    results = [None] * len(items)
    batches = {}
    for i, (source, solution, truth, extra) in enumerate(items):
        if source in _BATCH_REWARDS:
            batches.setdefault(source, []).append((i, (solution, truth, extra)))
        else:
            results[i] = default_compute_score(source, solution, truth, extra)
    for source, group in batches.items():
        scores = _BATCH_REWARDS[source]([item for _, item in group])
        for (i, _), score in zip(group, scores):
            results[i] = score
    return results
