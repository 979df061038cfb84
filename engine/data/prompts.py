"""Parquet prompt datasets and a resumable, seeded prompt loader.

Rows use the schema verl users already have:

    prompt        list of chat messages [{"role", "content"}], or plain text
    reward_model  {"ground_truth": str, "style": "rule" | "model"}
    data_source   str, selects the rule reward (engine/rewards/registry.py)
    extra_info    optional dict, passed to the reward function

Prompts are tokenized once, up front, so that bad rows are found (and counted) before training:
an empty prompt, a rule-reward row without ground truth, or a prompt longer than
`max_prompt_length`. `truncation` decides what happens to them, by the row policy every dataset
follows (engine/data/rows.py: 'error' raises, 'filter' drops and counts in `filter_counts`,
'left' / 'right' cut an over-long prompt).

Tests: tests/test_data.py, tests/test_row_policy.py, tests/test_pad_token.py, tests/test_offline_ppo.py
"""
import os
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from engine.data.rows import RowPolicy
from engine.errors import DataError


def write_prompt_parquet(rows, path):
    """Write rows (dicts in the schema above) to a parquet file, creating its directory. The
    file appears whole or not at all (written beside it, then renamed)."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_parquet(path):
    """The table of one parquet file (or directory of them); DataError when it is missing or
    is not readable parquet (empty, truncated, another format named .parquet)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"data file {path!r} does not exist; check data.train_files / data.val_files")
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise DataError(f"data file {path!r} is empty (0 bytes); write it again (tools/prepare_data.py) "
                        "or remove it from data.train_files / data.val_files")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid: not parquet / truncated footer
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"data file {path!r} is not a readable parquet file ({reason}); it is "
                        "probably truncated or in another format: write it again with "
                        "tools/prepare_data.py") from None


def read_prompt_rows(files):
    """Rows (dicts) of one or more parquet files, in file order."""
    files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    rows = []
    for path in files:
        rows.extend(read_parquet(path).to_pylist())
    return rows


def is_messages(prompt):
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)


def is_empty(prompt):
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    if is_messages(prompt):
        return not any(str(m.get("content") or "").strip() for m in prompt)
    return False


