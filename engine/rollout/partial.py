"""Partial rollouts: a generation paused when new weights arrive goes on from the tokens it has.

The protocol (the CPU backend: engine/rollout/cpu.py `generate(..., should_pause=)` and
`continue_generation`; SGLang the same, by aborting its requests in flight and sending prompt +
tokens again: engine/rollout/sglang_partial.py):

    out = engine.generate(prompts, sampling, keys, should_pause=weights_waiting)
    versions = stamp(None, out, v)                      # every token so far: version v
    while FINISH_PAUSED in out.finish_reasons:
        ... load the new weights (version v + 1) ...
        out = engine.continue_generation(prompts, sampling, keys, out, should_pause=...)
        versions = stamp(versions, out, v + 1)          # only the new tokens: v + 1

Nothing is discarded: a paused row keeps its tokens and log-probs (each from the weights that
sampled it) and goes on from them; a response that straddles an update holds tokens of both
versions, and `stamp` records which (the batch's rollout_versions: engine/experience/
staleness.py refuses a sample whose oldest token is too old).

Tests: tests/test_partial_rollouts.py
"""
from engine.rollout.base import RolloutOutput

FINISH_PAUSED = "paused"  # stopped by should_pause before its end: continue_generation goes on


def paused_rows(out: RolloutOutput) -> list:
    """The rows of `out` still to be continued."""
    return [r for r, f in enumerate(out.finish_reasons) if f == FINISH_PAUSED]


def merge_continued(partial: RolloutOutput, rows: list, more) -> RolloutOutput:
    """`partial` with its `rows` continued by `more` (the tokens, log-probs and finish reason
    each made since: appended to the ones it had)."""
    responses, log_probs = [list(r) for r in partial.responses], [list(x) for x in partial.log_probs]
    finish = list(partial.finish_reasons)
    for k, r in enumerate(rows):
        responses[r] = list(partial.responses[r]) + list(more.responses[k])
        log_probs[r] = list(partial.log_probs[r]) + list(more.log_probs[k])
        finish[r] = more.finish_reasons[k]
    return RolloutOutput(prompt_index=list(partial.prompt_index), responses=responses, log_probs=log_probs,
                         finish_reasons=finish, routed_experts=partial.routed_experts)


def stamp(versions, out: RolloutOutput, version: int) -> list:
    """Per row the policy version of every token of `out`: those `versions` already names keep
    theirs, the rest (made since) get `version`."""
    before = versions if versions is not None else [[] for _ in out.responses]
    return [list(v) + [version] * (len(r) - len(v)) for v, r in zip(before, out.responses)]
