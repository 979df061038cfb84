"""Batch: row operations round-trip and keep tensors and non-tensor fields aligned."""
import numpy as np
import pytest
import torch

from engine.batch import Batch

N = 7


def make_batch(n=N):
    rows = torch.arange(n)
    return Batch({"ids": torch.stack([rows * 10 + k for k in range(3)], dim=1),
                  "reward": rows.double() / 2},
                 {"uid": [f"p{i}" for i in range(n)],
                  "tokens": [[i, i + 1] for i in range(n)]},  # equal-length lists stay 1-D
                 meta={"temperature": 0.7})


def rows_of(batch):
    """Each row as plain python values, to compare batches field by field and row by row."""
    return [tuple([batch[k][i].tolist() for k in batch.tensors]
                  + [batch[k][i] for k in batch.non_tensors]) for i in range(len(batch))]


def assert_same(a, b):
    assert a.keys() == b.keys() and len(a) == len(b) and a.meta == b.meta
    assert rows_of(a) == rows_of(b)


def test_fields_and_lookup():
    batch = make_batch()
    assert len(batch) == N and batch.keys() == ["ids", "reward", "uid", "tokens"]
    assert batch["tokens"].shape == (N,) and batch["tokens"][3] == [3, 4]
    assert "uid" in batch and "values" not in batch
    with pytest.raises(KeyError, match="'values'.*'ids'"):
        batch["values"]
    batch["advantages"] = torch.zeros(N, 4)
    assert batch["advantages"].shape == (N, 4)
    assert len(Batch()) == 0


def test_mismatched_sizes_name_the_key():
    with pytest.raises(ValueError, match="'uid' has 3 rows but the batch has 7"):
        Batch({"ids": torch.zeros(N, 2)}, {"uid": ["a", "b", "c"]})
    with pytest.raises(ValueError, match="'values' has 6 rows"):
        make_batch()["values"] = torch.zeros(N - 1)
    with pytest.raises(ValueError, match="'score' is 0-d"):
        Batch({"score": torch.tensor(1.0)})


@pytest.mark.parametrize("size", [1, 2, 3, N, N + 1])
def test_split_then_concat_is_the_original(size):
    batch = make_batch()
    pieces = batch.split(size)
    assert [len(p) for p in pieces] == [min(size, N - s) for s in range(0, N, size)]
    assert_same(Batch.concat(pieces), batch)


def test_chunk_needs_equal_pieces_and_pad_unpad_round_trips():
    batch = make_batch()
    with pytest.raises(ValueError, match="pad_to_multiple\\(4\\)"):
        batch.chunk(4)
    padded, pad = batch.pad_to_multiple(4)
    assert pad == 1 and len(padded) == 8
    assert rows_of(padded)[N:] == rows_of(batch)[:1]  # padding copies real rows
    chunks = padded.chunk(4)
    assert [len(c) for c in chunks] == [2, 2, 2, 2]
    assert_same(Batch.concat(chunks).unpad(pad), batch)
    same, zero = batch.pad_to_multiple(N)
    assert zero == 0 and same is batch
    small, pad = make_batch(2).pad_to_multiple(5)  # more padding than rows: cycles
    assert pad == 3 and rows_of(small) == [rows_of(make_batch(2))[i % 2] for i in range(5)]


def test_index_select_reorders_every_field_together():
    batch = make_batch()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    shuffled = batch.index_select(order)
    assert rows_of(shuffled) == [rows_of(batch)[i] for i in order.tolist()]
    inverse = torch.argsort(order)
    assert_same(shuffled.index_select(inverse), batch)
    assert rows_of(batch.index_select([5, 5, 0])) == [rows_of(batch)[i] for i in (5, 5, 0)]
    with pytest.raises(ValueError, match="indices"):
        batch.index_select([N])


def test_repeat_interleave_groups_samples_of_a_prompt():
    batch = make_batch(3)
    repeated = batch.repeat_interleave(2)
    assert rows_of(repeated) == [r for r in rows_of(batch) for _ in range(2)]
    assert list(repeated["uid"]) == ["p0", "p0", "p1", "p1", "p2", "p2"]


def test_select_union_and_to():
    batch = make_batch()
    left, right = batch.select(["ids", "uid"]), batch.select(["reward", "tokens", "ids"])
    assert left.keys() == ["ids", "uid"]
    merged = left.union(right)
    assert sorted(merged.keys()) == sorted(batch.keys())
    assert_same(merged.select(batch.keys()), batch.select(batch.keys()))
    with pytest.raises(KeyError, match="'nope'"):
        batch.select(["nope"])
    changed = right.select(["ids"])
    changed["ids"] = changed["ids"] + 1
    with pytest.raises(ValueError, match="field 'ids' differs"):
        left.union(changed)
    with pytest.raises(ValueError, match="7 and 3 rows"):
        batch.union(make_batch(3))
    moved = batch.to("cpu")
    assert_same(moved, batch)


def test_concat_rejects_different_fields():
    with pytest.raises(ValueError, match="batch 1 has fields"):
        Batch.concat([make_batch(), make_batch().select(["ids"])])


def test_operations_do_not_modify_the_input():
    batch = make_batch()
    before = rows_of(batch)
    batch.split(2), batch.index_select([1, 0]), batch.pad_to_multiple(3), batch.repeat_interleave(2)
    piece = batch.split(3)[0]
    piece.meta["temperature"] = 1.0
    piece["extra"] = np.arange(3)
    assert rows_of(batch) == before and batch.meta == {"temperature": 0.7}
    assert "extra" not in batch
