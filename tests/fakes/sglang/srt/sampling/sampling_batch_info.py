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


def generate(rollout, input_ids, sampling_params, deterministic: bool, generator: random.Random):
    """(n, RolloutOutput) for sglang's Engine.generate arguments (one dict, or one per prompt)."""
    import dataclasses

    from engine.rollout.base import RolloutOutput
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
    if not deterministic:  # one batch from the engine's generator
        seed = generator.randrange(1 << 62)
        return n, rollout.generate(input_ids, dataclasses.replace(_params(per_prompt[0], seed), n=n))
    rows = []  # each sample of each prompt alone: its seed and positions decide its tokens
    for prompt, p in zip(input_ids, per_prompt):
        seed = p.get("sampling_seed", DEFAULT_SEED)
        rows += [rollout.generate([prompt], _params(p, seed), keys=[0]) for _ in range(n)]
    routed = [r.routed_experts[0] for r in rows] if rows[0].routed_experts is not None else None
    return n, RolloutOutput(prompt_index=[i for i in range(len(input_ids)) for _ in range(n)],
                            responses=[r.responses[0] for r in rows], log_probs=[r.log_probs[0] for r in rows],
                            finish_reasons=[r.finish_reasons[0] for r in rows], routed_experts=routed)
