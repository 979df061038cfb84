"""Test double of how SGLang seeds sampling, as the CPU backend generates for the fake engine.

Mirrors sglang/srt/sampling/sampling_batch_info.py ``SamplingBatchInfo.from_schedule_batch``:
with ``enable_deterministic_inference`` every request samples from its own ``sampling_seed``
(42 when it has none) and the token position (sglang/srt/layers/sampler.py
``multinomial_with_seed``), so two requests with one seed and one prompt draw the same tokens;
without it ``sampling_seed`` is never read and sampling draws from the scheduler's generator,
seeded once with ``ServerArgs.random_seed`` (sglang/srt/managers/scheduler.py
``set_random_seed``). A seed sent to an engine that ignores it is refused here: the caller
believes it reproducible and it is not.
"""
import random

DEFAULT_SEED = 42  # what sglang gives a request without sampling_seed in deterministic mode


def _params(p: dict, seed):
    from engine.rollout.base import SamplingParams
    return SamplingParams(n=1, temperature=p.get("temperature", 1.0), top_p=p.get("top_p", 1.0),
                          top_k=p.get("top_k", -1), max_new_tokens=p["max_new_tokens"],
                          stop_token_ids=tuple(p.get("stop_token_ids", ())), seed=seed,
                          do_sample=p.get("temperature", 1.0) != 0.0, ignore_eos=p.get("ignore_eos", False))


def generate(rollout, input_ids, sampling_params, deterministic: bool, generator: random.Random, request=None):
    """(n, RolloutOutput, aborts) for sglang's Engine.generate arguments (one dict, or one per
    prompt; requests with different dicts each run as their own batch, as each sglang request
    keeps its own max_new_tokens). `request` (an async_generate's, tests/fakes/sglang/srt/managers/
    tokenizer_manager.py): the pause modes act on it; aborts: per row None, or the finish_reason
    of an aborted request (running: it keeps its tokens; waiting: none)."""
    import dataclasses

    per_prompt = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
    if len(per_prompt) != len(input_ids):
        raise ValueError(f"{len(per_prompt)} sampling_params for {len(input_ids)} prompts")
    ns = {p.get("n", 1) for p in per_prompt}
    if len(ns) != 1:
        raise ValueError(f"requests with different n ({sorted(ns)}) in one call")
    n = ns.pop()
    seeded = [p for p in per_prompt if p.get("sampling_seed") is not None]
    if seeded and not deterministic:
        raise ValueError("sampling_seed is ignored unless the engine runs with "
                         "enable_deterministic_inference=True (sglang/srt/sampling/sampling_batch_info.py): "
                         "these requests would not be reproducible")
    if not deterministic and all(p == per_prompt[0] for p in per_prompt):  # one batch, the engine's generator
        seed = generator.randrange(1 << 62)
        return (n, *_run(rollout, input_ids, dataclasses.replace(_params(per_prompt[0], seed), n=n), request))
    rows = []  # each sample of each prompt alone: its seed and positions decide its tokens
    for prompt, p in zip(input_ids, per_prompt):
        for _ in range(n):
            seed = p.get("sampling_seed", DEFAULT_SEED) if deterministic else generator.randrange(1 << 62)
            rows.append(_run(rollout, [prompt], _params(p, seed), request))
    routed = [r.routed_experts[0] for r, _ in rows] if rows[0][0].routed_experts is not None else None
    return n, _rows([r for r, _ in rows], routed, len(input_ids), n), [a[0] for _, a in rows]


def _rows(outs, routed, prompts, n):
    from engine.rollout.base import RolloutOutput
    return RolloutOutput(prompt_index=[i for i in range(prompts) for _ in range(n)],
                         responses=[r.responses[0] for r in outs], log_probs=[r.log_probs[0] for r in outs],
                         finish_reasons=[r.finish_reasons[0] for r in outs], routed_experts=routed)


def _run(rollout, prompts, sampling, request):
    """(RolloutOutput, aborts) of one scheduler batch. The CPU backend asks `request.step` after
    every decoded token: an abort finishes the batch's unfinished rows where they are; retract
    requeues them, prefilled again from prompt + tokens once generation continues."""
    from engine.rollout.base import RolloutOutput
    from engine.rollout.partial import paused_rows
    from sglang.srt.managers.tokenizer_manager import RUNNING_ABORT, WAITING_ABORT
    rows = len(prompts) * sampling.n
    if request is None:
        return rollout.generate(prompts, sampling), [None] * rows
    if request.abort.is_set():  # aborted in the waiting queue: nothing decoded
        return RolloutOutput([], [[] for _ in range(rows)], [[] for _ in range(rows)], ["abort"] * rows), \
            [WAITING_ABORT] * rows
    request.calls = 0
    out = rollout.generate(prompts, sampling, should_pause=request.step)
    before = [0] * rows
    while paused_rows(out) and not request.abort.is_set():  # retract: back in the queue until continue
        request.manager.resumed.wait()
        before, request.calls = [len(r) for r in out.responses], 0
        out = rollout.continue_generation(prompts, sampling, None, out, should_pause=request.step)
    paused = set(paused_rows(out))
    if not paused:
        return out, [None] * rows
    # aborted: a row never started (beyond max_running_requests) was in the waiting queue; to_finish
    # beats the stop-token and length checks, so a row that ended on the step the abort reached
    # (as many new tokens as the running ones) is reported aborted too (Req.update_finish_state)
    made = [len(r) - b for r, b in zip(out.responses, before)]
    step = max(made[r] for r in paused)
    return out, [WAITING_ABORT if r in paused and made[r] == 0 else
                 RUNNING_ABORT if r in paused or made[r] == step else None for r in range(rows)]