class PromptDataset:
    """Tokenized prompts with their ground truth; `dataset[i]` is a dict (see `_example`)."""

    def __init__(self, data, tokenizer, max_prompt_length, truncation="error", prompt_key="prompt",
                 apply_chat_template=True, tools=None):
        if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length={max_prompt_length!r} must be a positive integer")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.use_chat_template = apply_chat_template and getattr(tokenizer, "chat_template", None) is not None
        # the tool schemas the chat template shows the model (multi-turn rollouts with tools)
        self.tools = list(tools) if tools else None
        self.row_policy = RowPolicy(truncation, "prompt data row", ("data/filtered_empty_prompt",
                                                                    "data/filtered_missing_ground_truth",
                                                                    "data/filtered_overlong"))
        if _is_rows(data):
            rows = data
            self.row_policy.where = getattr(data, "where", "")  # Rows (engine/data/sources.py) say where
        else:
            files = [data] if isinstance(data, (str, os.PathLike)) else list(data)
            rows = read_prompt_rows(files)
            self.row_policy.where = f" of {', '.join(repr(os.fspath(f)) for f in files)}"
        self.examples = []
        for index, row in enumerate(rows):
            example = self._example(index, row)
            if example is not None:
                self.examples.append(example)

    @property
    def truncation(self):
        """data.truncation, as the row policy applies it."""
        return self.row_policy.truncation

    @property
    def filter_counts(self):
        """Rows dropped under truncation='filter', by reason."""
        return self.row_policy.counts

    @property
    def num_truncated(self):
        """Rows cut under truncation='left' / 'right'."""
        return self.row_policy.truncated

    @num_truncated.setter
    def num_truncated(self, value):
        self.row_policy.truncated = value

    def _prompt_text(self, prompt):
        if is_messages(prompt):
            if self.use_chat_template:
                extra = {"tools": self.tools} if self.tools else {}
                return self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True,
                                                          **extra)
            return "\n".join(str(m.get("content") or "") for m in prompt)
        return str(prompt)

    def _tokenize(self, prompt):
        if is_messages(prompt) and self.use_chat_template:  # the template already placed bos etc.
            return self.tokenizer(self._prompt_text(prompt), add_special_tokens=False)["input_ids"]
        return self.tokenizer(self._prompt_text(prompt), add_special_tokens=True)["input_ids"]

    def _example(self, index, row):
        if self.prompt_key not in row:
            raise DataError(f"prompt data row {index}{self.row_policy.where} has no field {self.prompt_key!r} "
                            f"(fields: {sorted(row)}); set data.prompt_key to the prompt column")
        prompt = row[self.prompt_key]
        if is_empty(prompt):
            return self.row_policy.bad("data/filtered_empty_prompt", index, f"field {self.prompt_key!r} is empty")
        reward_model = row.get("reward_model") or {}
        ground_truth = reward_model.get("ground_truth")
        needs_truth = reward_model.get("style", "rule") != "model"
        if needs_truth and (ground_truth is None or str(ground_truth).strip() == ""):
            return self.row_policy.bad("data/filtered_missing_ground_truth", index,
                                       "field 'reward_model.ground_truth' is missing or empty")
        input_ids = self._tokenize(prompt)
        if len(input_ids) > self.max_prompt_length:
            if not self.row_policy.too_long("data/filtered_overlong", index,
                                            f"field {self.prompt_key!r} has {len(input_ids)} tokens > "
                                            f"data.max_prompt_length={self.max_prompt_length}",
                                            "raise max_prompt_length or set data.truncation to 'left', 'right' or "
                                            "'filter'"):
                return None
            input_ids = self.row_policy.cut(input_ids, self.max_prompt_length)
        return {
            "index": index,
            "input_ids": input_ids,
            "raw_prompt": prompt,
            "ground_truth": ground_truth,
            "data_source": row.get("data_source"),
            "extra_info": row.get("extra_info"),
        }

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def _is_rows(data):
    return isinstance(data, (list, tuple)) and (not data or isinstance(data[0], dict))


