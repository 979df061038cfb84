"""Partial rollouts on SGLang (the protocol: engine/rollout/partial.py; the separate pool drives
it: engine/rollout/pool.py `serve`).

`generate(..., should_pause=)` sends the requests with ``Engine.async_generate`` on
``Engine.loop`` and asks `should_pause()` every PAUSE_POLL_S while they run; when it answers True
every request in flight is aborted (``PauseGenerationReqInput(mode="abort")``) and the pause is
lifted at once (``ContinueGenerationReqInput``). An aborted request answers the tokens it made
and their log-probs, all from the weights loaded then: the boundary is exact. The weights then
load as usual (nothing is in flight), and `continue_generation` sends each paused row again as
prompt + its tokens, for the tokens it may still make. Nothing is discarded.

Why abort and not sglang's "retract" / "in_place": those keep the requests in the engine and
answer one response each when it ends, with no mark of which tokens came before the new weights;
each token's version must be recorded (engine/experience/staleness.py). What each mode does is in
USED_API['partial_rollouts'] (engine/rollout/sglang.py), checked against the pinned wheel; the
test double reproduces each (tests/fakes/sglang/srt/managers/tokenizer_manager.py).

Tests: tests/test_partial_rollouts.py, tests/test_sglang_contract.py
"""
from engine.rollout.base import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams

PAUSE_POLL_S = 0.05  # how often a running generation asks should_pause()


def paused_results(parsed, results, budgets, sampling: SamplingParams, eos_token_ids) -> list:
    """`parsed` (per request [tokens, log-probs, finish, routing]) with the pause's aborts as
    FINISH_PAUSED. The pause's aborts carry no status code (FINISH_ABORT() of a running request,
    "Abort in waiting queue" of a waiting one); one with a status code is an error and stays an
    abort. The abort beats the stop-token and length checks (Req.update_finish_state), so a
    request whose last token is a stop token, or its last allowed one (`budgets`), has ended."""
    from engine.rollout.partial import FINISH_PAUSED
    stop_ids = set() if sampling.ignore_eos else set(eos_token_ids) | set(sampling.stop_token_ids)
    out = []
    for p, result, budget in zip(parsed, results, budgets):
        p = list(p)
        reason = result["meta_info"]["finish_reason"]
        if p[2] == FINISH_ABORT and isinstance(reason, dict) and reason.get("status_code") is None:
            p[2] = (FINISH_STOP if p[0] and p[0][-1] in stop_ids else
                    FINISH_LENGTH if len(p[0]) >= budget else FINISH_PAUSED)
        out.append(p)
    return out


class PartialRollouts:
    """SGLangRollout's partial rollouts (it provides engine, deterministic, record_routing,
    eos_token_ids, run_async and _output)."""

    def continue_generation(self, prompt_ids, sampling: SamplingParams, keys, partial: RolloutOutput,
                            should_pause=None) -> RolloutOutput:
        """Go on with `partial` (a paused generate's output, maybe with new weights loaded since):
        every paused row is sent again as prompt + the tokens it has (prefilled with the weights
        now loaded) for the tokens it may still make, with its own request seed (deterministic:
        sglang draws from (seed, position), and the positions go on); rows that ended stay."""
        import dataclasses

        from engine.rollout.partial import merge_continued, paused_rows
        from engine.rollout.sglang import request_seed, sampling_dict
        rows = paused_rows(partial)
        if not rows:
            return partial
        if self.record_routing:
            raise ValueError("continue_generation: a resumed row's routing would be the new weights' for "
                             "the old tokens; partial rollouts need record_routing=False")
        keys = list(range(len(prompt_ids))) if keys is None else list(keys)
        n, inputs, params, budgets = sampling.n, [], [], []
        for r in rows:
            budgets.append(sampling.max_new_tokens - len(partial.responses[r]))
            seed = request_seed(sampling.seed, keys[r // n], r % n) if self.deterministic else None
            one = dataclasses.replace(sampling, n=1, max_new_tokens=budgets[-1])
            inputs.append(list(prompt_ids[r // n]) + list(partial.responses[r]))
            params.append(sampling_dict(one, self.eos_token_ids, seed))
        if should_pause is None:
            results, paused = self.engine.generate(input_ids=inputs, sampling_params=params, return_logprob=True,
                                                   return_routed_experts=False), False
        else:
            results, paused = self.run_async(self.pausable(inputs, params, should_pause))
        more = self._output(results, inputs, 1, budgets=budgets if paused else None, sampling=sampling)
        return merge_continued(partial, rows, more)

    async def pausable(self, inputs, params, should_pause):
        """(results, paused): the requests, asking should_pause() while they run; when it answers
        True every request in flight is aborted and the pause lifted (`abort_requests`). A request
        that passed sglang's pause gate after the abort runs on and is aborted at the next poll."""
        import asyncio
        task = asyncio.ensure_future(self.engine.async_generate(
            input_ids=inputs, sampling_params=params, return_logprob=True, return_routed_experts=self.record_routing))
        paused = False
        try:
            while not task.done():
                if should_pause():
                    paused = True
                    await self.abort_requests()
                await asyncio.wait({task}, timeout=PAUSE_POLL_S)
        finally:
            if not task.done():
                task.cancel()
        return task.result(), paused

    async def abort_requests(self) -> None:
        """Every request in flight answers now with the tokens it has (mode "abort" returns once
        all have answered), and new requests are taken again at once: nothing is left in the
        engine, so the weights load as usual before `continue_generation`."""
        from engine.rollout.sglang import USED_API
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput
        manager = self.engine.tokenizer_manager
        await manager.pause_generation(PauseGenerationReqInput(mode=USED_API["pause_mode"]))
        await manager.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False))
