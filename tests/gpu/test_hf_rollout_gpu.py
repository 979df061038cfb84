"""The transformers rollout on CUDA (rollout.name=hf): weights streamed in, greedy decoding equal
to the HF model's own argmax loop, release / resume frees and restores GPU memory."""
import pytest
import torch

from engine.rollout.base import SamplingParams
from tests.test_rollout_cpu import EOS, PROMPTS, buckets, llama_config, reference_greedy, reference_model

pytestmark = pytest.mark.gpu


def test_hf_rollout_on_cuda_matches_the_hf_argmax():
    from engine.rollout.hf import HFRollout

    model = reference_model(llama_config())
    rollout = HFRollout(model.config, eos_token_ids=[EOS], dtype=torch.float32)
    rollout.sync_weights(buckets(((n, t.cuda()) for n, t in model.state_dict().items()), 3))
    out = rollout.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=8))
    for prompt, tokens, logps in zip(PROMPTS, out.responses, out.log_probs):
        want_tokens, want_logps = reference_greedy(model, prompt, 8)
        assert tokens == want_tokens
        assert logps == pytest.approx(want_logps, abs=1e-3)
    held = torch.cuda.memory_allocated()
    rollout.release_memory()
    assert torch.cuda.memory_allocated() < held
    rollout.resume_memory()
    rollout.sync_weights(buckets(model.state_dict().items(), 3))
    assert rollout.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=8)).responses == out.responses
