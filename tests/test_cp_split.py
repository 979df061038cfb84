"""Context-parallel split and gather (parallel.packing), against the unsplit row and against
Megatron's own CP layouts (its [b, s] batch split and its THD RoPE position mapping)."""
import pytest
import torch
import torch.distributed as dist

from parallel.packing import (cp_gather, cp_index, cp_localize, cp_split, pack, round_up,
                              row_bounds)

LENGTHS = [5, 8, 3, 13, 1]  # uneven, most not a multiple of 2 x CP


def _sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 100, (n,), generator=g) for n in LENGTHS]


def _per_token(tokens, positions):
    """A stand-in for a per-token result that depends on the token and where it sits."""
    return tokens.float() * 1000 + positions.float()


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_split_and_gather_equal_the_unsplit_row(cp, tp):
    seqs = _sequences()
    p = pack(seqs, multiple_of=tp, seq_multiple_of=2 * cp * tp)
    # every sequence padded to a multiple of 2 x CP x TP, each at the start of its segment
    spans = [b - a for a, b in zip(p.bounds[:-1], p.bounds[1:])]
    assert spans == [round_up(n, 2 * cp * tp) for n in LENGTHS]
    assert torch.equal(p.params.cu_seqlens_q_padded, torch.tensor(p.bounds, dtype=torch.int32))
    assert p.params.max_seqlen_q == max(spans)
    for seq, off in zip(seqs, p.offsets):
        assert torch.equal(p.tokens[0, off:off + seq.numel()], seq)

    flat = p.tokens.view(-1)
    pos_in_seq = torch.cat([torch.arange(s) for s in spans])  # RoPE position of each token
    parts, indices = [], []
    for r in range(cp):
        local, index = cp_split(p.tokens, p.bounds, cp, r)
        assert local.shape == (1, p.total // cp)
        assert (p.total // cp) % tp == 0  # sequence parallelism splits the local row over TP
        assert torch.equal(local.view(-1), flat[index])
        parts.append(_per_token(local.view(-1), pos_in_seq[index]))
        indices.append(index)
    assert torch.equal(cp_gather(parts, indices), _per_token(flat, pos_in_seq))


@pytest.mark.parametrize("cp", [2, 4])
def test_thd_positions_are_those_megatrons_rope_gives_each_rank(cp):
    """Megatron's THD RoPE (with CP) picks, for rank r, the positions of chunks r and 2CP-1-r of
    each padded sequence: they must be the positions of the tokens `cp_split` gives rank r."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    p = pack(_sequences(), seq_multiple_of=2 * cp)
    spans = [b - a for a, b in zip(p.bounds[:-1], p.bounds[1:])]
    positions = torch.arange(max(spans)).float()
    for r in range(cp):
        _, index = cp_split(p.tokens, p.bounds, cp, r)
        expected = torch.cat([
            _get_thd_freqs_on_this_cp_rank(r, cp, torch.empty(span // cp), positions)
            for span in spans])
        starts = torch.tensor(p.bounds[:-1]).repeat_interleave(torch.tensor(spans) // cp)
        assert torch.equal((index - starts).float(), expected)


class _Group:
    """The size and rank Megatron's batch split reads from a CP process group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture
def single_process_group():
    """Megatron reads a group's size only once torch.distributed is up."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_row_split_equals_megatrons_batch_split(cp, single_process_group):
    from megatron.core.utils import get_batch_on_this_cp_rank

    b, s = 3, 8 * cp
    tokens = torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(s).expand(b, s)
    for r in range(cp):
        want = get_batch_on_this_cp_rank(dict(tokens=tokens.clone(), pos=positions.clone()),
                                         cp_group=_Group(cp, r))
        local, index = cp_split(tokens, row_bounds(b, s), cp, r)
        assert torch.equal(local, want["tokens"])
        assert torch.equal(positions.reshape(-1)[index].view(b, -1), want["pos"])


@pytest.mark.parametrize("cp", [2, 4])
def test_predictions_localised_and_gathered_back_in_order(cp):
    p = pack(_sequences(), seq_multiple_of=2 * cp)
    flat = p.tokens.view(-1)
    # every position but each sequence's last predicts the next token
    positions = torch.cat([torch.arange(o, o + n - 1) for o, n in zip(p.offsets, LENGTHS)])
    labels = flat[positions + 1]
    parts, takes = [], []
    for r in range(cp):
        local_tokens, index = cp_split(p.tokens, p.bounds, cp, r)
        local, take = cp_localize(positions, index)
        assert torch.equal(local_tokens.view(-1)[local], flat[positions[take]])
        parts.append(labels[take] * 10 + local_tokens.view(-1)[local])
        takes.append(take)
    assert sum(t.numel() for t in takes) == positions.numel()
    assert torch.equal(cp_gather(parts, takes), labels * 10 + flat[positions])


def test_refuses_unpadded_segments_and_incomplete_indices():
    with pytest.raises(ValueError, match="2 x CP = 4"):
        cp_index([0, 6], 2, 0)
    with pytest.raises(ValueError, match="exactly once"):
        cp_gather([torch.ones(2), torch.ones(2)], [torch.tensor([0, 1]), torch.tensor([1, 2])])
    # without CP, packing is unchanged: no per-sequence padding, no padded cu_seqlens
    p = pack(_sequences(), multiple_of=4)
    assert p.bounds == [0, 5, 13, 16, 29, 30, 32] and p.total == 32
    assert p.params.cu_seqlens_q_padded is None
