"""Token in, token out: the ids a chat template puts around observations, never re-tokenising
the history.

    prompt_ids(tokenizer, messages, tools=None) -> [int]
        the prompt as the template renders it (tools= shows the tool schemas), ending with the
        assistant's generation prompt
    observation_ids(tokenizer, messages, tools=None, model_ended_with_eos=False, eos_ids=None) -> [int]
        what follows a model turn: the end of the assistant turn the template writes after the
        model's text (e.g. "<|im_end|>\\n"; without its first token when the model itself
        generated it, `model_ended_with_eos`), then the new tool / user `messages` (all of one
        turn's tool results at once: templates merge consecutive tool turns), then the next
        assistant generation prompt

How: a fixed base conversation (user, assistant) is rendered as text alone and with the new
messages and a generation prompt; the second must extend the first (the prefix property), and
the tokens of [base up to the assistant's text] + [the rest] must equal the tokens of the whole
(the cut is a token boundary). A template that breaks either (e.g. one that rewrites earlier
turns once more follow) is refused with one line naming the template and what to do.

Tests: tests/test_agent_render.py
"""
from __future__ import annotations

from typing import Optional, Sequence

from engine.agents import AgentConfigError

BASE_USER = "What is 2+2?"
BASE_ASSISTANT = "Let me check."


def _template_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja / a template's raise_exception
        raise AgentConfigError(f"the chat template of {_template_name(tokenizer)!r} cannot render "
                               f"{[m.get('role') for m in messages]} ({type(e).__name__}: {e}); use a "
                               "tokenizer whose template has tool / user turns after an assistant turn") from e


def _encode(tokenizer, text: str) -> list:
    # the rendered text carries the template's own special tokens (bos included): add none
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> list:
    return _encode(tokenizer, _render(tokenizer, messages, tools, True))


def observation_ids(tokenizer, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
                    model_ended_with_eos: bool = False, eos_ids: Optional[Sequence[int]] = None) -> list:
    """Ids to append after a model turn (mask 0); see the module docstring. The model's turn ends
    either at a tool-call end tag (model_ended_with_eos=False: the template's end of turn is part
    of the observation) or at an eos token (True: that token is the model's; `eos_ids`: the ids
    that end a turn, default the tokenizer's eos_token_id)."""
    if not messages:
        raise ValueError("observation_ids: no messages to render")
    base = [{"role": "user", "content": BASE_USER}, {"role": "assistant", "content": BASE_ASSISTANT}]
    name = _template_name(tokenizer)
    before = _render(tokenizer, base, tools, False)
    after = _render(tokenizer, base + [dict(m) for m in messages], tools, True)
    cut = before.rfind(BASE_ASSISTANT)
    if cut == -1 or not after.startswith(before):
        raise AgentConfigError(
            f"the chat template of {name!r} does not render a conversation as a prefix of its "
            f"continuation (adding {[m.get('role') for m in messages]} turns changes the earlier "
            "turns), so observations cannot be appended token by token; use a template that only "
            "appends (e.g. the model's own Hermes / ChatML template) or set the tokenizer's chat_template")
    cut += len(BASE_ASSISTANT)
    head, whole = _encode(tokenizer, after[:cut]), _encode(tokenizer, after)
    ids = _encode(tokenizer, after[cut:])
    if head + ids != whole:
        raise AgentConfigError(
            f"the chat template of {name!r}: the text after an assistant turn does not start at a "
            f"token boundary ({after[cut:cut + 20]!r} merges with the turn's last token), so the "
            "model's tokens and the observation's cannot be joined; end assistant turns with a "
            "special token (as ChatML's <|im_end|>)")
    if model_ended_with_eos:
        if eos_ids is None:
            eos_ids = [tokenizer.eos_token_id]
        if not ids or ids[0] not in set(eos_ids):
            first = tokenizer.convert_ids_to_tokens(ids[:1]) if ids else []
            raise AgentConfigError(
                f"the chat template of {name!r} ends an assistant turn with {first}, not with the "
                f"tokenizer's eos {tokenizer.eos_token!r}; stop the model's turns at the template's "
                "end-of-turn token (make it the eos) or pass model_ended_with_eos=False")
        ids = ids[1:]
    return ids
