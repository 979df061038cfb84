"""Graded reward for the built-in tasks of engine/tasks.py (`arith`, `copy`).

A random-init policy almost never emits exactly "answer, eos", so a 0/1 reward would give GRPO
no signal. The grades reward each step towards the goal, and charge for every character after
the answer so that stopping (eos) right after it is learned too:

    1.0                      the response is exactly the answer
    0.5 - 0.1 * extra chars  the response starts with the answer and goes on (at least 0.1)
    0.0                      anything else

Wrong answers earn nothing, not even for a tidy format: a prompt-independent "emit some digit,
then stop" policy is easy to learn from random init and, rewarded, collapses GRPO's groups.

The response is the decoded text (RewardManager drops the final eos). `acc` is 1.0 only for an exact answer.

Tests: tests/test_rewards.py, tests/test_e2e.py
"""
EXACT, RIGHT_PREFIX, PER_EXTRA_CHAR, FLOOR = 1.0, 0.5, 0.1, 0.1


def compute_score(solution_str, ground_truth):
    """{'score': graded reward, 'acc': exact-answer indicator} for one response."""
    answer = str(ground_truth).strip()
    response = solution_str  # not stripped: a trailing space is an extra token, not a clean stop
    if response == answer:
        score = EXACT
    elif response.startswith(answer):
        score = max(RIGHT_PREFIX - PER_EXTRA_CHAR * (len(response) - len(answer)), FLOOR)
    else:
        score = 0.0
    return {"score": score, "acc": float(score == EXACT)}
