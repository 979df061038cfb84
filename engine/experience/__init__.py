"""Where a PPO step's batch comes from, and the StepContext through which a step's parts reach
the rollout, the rewards and the phases (never the trainer).

    base.py             the Source interface
    online.py           colocated generation          pool.py     a separate rollout pool
    logged.py           logged responses (offline)    replay.py   replay buffer + PF-PPO
    dynamic_sampling.py DAPO's informative groups     sources.py  the registry a config picks from
    context.py          the StepContext               scoring.py  rewards once per replica
    streaming.py        a separate pool's groups taken as they arrive (over-sampling, DAPO)

Tests: tests/test_experience_parts.py, tests/test_step_context.py
"""
