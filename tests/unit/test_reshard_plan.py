"""The arithmetic of moving FSDP shards between memberships (trainer/reshard.py):
the rows a rank holds, the moves that cover every row of a new membership
exactly once from the rank that held it, and a leader's plan checked before
anything moves."""

import json

import pytest
import torch

from reflow.trainer.reshard import ReshardPlan, chunk_rows, moved_bytes, plan_moves


@pytest.mark.parametrize("length,world", [(10, 3), (7, 4), (2, 3), (1, 1), (64, 2), (5, 8)])
def test_chunk_rows_is_torch_chunks_cut(length, world):
    pieces = torch.arange(length).chunk(world)
    for rank in range(world):
        start, stop = chunk_rows(length, world, rank)
        expect = pieces[rank].tolist() if rank < len(pieces) else []
        assert list(range(start, stop)) == expect


@pytest.mark.parametrize("old,new", [
    ([0, 1, -1], [0, 1, 2]),      # a joiner
    ([0, 1, 2], [0, -1, 1]),      # a leaver
    ([0, 2, 1, -1], [0, -1, 2, 1]),  # ranks permuted, one out, one in
    ([0, 1], [0, 1]),             # no change: every row stays where it is
])
def test_moves_cover_every_new_row_once_from_its_old_owner(old, new):
    lengths = [10, 7, 1, 33]
    moves = plan_moves(lengths, old, new)
    old_world, new_world = sum(r >= 0 for r in old), sum(r >= 0 for r in new)
    for t, length in enumerate(lengths):
        filled = {}
        for m in (m for m in moves if m.tensor == t):
            o0, _ = chunk_rows(length, old_world, old[m.src])
            n0, _ = chunk_rows(length, new_world, new[m.dst])
            src_rows = range(o0 + m.src_rows[0], o0 + m.src_rows[1])
            dst_rows = range(n0 + m.dst_rows[0], n0 + m.dst_rows[1])
            assert list(src_rows) == list(dst_rows)  # a row keeps its place in the tensor
            for row in dst_rows:
                assert row not in filled, (t, row)
                filled[row] = m.dst
        for dst, rank in enumerate(new):
            if rank >= 0:
                start, stop = chunk_rows(length, new_world, rank)
                assert all(filled.get(row) == dst for row in range(start, stop))
        assert sorted(filled) == list(range(length))


def test_an_unchanged_membership_moves_nothing_between_processes():
    plan = ReshardPlan(epoch=2, port=1234, old_ranks=[0, 1], new_ranks=[0, 1], steps=[],
                       layout="x")
    assert moved_bytes(plan, [torch.Size([10, 4])], 4) == {}


def test_a_joiner_of_three_receives_a_third():
    plan = ReshardPlan(epoch=2, port=1234, old_ranks=[0, 1, -1], new_ranks=[0, 1, 2],
                       steps=[0.0], layout="x")
    received = moved_bytes(plan, [torch.Size([300, 8])], 4)
    whole = 300 * 8 * 4 * 3  # the parameter and its two moments
    assert received[2] == whole // 3
    assert 0 not in received  # rank 0 keeps rows [0, 100) of its [0, 150)


def _plan(**change):
    data = dict(epoch=3, port=4000, old_ranks=[0, 1, -1], new_ranks=[0, 1, 2], steps=[1.0],
                layout="abc", initial=False, rendezvous_key="9e" * 16, old_shards=0,
                new_shards=0)
    data.update(change)
    return json.dumps(data).encode()


def test_a_well_formed_plan_decodes():
    plan = ReshardPlan.decode(_plan())
    assert (plan.old_world, plan.new_world) == (2, 3)
    assert plan.rendezvous_key == "9e" * 16 and plan.rendezvous_key not in repr(plan)


@pytest.mark.parametrize("raw,match", [
    (b"", "bytes"),
    (b"\xff{not json", "not JSON"),
    (b"[0, 1]", "unexpected fields"),
    (b"x" * (2 << 20), "bytes"),
    (json.dumps({"epoch": 1}).encode(), "unexpected fields"),
    (_plan(extra=1)[:-1] + b"}", "fields"),
    (_plan(old_ranks=[0, 0, -1]), "not a permutation"),
    (_plan(new_ranks=[0, 2, 3]), "not a permutation"),
    (_plan(new_ranks=[0, True, 2]), "list of integers"),
    (_plan(new_ranks="012"), "list of integers"),
    (_plan(new_ranks=[0, 1]), "differ in length"),
    (_plan(new_ranks=[1, 0, 2]), "leader"),
    (_plan(old_ranks=[-1, -1, -1]), "leader"),
    (_plan(port=0), "port"),
    (_plan(port="80"), "port"),
    (_plan(steps=[-1.0]), "steps"),
    (_plan(steps="1"), "steps"),
    (_plan(layout=7), "layout"),
    (_plan(rendezvous_key=""), "rendezvous_key"),
    (_plan(rendezvous_key="9E" * 16), "rendezvous_key"),
    (_plan(rendezvous_key=["9e" * 16]), "rendezvous_key"),
    (_plan(old_ranks=[-1, -1, -1], initial=True, new_ranks=[0, 1, 2]), None),
])
def test_a_hostile_plan_is_refused_naming_what_is_wrong(raw, match):
    if match is None:  # the first membership: no old ranks, and that is fine
        assert ReshardPlan.decode(raw).initial
        return
    with pytest.raises(ValueError, match=match):
        ReshardPlan.decode(raw)


def test_a_replica_lost_from_an_hsdp_group_leaves_every_shard_where_it_is():
    """2 replicas x 2 shards; the survivors of a lost replica keep their old ranks
    (holding shard rank % 2) and form 1 x 2: every chunk is copied in place, none
    moves between processes. A survivor of each replica works as well; a shard
    whose every holder was lost cannot be planned."""
    lengths = [10, 7]
    for survivors in ([0, 1], [0, 3], [2, 1]):
        moves = plan_moves(lengths, survivors, [0, 1], old_shards=2, new_shards=2)
        assert moves and all(m.src == m.dst for m in moves), (survivors, moves)
        assert {(m.tensor, m.dst) for m in moves} == {(t, d) for t in (0, 1) for d in (0, 1)}
    with pytest.raises(ValueError, match="shard 1 of 2 is held by no member"):
        plan_moves(lengths, [0, 2], [0, 1], old_shards=2, new_shards=2)
    # A new replica's ranks receive their shard from a holder (the first in union
    # order), one shard each: 1 x 2 -> 2 x 2.
    grow = plan_moves([10], [0, 1, -1, -1], [0, 1, 2, 3], old_shards=2, new_shards=2)
    assert sorted((m.src, m.dst, m.src_rows) for m in grow) == [
        (0, 0, (0, 5)), (0, 2, (0, 5)), (1, 1, (0, 5)), (1, 3, (0, 5))]
    plan = ReshardPlan.decode(_plan(old_ranks=[0, 3], new_ranks=[0, 1], old_shards=2,
                                    new_shards=2))
    assert plan.old_world == 2
    with pytest.raises(ValueError, match="not whole replicas"):
        ReshardPlan.decode(_plan(new_shards=2))
    with pytest.raises(ValueError, match="permutation"):
        ReshardPlan.decode(_plan(old_ranks=[0, 3, -1]))  # only an hsdp survivor keeps a gap
