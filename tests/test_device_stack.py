"""What breaks when the GPU machine's library versions replace ours (transformers 5.17, triton 3.6,
numpy 2.4/2.5): run here by `make test` on this checkout's versions and by `make test-device-stack`
in .venv-device on the device's. The KV cache reaching the model (item 17 of issue 20: 5.17 has no
`cache` argument and drops it into **kwargs) and the versions that venv really has."""
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.rollout.base import SamplingParams
from engine.rollout.cpu import CPURollout

EOS = 1


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_incremental_decoding_equals_one_forward_over_the_whole_sequence(llama):
    """The rollout decodes token by token through its KV cache; one transformers forward over
    prompt + response (no cache) must give the same log-prob for every response token. With the
    cache ignored, every token after the first is predicted from itself alone."""
    rollout = CPURollout(llama.config, eos_token_ids=[EOS])
    rollout.sync_weights([list(llama.state_dict().items())])
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    out = rollout.generate(prompts, SamplingParams(do_sample=True, temperature=1.0, max_new_tokens=10,
                                                   ignore_eos=True, seed=3))
    for row, prompt in enumerate(prompts):
        response = out.responses[row]
        assert len(response) == 10
        with torch.no_grad():
            logits = llama(torch.tensor([prompt + response])).logits[0].float()
        full = logits[len(prompt) - 1:-1].log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.log_probs[row]), full, atol=2e-5, rtol=0,
                                   msg=lambda m: f"row {row}: cached decoding != one full forward: {m}")


def test_device_venv_has_the_pinned_versions():
    """Under `make test-device-stack` (DEVICE_PINS in the environment), each pin is what this
    interpreter imports: a venv that silently fell back to .venv's versions would test nothing."""
    pins = os.environ.get("TRIDENT_DEVICE_PINS")
    if not pins:
        pytest.skip("only under make test-device-stack (TRIDENT_DEVICE_PINS names the pins)")
    import importlib
    for pin in pins.split():
        name, version = pin.split("==")
        assert importlib.import_module(name).__version__ == version, (name, version)
