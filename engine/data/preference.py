"""Preference pairs: parquet rows -> tokenized (prompt, chosen, rejected), batches of pairs.

A row holds `prompt`, `chosen`, `rejected` (column names: data.prompt_key / chosen_key /
rejected_key) in one of the formats users have:

    text         prompt "3+4=", chosen "7", rejected "5"
    chat         chosen / rejected are message lists whose LAST message is the assistant's
                 response (UltraFeedback-binarized, HH-style); the messages before it are the
                 prompt conversation (both lists must agree there), else the prompt column
    optional     a margin column (data.margin_key; reward model only), and
                 `ref_chosen_logps` / `ref_rejected_logps` (DPO with
                 algorithm.dpo.precomputed_ref_log_probs: summed reference log-probs of the
                 responses, tokenized exactly as here)

Prompts are tokenized like prompts.py's (the chat template with a generation prompt when
the tokenizer has one); a response is its text's tokens plus eos, as the rollout produces.
Bad rows follow `data.truncation` by the row policy prompts follow (engine/data/rows.py, one
DataError naming the row): 'error' raises; 'filter' drops and counts them (`data/dropped_empty`,
`data/dropped_identical`, `data/dropped_overlong`); 'left' / 'right' cut an over-long prompt on
that side and an over-long response at its end (`data/truncated_pairs`), other bad rows raise.
Besides parquet: a HF `datasets` directory, JSON files or a user's dataset class
(engine/data/sources.py; the loaders pass their rows).

Tests: tests/test_preference_data.py, tests/test_row_policy.py, tests/test_offline_trainers.py
"""
import json
import math
import os
import random

import pyarrow.parquet as pq
import torch

from engine.batch import Batch
from engine.data.prompts import (PromptLoader, is_empty, is_messages, left_pad, right_pad,
                                 write_prompt_parquet)
from engine.data.rows import RowPolicy
from engine.data.sources import is_hf_source, read_hf_rows
from engine.errors import DataError

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
DROP_COUNTERS = ("data/dropped_empty", "data/dropped_identical", "data/dropped_overlong")

__all__ = ["PreferenceDataset", "PairLoader", "pair_batch", "arith_pairs", "jsonl_pairs",
           "read_preference_rows", "write_preference_parquet", "split_pair", "text_problem"]


def read_preference_rows(files):
    """Rows (dicts) of parquet file(s) or HF datasets sources (engine/data/sources.py), in order."""
    files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    rows = []
    for path in files:
        if is_hf_source(path):  # a HF `datasets` directory or JSON file
            rows.extend(read_hf_rows(path))
            continue
        if not os.path.exists(path):
            raise DataError(f"preference data file {path!r} does not exist; check data.train_files"
                            " / data.val_files")
        rows.extend(pq.read_table(path).to_pylist())
    return rows


def write_preference_parquet(rows, path):
    """Rows to parquet; a column must hold one kind of value (parquet columns are typed)."""
    kinds = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            kind = "messages" if isinstance(value, (list, tuple)) else "text" \
                if isinstance(value, str) else None
            if kind and kinds.setdefault(key, (kind, i))[0] != kind:
                first, at = kinds[key]
                raise ValueError(f"column {key!r} holds {first} (row {at}) and {kind} (row {i}); "
                                 "a parquet column has one type: write every row one way")
    write_prompt_parquet(rows, path)


def _response_of(value, what, index):
    """(prompt messages before the response or None, response text) of a chosen/rejected cell."""
    if isinstance(value, str) or value is None:
        return None, value
    if is_messages(value):
        if not value or value[-1].get("role") != "assistant":
            role = value[-1].get("role") if value else None
            raise DataError(f"preference row {index}: {what}'s last message has role {role!r}; "
                            "a message list must end with the assistant's response")
        return list(value[:-1]), value[-1].get("content")
    raise DataError(f"preference row {index}: {what} is a {type(value).__name__}; use a string "
                    "or a list of {role, content} messages")


