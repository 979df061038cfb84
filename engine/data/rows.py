"""The row policy: what `data.truncation` does with a bad row, for prompt rows
(engine/data/prompts.py, and the logged responses built on them) and preference pairs
(engine/data/preference.py) alike. One error type (DataError, naming the row and the fix), one
set of rules:

    'error'  raise, naming the row and the field (default: bad data should not pass silently)
    'filter' drop the row and count it (its counter, e.g. data/filtered_overlong)
    'left'   keep the last max_prompt_length tokens of an over-long prompt (other bad rows raise)
    'right'  keep the first max_prompt_length tokens of an over-long prompt (other bad rows raise)

`data.filter_overlong_prompts: true` is verl's spelling of truncation='filter': `truncation_of`
reads both keys, for derive() and for every loader.

Tests: tests/test_row_policy.py, tests/test_data.py, tests/test_preference_data.py
"""
from engine.errors import DataError

__all__ = ["TRUNCATION_POLICIES", "RowPolicy", "truncation_of"]

TRUNCATION_POLICIES = ("error", "filter", "left", "right")
DROP = "fix the data or set data.truncation='filter' to drop such rows"


def truncation_of(data) -> str:
    """The policy a data config section asks for (filter_overlong_prompts=true means 'filter')."""
    return "filter" if data.filter_overlong_prompts else data.truncation


class RowPolicy:
    """`truncation` applied to the rows of one dataset: `what` names a row in messages (e.g.
    'prompt data row'), `where` follows its index (e.g. " of 'train.parquet'"); `counts` holds
    the dropped rows per counter, `truncated` the rows cut."""

    def __init__(self, truncation, what="row", counters=(), where=""):
        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"data.truncation={truncation!r}; choose one of {list(TRUNCATION_POLICIES)}")
        self.truncation, self.what, self.where = truncation, what, where
        self.counts = {c: 0 for c in counters}
        self.truncated = 0

    def fail(self, index, message, fix=DROP):
        raise DataError(f"{self.what} {index}{self.where}: {message}; {fix}")

    def bad(self, counter, index, message, fix=DROP):
        """A row the policy cannot keep: None when it drops it ('filter', counted under
        `counter`); else DataError naming the row, what is wrong and `fix`."""
        if self.truncation == "filter":
            self.counts[counter] += 1
            return None
        self.fail(index, message, fix)

    def too_long(self, counter, index, message, fix=DROP) -> bool:
        """An over-long row: True when it is to be cut ('left' / 'right'; counted in
        `truncated`), False when it is dropped ('filter'); raises under 'error'."""
        if self.truncation in ("left", "right"):
            self.truncated += 1
            return True
        self.bad(counter, index, message, fix)
        return False

    def cut(self, ids, limit):
        """An over-long prompt cut to `limit` tokens on the policy's side."""
        return ids[-limit:] if self.truncation == "left" else ids[:limit]
