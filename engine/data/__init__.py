"""The data a run trains on: prompts, preference pairs.

    prompts.py      parquet prompt rows (verl's schema) -> a tokenized PromptDataset, the
                    resumable PromptLoader, padding (pad_token_id, left_pad)
    preference.py   preference pairs (prompt, chosen, rejected) -> PreferenceDataset,
                    PairLoader, pair batches; the built-in arithmetic pairs

Logged responses (offline PPO, `data.offline_path`) are read by engine/experience_offline.py
through prompts.py's row reader.

The prompt names are re-exported here (`from engine.data import PromptLoader, pad_token_id`);
preference pairs are imported from engine.data.preference.

Tests: tests/test_data.py, tests/test_preference_data.py, tests/test_pad_token.py
"""
from engine.data.prompts import (TRUNCATION_POLICIES, PromptBatch, PromptDataset, PromptLoader,
                                 is_empty, is_messages, left_pad, pad_token_id, read_parquet,
                                 read_prompt_rows, write_prompt_parquet)

__all__ = ["TRUNCATION_POLICIES", "PromptBatch", "PromptDataset", "PromptLoader", "is_empty",
           "is_messages", "left_pad", "pad_token_id", "read_parquet", "read_prompt_rows",
           "write_prompt_parquet"]
