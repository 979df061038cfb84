"""Batch: the one container a PPO step takes and returns.

    batch = Batch({"input_ids": ids, "response_mask": mask},      # tensors, same dim 0
                  {"uid": uids, "ground_truth": answers},          # python objects, same length
                  meta={"temperature": 1.0})                      # anything else
    for micro in batch.split(4): ...
    ranks = batch.pad_to_multiple(dp)[0].chunk(dp)

Tensor fields share their first dimension (the batch size); non-tensor fields are 1-D numpy
object arrays of the same length. `meta` is a plain dict carried along (shallow-copied) by
every operation. Operations return new Batches and never modify their input (sliced tensors
may be views of the input's, as with torch.split).

`Split` says how a rank cuts its rows into micro-batches (a count, or a token budget); a model's
config section gives its update split (`update_split`) and a forward-only pass's
(`forward_split`). engine/config/batches.py plans a run's splits with them; a worker without a
plan (tests, the offline trainers) takes its own section's.

Tests: tests/test_batch.py, tests/test_ppo_update.py, tests/test_config.py
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

__all__ = ["Batch", "Split", "update_split", "forward_split"]


@dataclass(frozen=True)
class Split:
    """How a rank cuts its rows into micro-batches: a sequence count, or a token budget
    (dynamic batching)."""
    micro_batch_size: Optional[int] = None
    max_tokens: Optional[int] = None

    def kwargs(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "max_tokens": self.max_tokens}


def update_split(section) -> Split:
    """The update's micro-batches of an actor / critic config section (ppo_* keys)."""
    if section.use_dynamic_bsz:
        return Split(max_tokens=section.ppo_max_token_len_per_gpu)
    return Split(micro_batch_size=section.ppo_micro_batch_size_per_gpu)


def forward_split(section) -> Split:
    """A forward-only pass's micro-batches (a rollout / ref section's log_prob_* keys, resolved)."""
    if section.log_prob_use_dynamic_bsz:
        return Split(max_tokens=section.log_prob_max_token_len_per_gpu)
    return Split(micro_batch_size=section.log_prob_micro_batch_size_per_gpu)


def _as_object_array(key, values):
    if isinstance(values, np.ndarray):
        if values.ndim == 0:
            raise ValueError(f"non-tensor field {key!r} is a 0-d array; pass one value per row")
        return values
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # element-wise, so lists of equal-length lists stay 1-D
        array[i] = value
    return array


