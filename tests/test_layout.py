"""Layouts and block schedules, checked without processes.

Coverage: over all (rank, src) pairs, every (query, key) pair that the mask allows is computed in
exactly one block, and no hidden pair is computed at all. Balance: zigzag and striped give every
rank the same causal work.
"""

import pytest
import torch

import ringattn
from ringattn.layout import LAYOUTS, get_layout


def _coverage(layout_name: str, world_size: int, local_len: int, causal: bool) -> torch.Tensor:
    """How often each global (query, key) pair is computed by the whole schedule."""
    layout = get_layout(layout_name)
    seq_len = world_size * local_len
    counts = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    for rank in range(world_size):
        q_pos = layout.global_indices(seq_len, world_size, rank)
        for src in range(world_size):
            k_pos = layout.global_indices(seq_len, world_size, src)
            for block in layout.schedule(rank, src, world_size, local_len, causal):
                assert block.q_stop > block.q_start and block.kv_stop > block.kv_start, block
                rows = q_pos[block.q_start : block.q_stop]
                cols = k_pos[block.kv_start : block.kv_stop]
                if block.causal:
                    assert len(rows) == len(cols), "causal blocks must be square"
                    visible = torch.ones(len(rows), len(cols), dtype=torch.bool).tril()
                else:
                    visible = torch.ones(len(rows), len(cols), dtype=torch.bool)
                qq, kk = torch.meshgrid(rows, cols, indexing="ij")
                counts.index_put_((qq[visible], kk[visible]), torch.tensor(1), accumulate=True)
    return counts


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("local_len", [2, 6])
def test_every_visible_pair_exactly_once(layout_name, world_size, local_len, causal):
    counts = _coverage(layout_name, world_size, local_len, causal)
    seq_len = world_size * local_len
    expected = torch.ones(seq_len, seq_len, dtype=torch.int64)
    if causal:
        expected = expected.tril()
    assert torch.equal(counts, expected)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_indices_partition_the_sequence(layout_name, world_size):
    layout = get_layout(layout_name)
    seq_len = world_size * 4
    perm = layout.permutation(seq_len, world_size)
    assert torch.equal(perm.sort().values, torch.arange(seq_len))
    for rank in range(world_size):
        idx = layout.global_indices(seq_len, world_size, rank)
        assert len(idx) == seq_len // world_size
        assert bool((idx[1:] > idx[:-1]).all()), "local tokens must be in increasing order"


def test_zigzag_holds_chunks_r_and_2w_minus_1_minus_r():
    layout = get_layout("zigzag")
    assert layout.global_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert get_layout("striped").global_indices(12, 4, 1).tolist() == [1, 5, 9]
    assert get_layout("contiguous").global_indices(12, 4, 3).tolist() == [9, 10, 11]


def _work(layout_name, world_size, local_len):
    layout = get_layout(layout_name)
    work = []
    for rank in range(world_size):
        pairs = 0
        for src in range(world_size):
            for b in layout.schedule(rank, src, world_size, local_len, True):
                n = b.q_stop - b.q_start
                pairs += n * (n + 1) // 2 if b.causal else n * (b.kv_stop - b.kv_start)
        work.append(pairs)
    return work


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_causal_work_is_balanced_for_zigzag_and_striped(world_size):
    local_len = 128
    zigzag = _work("zigzag", world_size, local_len)
    assert len(set(zigzag)) == 1, zigzag  # exactly equal
    striped = _work("striped", world_size, local_len)  # differs by < one row per rank
    assert max(striped) / min(striped) < 1.1, striped
    contiguous = _work("contiguous", world_size, local_len)
    assert max(contiguous) > 1.5 * min(contiguous)  # the imbalance the other two layouts remove


def test_unknown_layout_lists_choices():
    with pytest.raises(ValueError, match="contiguous.*striped.*zigzag"):
        get_layout("zig-zag")
    with pytest.raises(ValueError, match="unknown layout"):
        ringattn.positions(8, layout="diagonal")


def test_divisibility_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"1020 is not divisible by 2\*world_size=8.*pad.*1024"):
        get_layout("zigzag").check_seq_len(1020, 4)
    with pytest.raises(ValueError, match="local sequence length 5 must be a multiple of 2"):
        get_layout("zigzag").check_local_len(5)
    get_layout("striped").check_seq_len(12, 3)


def test_single_process_shard_positions_unshard():
    x = torch.randn(2, 3, 10, 4)
    for name in LAYOUTS:
        assert torch.equal(ringattn.shard(x, 2, layout=name), x)
        assert torch.equal(ringattn.unshard(x, -2, layout=name), x)
        assert ringattn.positions(10, layout=name).tolist() == list(range(10))