def pad_token_id(tokenizer) -> int:
    """The run's pad id, decided here once: the tokenizer's pad token, else its eos token (many
    base models ship no pad token; padding never reaches a loss: the masks exclude it)."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has neither a pad token nor an eos "
                     "token; add one to its tokenizer_config.json (or set actor_rollout_ref.model.tokenizer_path "
                     "to a tokenizer that has one)")


def _pad(sequences, pad_token_id, length, left):
    length = length or max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq) > length:
            raise ValueError(f"sequence {row} has {len(seq)} tokens > pad length {length}")
        if seq:
            cols = slice(length - len(seq), length) if left else slice(0, len(seq))
            ids[row, cols] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, cols] = 1
    return ids, mask


def left_pad(sequences, pad_token_id, length=None):
    """(input_ids [B, T], attention_mask [B, T]) with each sequence right-aligned (left padding)."""
    return _pad(sequences, pad_token_id, length, left=True)


def right_pad(sequences, pad_token_id, length=None):
    """(ids [B, T], mask [B, T]) with each sequence left-aligned (right padding): responses."""
    return _pad(sequences, pad_token_id, length, left=False)


@dataclass
class PromptBatch:
    input_ids: list            # list of token-id lists, unpadded
    ground_truths: list
    data_sources: list
    raw_prompts: list
    extra_infos: list
    indices: list              # row indices in the source data
    epoch: int = 0
    meta: dict = field(default_factory=dict)

    def __len__(self):
        return len(self.input_ids)

    def collate(self, pad_token_id, length=None):
        """Left-padded (input_ids, attention_mask) tensors, ready for generation."""
        return left_pad(self.input_ids, pad_token_id, length)


class PromptLoader:
    """Seeded, epoch-shuffled batches with exact mid-epoch resume.

    Epoch e visits the rows in `randperm(len, seed + e)` order (identity when shuffle=False), so
    the position (epoch, batches consumed in the epoch) is all the state there is.
    `iter(loader)` yields the rest of the current epoch; `next_batch()` crosses epochs.
    """

    def __init__(self, dataset, batch_size, shuffle=True, seed=0, drop_last=True, prefetch=0, prepare=None):
        """prefetch (data.dataloader_num_workers): > 0 prepares the next batch in a background
        thread while the current step runs; the position (the state) moves only when a batch is
        taken, so resuming is exact either way. `prepare(batch)`, if given, runs on every batch
        as it is made (in that thread when prefetching): e.g. laying out logged responses."""
        if batch_size <= 0:
            raise ValueError(f"data.train_batch_size={batch_size!r} must be positive")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(f"dataset has {len(dataset)} rows (after filtering) < data.train_batch_size="
                             f"{batch_size}; use a smaller batch or more data")
        if len(dataset) == 0:
            raise ValueError("dataset is empty (after filtering); check the data files and filter counts")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.prepare = prepare
        self.epoch = 0
        self.batches_done = 0  # within the current epoch
        self._cached_order = (None, None)
        self._pool = None
        if prefetch:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._ahead = None  # ((epoch, batch index), future of that batch)

    def __len__(self):
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch):
        if self._cached_order[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(len(self.dataset), generator=generator).tolist()
            else:
                order = list(range(len(self.dataset)))
            self._cached_order = (epoch, order)
        return self._cached_order[1]

    def _make_batch(self, order, b, epoch=None):
        rows = [self.dataset[i] for i in order[b * self.batch_size:(b + 1) * self.batch_size]]
        batch = PromptBatch(input_ids=[r["input_ids"] for r in rows],
                            ground_truths=[r["ground_truth"] for r in rows],
                            data_sources=[r["data_source"] for r in rows],
                            raw_prompts=[r["raw_prompt"] for r in rows],
                            extra_infos=[r["extra_info"] for r in rows],
                            indices=[r["index"] for r in rows],
                            epoch=self.epoch if epoch is None else epoch)
        if self.prepare is not None:
            self.prepare(batch)
        return batch

    def _roll_epoch(self):
        if self.batches_done >= len(self):
            self.epoch += 1
            self.batches_done = 0

    def next_batch(self):
        self._roll_epoch()
        position = (self.epoch, self.batches_done)
        if self._ahead is not None and self._ahead[0] == position:
            batch = self._ahead[1].result()
        else:
            batch = self._make_batch(self._order(self.epoch), self.batches_done)
        self.batches_done += 1
        self._ahead = None
        if self._pool is not None:
            epoch, b = (self.epoch + 1, 0) if self.batches_done >= len(self) else (self.epoch, self.batches_done)
            self._ahead = ((epoch, b), self._pool.submit(self._make_batch, self._order(epoch), b, epoch))
        return batch

    def __iter__(self):
        self._roll_epoch()
        epoch, order = self.epoch, self._order(self.epoch)
        while self.epoch == epoch and self.batches_done < len(self):
            batch = self._make_batch(order, self.batches_done)
            self.batches_done += 1
            yield batch

    def state_dict(self):
        epoch, done = (self.epoch + 1, 0) if self.batches_done >= len(self) else (self.epoch, self.batches_done)
        return {"epoch": epoch, "batches_done": done, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "dataset_len": len(self.dataset)}

    def seek(self, batches):
        """The position after `batches` batches from the start (one per training step)."""
        self.epoch, self.batches_done = divmod(int(batches), len(self))
        self._ahead = None

    def load_state_dict(self, state):
        mine = self.state_dict()
        for key in ("seed", "shuffle", "batch_size", "dataset_len"):
            if state[key] != mine[key]:
                raise ValueError(f"data loader checkpoint has {key}={state[key]!r} but this run has {mine[key]!r}; "
                                 "resume with the same data, batch size and seed")
        self.epoch = int(state["epoch"])
        self.batches_done = int(state["batches_done"])
