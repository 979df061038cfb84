"""SFT conversations: parquet rows -> token ids with a loss mask on the assistant's tokens, and
batches of them (trainer.task=sft).

A row holds `messages` (data.messages_key; verl's multi-turn SFT layout): a list of
{role, content} dicts, roles system / user / assistant / tool; an assistant message may carry
OpenAI-style `tool_calls` ([{"type": "function", "function": {"name", "arguments"}}], arguments
a JSON string or an object). An optional `tools` column (data.tools_key: a list of tool schemas,
or its JSON text) is passed to the chat template.

Tokens are what a rollout sees, never pieces tokenized differently: the conversation is rendered
prefix by prefix with the tokenizer's chat template and each render is tokenized whole (as
prompts.py tokenizes a prompt: the template's text, no added special tokens). The ids of
messages[:k+1] must extend those of messages[:k], and before an assistant message the render of
messages[:k] with the generation prompt (the rollout's prompt) must extend messages[:k] and be
extended by messages[:k+1]; a template that breaks this (one that rewrites earlier turns, e.g.
merges consecutive tool turns) fails with one DataError naming the row and the message. So each
message's tokens are known and the whole conversation's ids are its single render's.

Loss mask: 1 on an assistant message's tokens after the generation prompt (its content, its
tool-call text) up to and including its end-of-turn token (the tokenizer's eos; what follows it
in the turn, e.g. a newline the model never generates, is 0; without eos in the turn the rest of
the turn counts), 0 on every other token (system, user, tool turns, the role headers).

Rows longer than data.max_length tokens follow `data.truncation` by the row policy
(engine/data/rows.py): 'error' raises, 'filter' drops and counts (`data/dropped_overlong`),
'left' / 'right' keep the last / first max_length tokens (`data/truncated_conversations`). A row
with no assistant token (none in the row, or none left after a cut) is dropped under 'filter'
(`data/dropped_empty`) and raises otherwise.

A batch is a multi-turn rollout's (engine/rollout/multi_turn.py): verl's layout (prompt
left-padded, response right-padded) with the "prompt" the tokens before the first assistant token
(at least one: the first token is never predicted), `attention_mask` 1 on every valid token and
`response_mask` [B, R] the tokens trained on (the loss mask: 0 on tool / user turns).

Tests: tests/test_sft.py
"""
import json
import os

import torch

from engine.batch import Batch
from engine.data.prompts import left_pad, read_prompt_rows, right_pad
from engine.data.rows import RowPolicy
from engine.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
DROP_COUNTERS = ("data/dropped_empty", "data/dropped_overlong")

__all__ = ["SFTDataset", "conversation_tokens", "sft_batch", "tool_conversations"]


def _message(m, index, k):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else type(m).__name__
        raise DataError(f"SFT row {index}: message {k} has role {role!r}; each message is a "
                        f"{{role, content}} dict with role one of {list(ROLES)}")
    return {key: value for key, value in m.items() if value is not None}  # parquet's null fields


def conversation_tokens(tokenizer, messages, tools=None, index=0):
    """(ids, loss_mask) of one conversation (see the module doc); DataError naming row `index`
    when the chat template breaks the prefix property."""
    eos = tokenizer.eos_token_id

    def render(msgs, generation=False):
        text = tokenizer.apply_chat_template(list(msgs), tools=tools, tokenize=False,
                                             add_generation_prompt=generation)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def broken(k, what):
        return DataError(f"SFT row {index}: the chat template breaks the prefix property at message "
                         f"{k} ({messages[k]['role']}): {what}, so its tokens would differ from a "
                         "rollout's; fix the template (each turn rendered on its own) or the row")

    ids, mask = [], []
    for k, m in enumerate(messages):
        full = render(messages[:k + 1])
        if full[:len(ids)] != ids:
            raise broken(k, "rendering it changes the tokens of the turns before it")
        header = len(ids)
        if m["role"] == "assistant":
            if k == 0:
                raise DataError(f"SFT row {index}: the conversation starts with an assistant "
                                "message; it needs a system / user turn to answer")
            prompt = render(messages[:k], generation=True)
            if prompt[:len(ids)] != ids or full[:len(prompt)] != prompt:
                raise broken(k, "the generation prompt of the turns before it is not where "
                                "its own tokens start")
            header = len(prompt)
        mask.extend([0] * (header - len(ids)))
        turn = full[header:]
        if m["role"] == "assistant":
            end = len(turn)
            if eos in turn:
                end = len(turn) - turn[::-1].index(eos)
            mask.extend([1] * end + [0] * (len(turn) - end))
        else:
            mask.extend([0] * len(turn))
        ids = full
    return ids, mask