class Batch:
    def __init__(self, tensors=None, non_tensors=None, meta=None):
        self.tensors = {}
        self.non_tensors = {}
        self.meta = dict(meta or {})
        self._size = None
        for key, value in (tensors or {}).items():
            self[key] = value
        for key, value in (non_tensors or {}).items():
            self[key] = value

    # ------------------------------------------------------------------ fields

    def __len__(self):
        return self._size or 0

    def keys(self):
        return list(self.tensors) + list(self.non_tensors)

    def __contains__(self, key):
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"Batch has no field {key!r}; it has {self.keys()}")

    def __setitem__(self, key, value):
        """Add or replace a field; a tensor goes to `tensors`, anything else to `non_tensors`."""
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"tensor field {key!r} is 0-d; tensors need a batch dimension "
                                 f"(put scalars in meta)")
            self.non_tensors.pop(key, None)
            size, store = value.shape[0], self.tensors
        else:
            value = _as_object_array(key, value)
            self.tensors.pop(key, None)
            size, store = len(value), self.non_tensors
        others = [k for k in self.keys() if k != key]
        if others and size != self._size:
            raise ValueError(f"field {key!r} has {size} rows but the batch has {self._size} "
                             f"(from {others[0]!r}); every field needs one entry per row")
        store[key] = value
        self._size = size

    def __repr__(self):
        tensors = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return (f"Batch(len={len(self)}, tensors={tensors}, "
                f"non_tensors={list(self.non_tensors)}, meta={list(self.meta)})")

    # ------------------------------------------------------------------ row operations

    def _map_rows(self, tensor_fn, array_fn):
        return Batch({k: tensor_fn(v) for k, v in self.tensors.items()},
                     {k: array_fn(v) for k, v in self.non_tensors.items()}, self.meta)

    def select(self, keys):
        """A batch with only the named fields (tensor or non-tensor)."""
        for key in keys:
            self[key]  # raises naming the missing field
        return Batch({k: v for k, v in self.tensors.items() if k in keys},
                     {k: v for k, v in self.non_tensors.items() if k in keys}, self.meta)

    def index_select(self, indices):
        """Rows in the order of `indices` (a sequence or 1-D tensor of ints); reorders/gathers."""
        index = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if index.numel() and (index.min() < -len(self) or index.max() >= len(self)):
            raise ValueError(f"index_select indices must be in [-{len(self)}, {len(self)}); got "
                             f"min {int(index.min())}, max {int(index.max())}")
        rows = index.cpu().numpy()
        return self._map_rows(lambda t: t[index.to(t.device)], lambda a: a[rows])

    def _slice(self, start, stop):
        return self._map_rows(lambda t: t[start:stop], lambda a: a[start:stop])

    def split(self, size):
        """Consecutive pieces of `size` rows; the last one may be shorter."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self._slice(start, start + size) for start in range(0, len(self), size)]

    def chunk(self, n):
        """`n` equal consecutive pieces; len must divide by n (use pad_to_multiple first)."""
        if n < 1 or len(self) % n:
            raise ValueError(f"cannot chunk a batch of {len(self)} rows into {n} equal pieces; "
                             f"call pad_to_multiple({n}) first")
        return self.split(len(self) // n)

    @classmethod
    def concat(cls, batches):
        """Rows of `batches` one after another; all need the same fields. Meta of the first."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, batch in enumerate(batches[1:], start=1):
            if set(batch.tensors) != set(first.tensors) or \
                    set(batch.non_tensors) != set(first.non_tensors):
                raise ValueError(f"Batch.concat: batch {i} has fields {sorted(batch.keys())} but "
                                 f"batch 0 has {sorted(first.keys())}")
        return cls({k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
                   {k: np.concatenate([b.non_tensors[k] for b in batches])
                    for k in first.non_tensors}, first.meta)

    def repeat_interleave(self, n):
        """Each row repeated n times in place (n samples per prompt: a a b b, not a b a b)."""
        if n < 1:
            raise ValueError(f"repeat_interleave n must be >= 1, got {n}")
        return self._map_rows(lambda t: t.repeat_interleave(n, dim=0),
                              lambda a: np.repeat(a, n, axis=0))

    def pad_to_multiple(self, k):
        """(batch padded to a multiple of k rows, pad count). Padding rows are copies of the
        first rows (cycled), so they are valid data; drop them afterwards with unpad(count)."""
        if k < 1:
            raise ValueError(f"pad_to_multiple k must be >= 1, got {k}")
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch: there is no row to copy")
        pad = -len(self) % k
        if pad == 0:
            return self, 0
        return Batch.concat([self, self.index_select(torch.arange(pad) % len(self))]), pad

    def unpad(self, n):
        """Drop the last n rows (the padding added by pad_to_multiple)."""
        if not 0 <= n <= len(self):
            raise ValueError(f"unpad n={n} must be in [0, {len(self)}]")
        return self._slice(0, len(self) - n)

    # ------------------------------------------------------------------ whole-batch

    def to(self, device):
        """Tensors moved to `device`; non-tensor fields are shared."""
        return self._map_rows(lambda t: t.to(device), lambda a: a)

    def union(self, other):
        """Fields of both batches; a field in both must hold equal values (as must meta keys)."""
        if len(self) != len(other) and self.keys() and other.keys():
            raise ValueError(f"Batch.union: batches have {len(self)} and {len(other)} rows")
        merged = Batch(self.tensors, self.non_tensors, self.meta)
        for key in other.keys():
            value = other[key]
            if key in merged and not _same(merged[key], value):
                raise ValueError(f"Batch.union: field {key!r} differs between the batches")
            merged[key] = value
        for key, value in other.meta.items():
            if key in merged.meta and not _same(merged.meta[key], value):
                raise ValueError(f"Batch.union: meta {key!r} differs between the batches")
            merged.meta[key] = value
        return merged


def _same(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (torch.Tensor, np.ndarray)) or isinstance(b, (torch.Tensor, np.ndarray)):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # objects without a plain truth value
        return False