def split_pair(row, index, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected"):
    """(prompt: text or messages, chosen text, rejected text) of a row in any supported format."""
    for key, name in ((chosen_key, "chosen_key"), (rejected_key, "rejected_key")):
        if key not in row:
            raise DataError(f"preference row {index} has no column {key!r} (columns: "
                            f"{sorted(row)}); set data.{name} to the column holding it")
    c_prefix, chosen = _response_of(row[chosen_key], "chosen", index)
    r_prefix, rejected = _response_of(row[rejected_key], "rejected", index)
    if c_prefix is not None and r_prefix is not None and c_prefix != r_prefix:
        raise DataError(f"preference row {index}: the chosen and rejected conversations differ "
                        "before their last assistant turn; both must answer the same prompt")
    prefix = c_prefix if c_prefix else r_prefix
    if prefix:  # the conversation carries the whole prompt (multi-turn context included)
        return prefix, chosen, rejected
    if prompt_key not in row:
        raise DataError(f"preference row {index} has no column {prompt_key!r} and its responses "
                        "carry no conversation; set data.prompt_key to the prompt column")
    return row[prompt_key], chosen, rejected


def text_problem(prompt, chosen, rejected):
    """'empty' / 'identical' / None: what makes a pair useless before tokenization. An empty
    rejected response is kept: the chosen answer beating no answer at all is a preference (a
    policy can stop at once, so a reward model should have seen it lose)."""
    if is_empty(prompt) or not (chosen or "").strip() or rejected is None:
        return "empty"
    if chosen == rejected:
        return "identical"
    return None


def _number(row, key, index, fix):
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"preference row {index}: column {key!r} is {value!r}, not a finite "
                        f"number; {fix}")
    return float(value)


class PreferenceDataset:
    """Tokenized preference pairs; `dataset[i]` is a dict (see `_example`)."""

    def __init__(self, data, tokenizer, max_prompt_length, max_response_length,
                 truncation="error", prompt_key="prompt", chosen_key="chosen",
                 rejected_key="rejected", margin_key=None, ref_columns=False,
                 apply_chat_template=True):
        self.row_policy = RowPolicy(truncation, "preference row", DROP_COUNTERS)
        self.tokenizer = tokenizer
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.keys = dict(prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key)
        self.margin_key, self.ref_columns = margin_key, ref_columns
        self.use_chat_template = (apply_chat_template
                                  and getattr(tokenizer, "chat_template", None) is not None)
        rows = data if isinstance(data, list) and (not data or isinstance(data[0], dict)) \
            else read_preference_rows(data)
        self.examples = [e for e in (self._example(i, r) for i, r in enumerate(rows)) if e]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]

    @property
    def filter_counts(self):
        return self.row_policy.counts

    @property
    def num_truncated(self):
        return self.row_policy.truncated

    @property
    def metrics(self):
        return dict(self.filter_counts, **{"data/truncated_pairs": self.num_truncated})

    def _prompt_ids(self, prompt):
        if is_messages(prompt):
            if self.use_chat_template:  # the template places bos etc.
                text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False,
                                                          add_generation_prompt=True)
                return self.tokenizer(text, add_special_tokens=False)["input_ids"]
            prompt = "\n".join(str(m.get("content") or "") for m in prompt)
        return self.tokenizer(str(prompt), add_special_tokens=True)["input_ids"]

    def _response_ids(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
            self.tokenizer.eos_token_id]

    def _example(self, index, row):
        prompt, chosen, rejected = split_pair(row, index, **self.keys)
        problem = text_problem(prompt, chosen, rejected)
        if problem == "empty":
            return self.row_policy.bad("data/dropped_empty", index, "the prompt or a response is empty")
        if problem == "identical":
            return self.row_policy.bad("data/dropped_identical", index,
                                       "chosen and rejected are the same response (no preference)")
        extra = {}
        if self.margin_key:
            extra["margin"] = _number(row, self.margin_key, index,
                                      "fix it or set data.margin_key=null")
        if self.ref_columns:
            for key in REF_COLUMNS:
                extra[key] = _number(row, key, index, "precompute it for every row, or set "
                                     "algorithm.dpo.precomputed_ref_log_probs=false")
        p_ids, c_ids, r_ids = (self._prompt_ids(prompt), self._response_ids(chosen),
                               self._response_ids(rejected))
        long_prompt = len(p_ids) > self.max_prompt_length
        long_response = max(len(c_ids), len(r_ids)) > self.max_response_length
        if long_prompt or long_response:
            what = (f"the prompt has {len(p_ids)} tokens > data.max_prompt_length="
                    f"{self.max_prompt_length}" if long_prompt else
                    f"a response has {max(len(c_ids), len(r_ids))} tokens (with eos) > "
                    f"data.max_response_length={self.max_response_length}")
            if not self.row_policy.too_long("data/dropped_overlong", index, f"{what}; raise the limit or set "
                                            "data.truncation to 'left', 'right' or 'filter'"):
                return None
            p_ids = self.row_policy.cut(p_ids, self.max_prompt_length)
            c_ids, r_ids = c_ids[:self.max_response_length], r_ids[:self.max_response_length]
            if c_ids == r_ids:  # only the cut-off ends differed
                return self.row_policy.bad("data/dropped_identical", index, "chosen and rejected are "
                                           "identical within data.max_response_length tokens")
        if c_ids == r_ids:
            return self.row_policy.bad("data/dropped_identical", index,
                                       "chosen and rejected tokenize to the same response")
        return dict(index=index, prompt_ids=p_ids, chosen_ids=c_ids, rejected_ids=r_ids, **extra)


