"""Partial rollouts on the CPU backend (engine/rollout/partial.py, engine/rollout/cpu.py): a
generation paused mid-way, given new weights and continued keeps every token it had and goes on
from them; the tokens of a response that straddles the update are recorded with two versions,
and each token's log-prob is the one its own weights give (a teacher-forced forward of plain
transformers models, no engine). Paused and continued with the same weights, the responses are
the uninterrupted ones. The same on SGLang (the recording double): sglang's abort-mode pause, the
paused rows sent again as prompt + tokens."""
import pytest
import torch

from engine.rollout.base import SamplingParams
from engine.rollout.partial import FINISH_PAUSED, paused_rows, stamp
from tests.test_rollout_cpu import EOS, PROMPTS, llama_config, loaded_rollout, reference_model
from tests.test_sglang_double import double as sglang_double

KEYS = [40, 41, 42]
double = pytest.fixture(sglang_double.__wrapped__, name="double")  # the SGLang double (tests/fakes)


def _sampling(**kw):
    return SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=7, **kw)


def _pause_after(tokens):
    """should_pause answering True once `tokens` tokens have been decoded, then never again."""
    calls = []

    def ask():
        calls.append(1)
        return len(calls) == tokens
    return ask


@torch.no_grad()
def _teacher_forced(model, prompt, response):
    """log_softmax of `model` at every response token (temperature 1), one full forward."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("max_num_seqs", [64, 2])
def test_paused_and_continued_with_the_same_weights_is_the_uninterrupted_generation(max_num_seqs):
    """max_num_seqs=2: the pause comes in the first part; the parts not started are paused empty."""
    model = reference_model(llama_config())
    whole = loaded_rollout(model).generate(PROMPTS, _sampling(), keys=KEYS)
    engine = loaded_rollout(model, max_num_seqs=max_num_seqs)
    out = engine.generate(PROMPTS, _sampling(), keys=KEYS, should_pause=_pause_after(3))
    assert paused_rows(out) and all(len(r) <= 4 for r in out.responses)
    for _ in range(20):  # parts of 2 rows run one after the other, each paused every 2 tokens
        if not paused_rows(out):
            break
        out = engine.continue_generation(PROMPTS, _sampling(), KEYS, out, should_pause=_pause_after(2))
    assert not paused_rows(out)
    assert out.responses == whole.responses and out.finish_reasons == whole.finish_reasons
    for a, b in zip(out.log_probs, whole.log_probs):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_response_straddling_a_weight_update_holds_tokens_of_two_versions():
    old, new = reference_model(llama_config(), seed=0), reference_model(llama_config(), seed=1)
    sampling = _sampling(ignore_eos=True)  # every row runs to max_new_tokens: all straddle
    engine = loaded_rollout(old)
    first = engine.generate(PROMPTS, sampling, keys=KEYS, should_pause=_pause_after(4))
    assert first.finish_reasons == [FINISH_PAUSED] * 6 and all(len(r) == 4 for r in first.responses)
    versions = stamp(None, first, 3)
    engine.sync_weights([list(new.state_dict().items())])  # version 4 arrives
    out = engine.continue_generation(PROMPTS, sampling, KEYS, first)
    versions = stamp(versions, out, 4)
    assert not paused_rows(out)
    for r, (response, logps) in enumerate(zip(out.responses, out.log_probs)):
        assert response[:4] == first.responses[r] and logps[:4] == first.log_probs[r]  # nothing discarded
        assert len(response) == 10 and versions[r] == [3] * 4 + [4] * 6
        prompt = PROMPTS[r // 2]
        assert logps[:4] == pytest.approx(_teacher_forced(old, prompt, response)[:4], abs=1e-4)
        assert logps[4:] == pytest.approx(_teacher_forced(new, prompt, response)[4:], abs=1e-4)
    # the continuation's first token was drawn by the new weights from the old prefix
    assert out.responses != loaded_rollout(old).generate(PROMPTS, sampling, keys=KEYS).responses


def test_rows_that_ended_before_the_pause_stay_as_they_were():
    model = reference_model(llama_config(), seed=3)
    engine = loaded_rollout(model)
    sampling = SamplingParams(n=4, temperature=1.5, max_new_tokens=12, seed=11, stop_token_ids=tuple(range(2, 40)))
    out = engine.generate(PROMPTS, sampling, keys=KEYS, should_pause=_pause_after(2))
    ended = [r for r, f in enumerate(out.finish_reasons) if f != FINISH_PAUSED]
    assert ended and paused_rows(out)  # both kinds in this batch (seeded)
    done = engine.continue_generation(PROMPTS, sampling, KEYS, out)
    for r in ended:
        assert done.responses[r] == out.responses[r] and done.finish_reasons[r] == out.finish_reasons[r]
    assert stamp(stamp(None, out, 0), done, 1)[ended[0]] == [0] * len(out.responses[ended[0]])


# -- SGLang (engine/rollout/sglang_partial.py) through the double, whose scheduler decodes in a
# thread of its own while the adapter polls should_pause on Engine.loop

def _sglang(tmp_path, monkeypatch, model, **kwargs):
    from engine.rollout.sglang import SGLangRollout
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    path = str(tmp_path / "m")
    model.config.save_pretrained(path)
    rollout = SGLangRollout(model.config, model_path=path, dtype="float32", eos_token_ids=[EOS], **kwargs)
    _load(rollout, model)
    return rollout


def _load(rollout, model):
    rollout.begin_weight_update()
    rollout.update_weights(list(model.state_dict().items()))
    rollout.finish_weight_update()


def _hold_at(rollout, tokens):
    """should_pause for `rollout`: the double's scheduler holds its request at its `tokens`-th
    decode step until the abort reaches it, and should_pause answers True from then (a fixed
    boundary, whatever the machine's speed)."""
    import threading
    held = threading.Event()

    def hook(request):
        if request.calls == tokens and not held.is_set():
            held.set()
            assert request.abort.wait(30), "the pause never reached the held request"
    rollout.engine.tokenizer_manager.step_hook = hook
    return held.is_set


def test_sglang_response_straddling_two_updates_holds_three_versions(double, tmp_path, monkeypatch):
    """Paused after 4 tokens (weights v3), continued for 2 (v4), then to the end (v5): every
    token is kept with the log-prob of the weights that drew it (teacher-forced per version),
    each continuation is prompt + tokens so far for the tokens left, and the pause is sglang's
    abort mode lifted at once (the engine never stays paused)."""
    models = [reference_model(llama_config(), seed=s) for s in (0, 1, 2)]
    sampling = _sampling(ignore_eos=True)  # every row runs to max_new_tokens=10: all straddle
    rollout = _sglang(tmp_path, monkeypatch, models[0])
    try:
        first = rollout.generate(PROMPTS, sampling, keys=KEYS, should_pause=_hold_at(rollout, 4))
        assert first.finish_reasons == [FINISH_PAUSED] * 6 and [len(r) for r in first.responses] == [4] * 6
        versions = stamp(None, first, 3)
        _load(rollout, models[1])
        second = rollout.continue_generation(PROMPTS, sampling, KEYS, first, should_pause=_hold_at(rollout, 2))
        versions = stamp(versions, second, 4)
        _load(rollout, models[2])
        rollout.engine.tokenizer_manager.step_hook = None
        out = rollout.continue_generation(PROMPTS, sampling, KEYS, second)
        versions = stamp(versions, out, 5)
        assert not paused_rows(out) and out.finish_reasons == ["length"] * 6
        for r, (response, logps) in enumerate(zip(out.responses, out.log_probs)):
            assert response[:4] == first.responses[r] and logps[:4] == first.log_probs[r]  # nothing discarded
            assert response[:6] == second.responses[r] and logps[:6] == second.log_probs[r]
            assert len(response) == 10 and versions[r] == [3] * 4 + [4] * 2 + [5] * 4
            for model, part in zip(models, (slice(0, 4), slice(4, 6), slice(6, 10))):
                assert logps[part] == pytest.approx(_teacher_forced(model, PROMPTS[r // 2], response)[part], abs=1e-4)
        sent = [e for e in double.RECORDS if e["kind"] == "async_generate"]
        assert [len(e["prompts"]) for e in sent] == [3, 6]  # the prompts (n=2), then each paused row
        assert sent[1]["prompts"] == [PROMPTS[r // 2] + first.responses[r] for r in range(6)]
        assert {p["max_new_tokens"] for p in sent[1]["sampling_params"]} == {6}
        last = [e for e in double.RECORDS if e["kind"] == "generate"][-1]  # no should_pause: Engine.generate
        assert last["prompts"] == [PROMPTS[r // 2] + second.responses[r] for r in range(6)]
        assert {p["max_new_tokens"] for p in last["sampling_params"]} == {4}
        calls = [(e["kind"], e.get("mode")) for e in double.RECORDS if e["kind"].endswith("_generation")]
        assert calls == [("pause_generation", "abort"), ("continue_generation", None)] * 2
        assert not rollout.engine.tokenizer_manager.is_pause
    finally:
        rollout.shutdown()


def test_sglang_a_row_the_abort_ended_is_not_continued(double, tmp_path, monkeypatch):
    """sglang's abort beats its stop-token check (Req.update_finish_state): a request whose token
    on the abort's step is a stop token comes back 'abort' and has ended (stop), never continued."""
    model = reference_model(llama_config(), seed=3)
    sampling = SamplingParams(n=4, temperature=1.5, max_new_tokens=12, seed=11, stop_token_ids=tuple(range(2, 40)))
    rollout = _sglang(tmp_path, monkeypatch, model)
    try:
        out = rollout.generate(PROMPTS, sampling, keys=KEYS, should_pause=_hold_at(rollout, 2))
        reported = [a for e in double.RECORDS if e["kind"] == "async_generate" for a in e["aborts"]]
        ended = [r for r, a in enumerate(reported) if a is not None and out.finish_reasons[r] == "stop"]
        assert ended and paused_rows(out)  # both kinds in this batch (seeded)
        for r in ended:
            assert reported[r]["message"] == "Aborted" and len(out.responses[r]) == 2
            assert out.responses[r][-1] in {EOS, *sampling.stop_token_ids}
        rollout.engine.tokenizer_manager.step_hook = None
        done = rollout.continue_generation(PROMPTS, sampling, KEYS, out)
        assert not paused_rows(done)
        for r in ended:
            assert done.responses[r] == out.responses[r] and done.finish_reasons[r] == "stop"
    finally:
        rollout.shutdown()


def test_sglang_requests_aborted_in_the_waiting_queue_continue_from_their_prompt(double, tmp_path, monkeypatch):
    """Deterministic (one request per sample; the double runs them one after the other): the
    abort reaches the first while it decodes and the rest in the waiting queue, which answer no
    tokens ("Abort in waiting queue") and are continued from their prompt alone, each with its
    own request seed."""
    from engine.rollout.sglang import request_seed
    model = reference_model(llama_config(), seed=3)
    sampling = _sampling(ignore_eos=True)
    rollout = _sglang(tmp_path, monkeypatch, model, enable_deterministic_inference=True)
    try:
        out = rollout.generate(PROMPTS, sampling, keys=KEYS, should_pause=_hold_at(rollout, 3))
        reported = [a for e in double.RECORDS if e["kind"] == "async_generate" for a in e["aborts"]]
        assert reported[0]["message"] == "Aborted" and len(out.responses[0]) == 3
        assert [a["message"] for a in reported[1:]] == ["Abort in waiting queue"] * 5
        assert out.finish_reasons == [FINISH_PAUSED] * 6 and out.responses[1:] == [[]] * 5
        rollout.engine.tokenizer_manager.step_hook = None
        done = rollout.continue_generation(PROMPTS, sampling, KEYS, out)
        assert not paused_rows(done) and [len(r) for r in done.responses] == [10] * 6
        assert done.responses[0][:3] == out.responses[0]
        last = [e for e in double.RECORDS if e["kind"] == "generate"][-1]
        assert [p["sampling_seed"] for p in last["sampling_params"]] == [
            request_seed(7, KEYS[r // 2], r % 2) for r in range(6)]
        assert [p["max_new_tokens"] for p in last["sampling_params"]] == [7] + [10] * 5
    finally:
        rollout.shutdown()


def test_an_abort_with_a_status_code_is_an_error_not_a_pause():
    """Only the pause's aborts (no status code) are paused rows; sglang's own (out of memory:
    500) stay aborts, which the adapter refuses (RolloutAborted)."""
    from engine.rollout.base import FINISH_ABORT
    from engine.rollout.sglang_partial import paused_results
    sampling = SamplingParams(n=1, max_new_tokens=5)
    parsed = [[[7, 8], [-1.0, -1.0], FINISH_ABORT, None]] * 3
    reasons = [{"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
               {"type": "abort", "message": "Abort in waiting queue"},
               {"type": "abort", "message": "Out of memory", "status_code": 500, "err_type": None}]
    out = paused_results(parsed, [{"meta_info": {"finish_reason": r}} for r in reasons], [5, 5, 5], sampling, [EOS])
    assert [p[2] for p in out] == [FINISH_PAUSED, FINISH_PAUSED, FINISH_ABORT]
    out = paused_results(parsed[:1], [{"meta_info": {"finish_reason": reasons[0]}}], [2], sampling, [EOS])
    assert out[0][2] == "length"  # its last allowed token


def test_the_double_keeps_requests_through_retract_and_in_place(double, tmp_path, monkeypatch):
    """The modes the adapter does not use, reproduced by the double: paused while they decode,
    the requests stay in the engine and answer one whole response each once generation continues
    (retract: prefilled again from prompt + tokens; in_place: with their KV); nothing marks which
    tokens came before the pause."""
    import asyncio
    import threading

    from engine.rollout.sglang import sampling_dict
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput
    rollout = _sglang(tmp_path, monkeypatch, reference_model(llama_config()))
    manager, engine = rollout.engine.tokenizer_manager, rollout.engine
    held = threading.Event()

    def hold(request):  # at the 3rd token, until the pause has reached the scheduler
        if request.calls == 3 and not held.is_set():
            held.set()
            while manager.resumed.is_set():
                threading.Event().wait(0.005)
    manager.step_hook = hold

    async def run(mode):
        held.clear()
        task = asyncio.ensure_future(engine.async_generate(
            input_ids=PROMPTS, sampling_params=sampling_dict(_sampling(ignore_eos=True), [EOS]), return_logprob=True))
        while not held.is_set():
            await asyncio.sleep(0.005)
        await manager.pause_generation(PauseGenerationReqInput(mode=mode))
        await asyncio.sleep(0.1)
        assert not task.done() and manager.is_pause  # the requests wait in the engine
        await manager.continue_generation(ContinueGenerationReqInput())
        return await task
    try:
        for mode in ("retract", "in_place"):
            results = engine.loop.run_until_complete(run(mode))
            assert [r["meta_info"]["finish_reason"] for r in results] == [{"type": "length"}] * 6
            assert [len(r["meta_info"]["output_token_logprobs"]) for r in results] == [10] * 6
        sent = [e for e in double.RECORDS if e["kind"] == "async_generate"]
        assert [e["aborts"] for e in sent] == [[None] * 6] * 2
    finally:
        rollout.shutdown()