class SFTDataset:
    """Tokenized conversations; `dataset[i]` is a dict of index, prompt_ids, response_ids and
    loss_mask (over the response)."""

    def __init__(self, data, tokenizer, max_length, truncation="error", messages_key="messages",
                 tools_key="tools"):
        self.row_policy = RowPolicy(truncation, "SFT row", DROP_COUNTERS)
        self.tokenizer, self.max_length = tokenizer, max_length
        self.messages_key, self.tools_key = messages_key, tools_key
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("SFT data needs a tokenizer with a chat template (the turns are "
                            "rendered with it); set actor_rollout_ref.model.tokenizer_path to one")
        rows = data if isinstance(data, list) and (not data or isinstance(data[0], dict)) \
            else read_prompt_rows([data] if isinstance(data, (str, os.PathLike)) else data)
        self.examples = [e for e in (self._example(i, r) for i, r in enumerate(rows)) if e]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]

    @property
    def metrics(self):
        return dict(self.row_policy.counts,
                    **{"data/truncated_conversations": self.row_policy.truncated})

    def _tools(self, row, index):
        tools = row.get(self.tools_key)
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except ValueError as e:
                raise DataError(f"SFT row {index}: column {self.tools_key!r} is not JSON ({e}); "
                                "give a list of tool schemas") from None
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise DataError(f"SFT row {index}: column {self.tools_key!r} is "
                            f"{type(tools).__name__}, not a list of tool schemas")
        return list(tools) if tools else None

    def _example(self, index, row):
        if self.messages_key not in row:
            raise DataError(f"SFT row {index} has no column {self.messages_key!r} (columns: "
                            f"{sorted(row)}); set data.messages_key to the conversation column")
        messages = row[self.messages_key]
        if messages is None or len(messages) == 0:
            return self.row_policy.bad("data/dropped_empty", index,
                                       f"column {self.messages_key!r} is empty")
        if isinstance(messages, (str, bytes)):
            raise DataError(f"SFT row {index}: column {self.messages_key!r} is text, not a list "
                            "of {role, content} messages")
        messages = [_message(m, index, k) for k, m in enumerate(messages)]
        if not any(m["role"] == "assistant" for m in messages):
            return self.row_policy.bad("data/dropped_empty", index,
                                       "no assistant message (nothing to learn)")
        ids, mask = conversation_tokens(self.tokenizer, messages, self._tools(row, index), index)
        if len(ids) > self.max_length:
            if not self.row_policy.too_long(
                    "data/dropped_overlong", index,
                    f"{len(ids)} tokens > data.max_length={self.max_length}",
                    "raise data.max_length or set data.truncation to 'left', 'right' or 'filter'"):
                return None
            ids, mask = self.row_policy.cut(ids, self.max_length), \
                self.row_policy.cut(mask, self.max_length)
        if not any(mask[1:]):  # the first token is never predicted
            return self.row_policy.bad("data/dropped_empty", index, "no assistant token is left "
                                       f"within data.max_length={self.max_length}")
        start = max(1, mask.index(1))
        return dict(index=index, prompt_ids=ids[:start], response_ids=ids[start:],
                    loss_mask=mask[start:])


def sft_batch(examples, pad_token_id):
    """A Batch of conversations: response_mask = the loss mask, attention_mask = valid tokens."""
    prompt_ids, prompt_mask = left_pad([e["prompt_ids"] for e in examples], pad_token_id)
    responses, valid = right_pad([e["response_ids"] for e in examples], pad_token_id)
    loss_mask, _ = right_pad([e["loss_mask"] for e in examples], 0)
    tensors = dict(input_ids=torch.cat([prompt_ids, responses], 1),
                   attention_mask=torch.cat([prompt_mask, valid], 1),
                   responses=responses, response_mask=loss_mask)
    return Batch(tensors, dict(sft_index=[e["index"] for e in examples]))


# -- the built-in source ----------------------------------------------------------------------
def tool_conversations(n, seed=0, difficulty=1, split="train"):
    """Rows of the built-in `multiply` task (engine/tasks.py) solved with the calculator tool:
    the user asks "123*456=", the assistant calls calculator(expression="123*456"), the tool
    answers, the assistant answers the number."""
    from engine.tasks import make_rows
    rows = []
    for row in make_rows("multiply", n, seed, difficulty, split=split):
        question = row["prompt"][0]["content"]
        answer = row["reward_model"]["ground_truth"]
        call = {"type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": question.rstrip("=")})}}
        rows.append(dict(messages=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": answer}], extra_info=row["extra_info"]))
    return rows