class PairLoader(PromptLoader):
    """PromptLoader's seeded, resumable order over pairs (or SFT conversations): a batch is a
    list of examples."""

    def _make_batch(self, order, b, epoch=None):
        return [self.dataset[i] for i in order[b * self.batch_size:(b + 1) * self.batch_size]]


def pair_batch(examples, pad_token_id):
    """A Batch of 2 x len(examples) sequences in verl's layout, chosen at row 2i and rejected
    at 2i+1 (prompt left-padded, response right-padded); `pair_margin` and `ref_logps` (the
    reference's summed log-prob of each row's response) when the examples carry them."""
    prompts = [e["prompt_ids"] for e in examples for _ in range(2)]
    responses = [e[k] for e in examples for k in ("chosen_ids", "rejected_ids")]
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    resp, rmask = right_pad(responses, pad_token_id)
    tensors = dict(input_ids=torch.cat([prompt_ids, resp], 1),
                   attention_mask=torch.cat([prompt_mask, rmask], 1),
                   responses=resp, response_mask=rmask)
    if examples and "margin" in examples[0]:
        tensors["pair_margin"] = torch.tensor([e["margin"] for e in examples for _ in range(2)])
    if examples and REF_COLUMNS[0] in examples[0]:
        tensors["ref_logps"] = torch.tensor([e[k] for e in examples for k in REF_COLUMNS])
    return Batch(tensors, dict(pair_index=[e["index"] for e in examples for _ in range(2)]))


# -- sources -------------------------------------------------------------------------------
ANSWER_RANGE = {0: range(0, 9), 1: range(0, 19), 2: range(-99, 199)}


def arith_pairs(n, seed=0, difficulty=0, split="train", graded=False):
    """Pairs from the built-in `arith` task (engine/tasks.py): chosen = the correct answer,
    rejected = a wrong one drawn uniformly from the level's answer range, so the answer alone
    does not give the preference away: the prompt has to be read.

    graded=True: pairs for a reward model that PPO trains a policy on from scratch (no rule
    reward). Such a policy emits everything on its way and exploits whatever the reward model
    never saw lose, so the pairs rank, in the spirit of engine/rewards/arith.py's grades:
    the exact answer over a wrong one (drawn from the task's own answers: sums near the middle
    are more common, and a uniform draw would teach that they are likely right), over the
    answer with characters after it, over junk, over no answer; and the right answer followed
    by anything over a wrong one followed by anything. Responses longer than
    data.max_response_length are cut without eos under data.truncation='right': what a
    generation that ran out of tokens looks like."""
    from engine.tasks import CHARACTERS, make_rows
    rng = random.Random(f"arith-pairs-{difficulty}-{split}-{seed}" + ("-graded" if graded else ""))
    rows = make_rows("arith", n, seed, difficulty, split=split)
    answers = [r["reward_model"]["ground_truth"] for r in rows]

    def junk(low, high):
        return "".join(rng.choice(CHARACTERS) for _ in range(rng.randint(low, high)))

    def wrong(answer):
        if not graded:
            return str(rng.choice([v for v in ANSWER_RANGE[difficulty] if str(v) != answer]))
        while True:
            other = rng.choice(answers)
            if other != answer:
                return other

    out = []
    for row, answer in zip(rows, answers):
        chosen, kind = answer, "wrong"
        if graded:
            kind = rng.choices(("wrong", "extra", "junk", "blank", "prefix"), (0.35, 0.15, 0.1, 0.1, 0.3))[0]
        rejected = {"wrong": lambda: wrong(answer), "extra": lambda: answer + junk(1, 3),
                    "junk": lambda: junk(1, 4), "blank": lambda: ""}.get(kind, lambda: None)()
        if kind == "prefix":
            chosen, rejected = answer + junk(0, 3), wrong(answer) + junk(0, 3)
        if rejected == chosen:  # junk that happens to be the answer
            rejected = wrong(answer)
        out.append(dict(prompt=row["prompt"], chosen=chosen, rejected=rejected,
                        data_source="arith", extra_info=row["extra_info"]))
    return out


def jsonl_pairs(path, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected"):
    """(rows, counts) of a JSONL file of {prompt, chosen, rejected, ...}: empty and identical
    pairs are dropped and counted (`data/dropped_*`); malformed lines raise, naming the line."""
    rows, counts = [], {"data/dropped_empty": 0, "data/dropped_identical": 0}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                problem = text_problem(*split_pair(row, line_no, prompt_key, chosen_key,
                                                   rejected_key))
            except ValueError as e:
                raise DataError(f"{path}:{line_no}: not a preference record ({e})") from None
            if problem:
                counts[f"data/dropped_{problem}"] += 1
            else:
                rows.append(row)
    return rows, counts
