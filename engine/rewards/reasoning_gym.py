"""Rewards for reasoning-gym tasks, scored by the task's own verifier (`score_answer`).

Rows carry data_source "reasoning_gym/<task>", the reference answer as ground truth and the
generator's metadata in extra_info, so the verifier sees the entry it was written for. The
model is asked to end with "Answer: <answer>"; the text after the last "Answer:" is verified,
or failing that the last number in the reply (small models often answer "5 - 3 = 2"), or its
last line.

Tests: tests/test_rewards.py
"""
import functools
import json
import re

PREFIX = "reasoning_gym/"
INSTRUCTION = "Solve the problem. End your reply with a last line of the form 'Answer: <answer>'."
_ANSWER = re.compile(r"answer\s*[:：]\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@functools.lru_cache(maxsize=None)
def _dataset(task):
    import reasoning_gym
    return reasoning_gym.create_dataset(task, size=1, seed=0)


def extract_answer(solution_str):
    matches = _ANSWER.findall(solution_str)
    if matches:
        return matches[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(solution_str)
    if numbers:
        return numbers[-1]
    lines = [line.strip() for line in solution_str.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def compute_score(task, solution_str, ground_truth, extra_info=None):
    extra_info = extra_info or {}
    metadata = extra_info.get("metadata", {})
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    entry = {"question": extra_info.get("question", ""), "answer": ground_truth, "metadata": metadata}
    answer = extract_answer(solution_str)
    score = float(_dataset(task).score_answer(answer=answer, entry=entry)) if answer else 0.0
    return {"score": score, "acc": float(score == 1.0)}


def make_rows(task, n, seed, split, **task_kwargs):
    """Parquet prompt rows (engine/data/prompts.py schema) from a reasoning-gym generator."""
    import reasoning_gym
    rows = []
    for i, entry in enumerate(reasoning_gym.create_dataset(task, size=n, seed=seed, **task_kwargs)):
        rows.append({
            "data_source": PREFIX + task,
            "prompt": [{"role": "user", "content": f"{entry['question']}\n{INSTRUCTION}"}],
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"split": split, "index": i, "question": entry["question"],
                           "metadata": json.dumps(entry["metadata"], default=str)},
        })
    return rows
