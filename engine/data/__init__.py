"""The data a run trains on: prompts, preference pairs, logged responses.

    prompts.py      parquet prompt rows (verl's schema) -> a tokenized PromptDataset, the
                    resumable PromptLoader, padding (pad_token_id, left_pad, right_pad)
    preference.py   preference pairs (prompt, chosen, rejected) -> PreferenceDataset,
                    PairLoader, pair batches; the built-in arithmetic pairs
    sft.py          SFT conversations (messages, tool calls) -> ids + assistant loss mask,
                    SFTDataset, sft batches; the built-in calculator conversations
    logged.py       logged responses for offline PPO (`data.offline_path`): LoggedDataset,
                    the prompts with their logged groups (read by engine/experience/logged.py)
    rows.py         the row policy (data.truncation) all of them follow: RowPolicy, truncation_of
    sources.py      rows from HF `datasets` directories, JSON files and a user's dataset class
                    (data.custom_cls), for all of the above

The prompt names are re-exported here (`from engine.data import PromptLoader, pad_token_id`);
preference pairs, SFT conversations and logged responses are imported from their modules.

Tests: tests/test_data.py, tests/test_preference_data.py, tests/test_row_policy.py, tests/test_pad_token.py,
tests/test_experience_parts.py, tests/test_sft.py, tests/test_data_sources.py
"""
from engine.data.prompts import (PromptBatch, PromptDataset, PromptLoader, is_empty, is_messages, left_pad,
                                 pad_token_id, right_pad, read_parquet, read_prompt_rows, write_prompt_parquet)
from engine.data.rows import TRUNCATION_POLICIES, RowPolicy, truncation_of

__all__ = ["TRUNCATION_POLICIES", "RowPolicy", "truncation_of", "PromptBatch", "PromptDataset", "PromptLoader",
           "is_empty", "is_messages", "left_pad", "pad_token_id", "right_pad", "read_parquet", "read_prompt_rows",
           "write_prompt_parquet"]
