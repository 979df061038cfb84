"""Partial rollouts on the CPU backend (engine/rollout/partial.py, engine/rollout/cpu.py): a
generation paused mid-way, given new weights and continued keeps every token it had and goes on
from them; the tokens of a response that straddles the update are recorded with two versions,
and each token's log-prob is the one its own weights give (a teacher-forced forward of plain
transformers models, no engine). Paused and continued with the same weights, the responses are
the uninterrupted ones."""
import pytest
import torch

from engine.rollout.base import SamplingParams
from engine.rollout.partial import FINISH_PAUSED, paused_rows, stamp
from tests.test_rollout_cpu import PROMPTS, llama_config, loaded_rollout, reference_model
from tests.test_sglang_double import double as sglang_double, tiny_model_dir

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


def test_sglang_pauses_and_continues_its_requests_through_the_tokenizer_manager(double, tmp_path, monkeypatch):
    """SGLangRollout.pause_requests / continue_requests: sglang's PauseGenerationReqInput
    (mode 'retract': requests keep their tokens) and ContinueGenerationReqInput, awaited on the
    engine's own event loop (names checked in the wheel: tests/test_sglang_contract.py)."""
    from engine.rollout.sglang import SGLangRollout
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    rollout = SGLangRollout(None, model_path=tiny_model_dir(tmp_path / "m"))
    try:
        manager = rollout.engine.tokenizer_manager
        rollout.pause_requests()
        assert manager.is_pause
        rollout.continue_requests()
        assert not manager.is_pause
        calls = [(e["kind"], e.get("mode", e.get("torch_empty_cache"))) for e in double.RECORDS
                 if e["kind"].endswith("_generation")]
        assert calls == [("pause_generation", "retract"), ("continue_generation", False)]
    finally:
        rollout.shutdown()
