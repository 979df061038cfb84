"""Logged responses for offline PPO / GRPO (`data.offline_path`): parquet rows of prompt,
response and reward, grouped by prompt (the experience source is engine/experience/logged.py).

A parquet row holds
    prompt               (data.prompt_key) text or chat messages, tokenized like prompts.py's
    response             text (its tokens plus eos, as a finished generation) or token ids as is
    reward | score       the response's scalar reward (one of the two columns)
    rollout_log_probs    optional: the behaviour policy's log-prob of each response token
    data_source, reward_model.ground_truth, extra_info   optional, carried along

Rows with the same prompt form its group, which must hold exactly actor_rollout_ref.rollout.n
responses. Each distinct prompt is one row of the prompt dataset, so the seeded, resumable
PromptLoader orders them.

Tests: tests/test_experience_parts.py, tests/test_offline_ppo.py
"""
import json
import math
import os

from engine.data.prompts import PromptDataset, read_prompt_rows

SCORE_COLUMNS = ("reward", "score")
LOG_PROB_COLUMN = "rollout_log_probs"


class LoggedDataset(PromptDataset):
    """Distinct prompts (a PromptDataset) with their logged groups: `logged(index)`."""

    def __init__(self, path, tokenizer, max_prompt_length, *, n, response_length, truncation="error",
                 prompt_key="prompt", apply_chat_template=True, need_log_probs=False):
        if not os.path.exists(path):
            raise ValueError(f"data.offline_path={path!r} does not exist; give a parquet file of logged "
                             "responses (prompt, response, reward or score[, rollout_log_probs])")
        rows = read_prompt_rows(path)
        groups, order = {}, []
        for i, row in enumerate(rows):
            if prompt_key not in row:
                raise ValueError(f"data.offline_path row {i} has no column {prompt_key!r} (columns: "
                                 f"{sorted(row)}); set data.prompt_key")
            key = json.dumps(row[prompt_key], sort_keys=True)
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append((i, row))
        self.has_log_probs = any(row.get(LOG_PROB_COLUMN) is not None for row in rows)
        if need_log_probs and not self.has_log_probs:
            raise ValueError(f"algorithm.rollout_correction is set but data.offline_path={path!r} "
                             f"has no {LOG_PROB_COLUMN!r} column (the behaviour policy's token log-probs); "
                             "log them, or set its rollout_is / rollout_rs / rollout_token_veto_threshold to null "
                             "(and bypass_mode to false)")
        prompt_rows = []
        for key in order:
            first = groups[key][0][1]
            truth = (first.get("reward_model") or {}).get("ground_truth")
            prompt_rows.append({prompt_key: first[prompt_key], "data_source": first.get("data_source"),
                                "extra_info": first.get("extra_info"),
                                "reward_model": {"style": "model", "ground_truth": truth}})
        super().__init__(prompt_rows, tokenizer, max_prompt_length, truncation=truncation,
                         prompt_key=prompt_key, apply_chat_template=apply_chat_template)
        self.filter_counts["data/filtered_overlong_response"] = 0
        self.n, self.response_length, self.eos = n, response_length, tokenizer.eos_token_id
        self._tokenizer = tokenizer
        self._logged = {}
        kept = []
        for example in self.examples:
            group = self._group(groups[order[example["index"]]])
            if group is not None:
                self._logged[example["index"]] = group
                kept.append(example)
        self.examples = kept

    def logged(self, index):
        """{'responses': [ids] x n, 'scores': [float] x n, 'log_probs': [[float]] x n or None}."""
        return self._logged[index]

    def _group(self, members):
        first = members[0][0]
        if len(members) != self.n:
            raise ValueError(f"data.offline_path: the prompt of row {first} has {len(members)} logged "
                             f"responses but actor_rollout_ref.rollout.n={self.n}; log n responses per "
                             "prompt (a group), or set rollout.n to the group size")
        out = {"responses": [], "scores": [], "log_probs": [] if self.has_log_probs else None}
        for i, row in members:
            ids = self._response_ids(i, row)
            lp = None
            if self.has_log_probs:
                lp = row.get(LOG_PROB_COLUMN)
                if lp is None or len(lp) != len(ids):
                    raise ValueError(f"data.offline_path row {i}: {LOG_PROB_COLUMN} has "
                                     f"{None if lp is None else len(lp)} values for {len(ids)} response "
                                     "tokens; every row needs one log-prob per response token")
                lp = [float(x) for x in lp]
            if len(ids) > self.response_length:
                if self.truncation == "filter":
                    self.filter_counts["data/filtered_overlong_response"] += 1
                    return None
                if self.truncation == "error":
                    raise ValueError(f"data.offline_path row {i}: the response has {len(ids)} tokens > "
                                     f"rollout.response_length={self.response_length}; raise "
                                     "data.max_response_length or set data.truncation to 'filter' (drop the "
                                     "prompt's group) or 'right' (cut the response)")
                ids, lp = ids[:self.response_length], None if lp is None else lp[:self.response_length]
                self.num_truncated += 1
            out["responses"].append(ids)
            out["scores"].append(self._score(i, row))
            if lp is not None:
                out["log_probs"].append(lp)
        return out

    def _response_ids(self, i, row):
        value = row.get("response")
        if isinstance(value, str) and value.strip():  # a finished generation: its tokens and eos
            return self._tokenizer(value, add_special_tokens=False)["input_ids"] + [self.eos]
        if isinstance(value, (list, tuple)) and value and all(isinstance(t, int) for t in value):
            return list(value)
        raise ValueError(f"data.offline_path row {i}: 'response' is {value!r}; give the response as "
                         "non-empty text or a list of token ids")

    @staticmethod
    def _score(i, row):
        present = [c for c in SCORE_COLUMNS if row.get(c) is not None]
        if len(present) != 1:
            raise ValueError(f"data.offline_path row {i}: needs exactly one of the columns "
                             f"{list(SCORE_COLUMNS)} (has {present or 'neither'})")
        value = row[present[0]]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"data.offline_path row {i}: {present[0]}={value!r} is not a finite number")
        return float(value)
