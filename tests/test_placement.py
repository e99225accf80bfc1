"""Placements and the local shape / offset arithmetic.

The oracle is independent of ``shardtensor.placement``: it applies ``torch.chunk`` to real
tensors (a ``torch.arange`` of the global shape and one index vector per tensor dim) in the
execution order of docs/placements.md, and compares element sets with the (shape, offset)
the library reports.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtensor import DeviceMesh, DTensorSpec
from shardtensor.comm.simulated import SimTransport, SimWorld
from shardtensor.placement import (REDUCE_OPS, Partial, Placement, Replicate, Shard, chunk, chunk_sizes,
                                   default_shard_order, display, execution_order, local_shape_and_offset,
                                   normalize_placements, validate_shard_order)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------
# Independent oracle
# ---------------------------------------------------------------------------------------

def _take_chunk(t: torch.Tensor, k: int, r: int, dim: int) -> torch.Tensor:
    """Piece ``r`` of ``torch.chunk(t, k, dim)``; a missing piece is empty."""
    pieces = torch.chunk(t, k, dim=dim)
    if r < len(pieces):
        return pieces[r]
    return t.narrow(dim, t.shape[dim], 0)


def _oracle_exec_lists(placements, order):
    """{tensor dim: [mesh dims, first applied first]} straight from the definition."""
    if order is None:  # default order: mesh dims ascending within each tensor dim
        lists: dict[int, list[int]] = {}
        for j, p in enumerate(placements):
            if isinstance(p, Shard):
                lists.setdefault(p.dim, []).append(j)
        return lists
    return {d: list(js) for d, js in order}


def oracle_piece(global_shape, mesh_shape, coord, placements, order):
    """The rank's local piece of ``arange(numel).reshape(global_shape)``, by repeated torch.chunk.

    Tensor dims are processed from the last one to the first (the definition says they are
    independent, the library walks them first to last), each in its shard order.
    """
    t = torch.arange(math.prod(global_shape), dtype=torch.int64).reshape(tuple(global_shape))
    lists = _oracle_exec_lists(placements, order)
    for d in sorted(lists, reverse=True):
        for j in lists[d]:
            t = _take_chunk(t, mesh_shape[j], coord[j], d)
    return t


def oracle_index_sets(global_shape, mesh_shape, coord, placements, order):
    """Per tensor dim, the global indices the rank holds (chunking ``arange(L)``)."""
    lists = _oracle_exec_lists(placements, order)
    out = []
    for d, length in enumerate(global_shape):
        idx = torch.arange(length)
        for j in lists.get(d, []):
            idx = _take_chunk(idx, mesh_shape[j], coord[j], 0)
        out.append(idx.tolist())
    return out


def all_coords(mesh_shape):
    return list(itertools.product(*(range(k) for k in mesh_shape)))


def check_against_oracle(global_shape, mesh_shape, placements, order, lib_order):
    """Compare every coordinate's (shape, offset) with the oracle and check the tiling."""
    full = torch.arange(math.prod(global_shape), dtype=torch.int64).reshape(tuple(global_shape))
    lists = _oracle_exec_lists(placements, order)
    results = {}
    for coord in all_coords(mesh_shape):
        shape, offset = local_shape_and_offset(global_shape, mesh_shape, coord, placements, lib_order)
        shape, offset = tuple(shape), tuple(offset)
        results[coord] = (shape, offset)
        assert len(shape) == len(global_shape) and len(offset) == len(global_shape)
        # per-dim index sets from the oracle
        sets = oracle_index_sets(global_shape, mesh_shape, coord, placements, order)
        for d, idx in enumerate(sets):
            assert shape[d] == len(idx), (coord, d, shape, idx)
            if idx:
                assert idx == list(range(idx[0], idx[0] + len(idx)))  # contiguous
                assert offset[d] == idx[0], (coord, d, offset, idx)
            else:  # empty piece reports the global length
                assert offset[d] == global_shape[d], (coord, d, offset)
        # the whole local piece is exactly the slice named by (shape, offset)
        piece = oracle_piece(global_shape, mesh_shape, coord, placements, order)
        assert tuple(piece.shape) == shape
        sl = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        assert torch.equal(full[sl], piece), (coord, shape, offset)

    # tiling: each element of each tensor dim is held by exactly (#ranks / #pieces of that dim) ranks
    n_ranks = math.prod(mesh_shape)
    for d, length in enumerate(global_shape):
        js = lists.get(d, [])
        mult = n_ranks // math.prod(mesh_shape[j] for j in js)
        cover = Counter()
        for shape, offset in results.values():
            assert 0 <= offset[d] <= length
            assert offset[d] + shape[d] <= length
            cover.update(range(offset[d], offset[d] + shape[d]))
        assert set(cover) == set(range(length)), (d, cover)
        assert all(c == mult for c in cover.values()), (d, cover, mult)
        # order: for every fixed value of the other mesh dims, the pieces read in shard order
        # (first-applied mesh dim = most significant digit) concatenate to [0, L)
        others = [j for j in range(len(mesh_shape)) if j not in js]
        for other_vals in itertools.product(*(range(mesh_shape[j]) for j in others)):
            seq = []
            for digits in itertools.product(*(range(mesh_shape[j]) for j in js)):
                coord = [0] * len(mesh_shape)
                for j, v in zip(others, other_vals):
                    coord[j] = v
                for j, v in zip(js, digits):
                    coord[j] = v
                shape, offset = results[tuple(coord)]
                seq.extend(range(offset[d], offset[d] + shape[d]))
            assert seq == list(range(length)), (d, js, seq)
    return results


# ---------------------------------------------------------------------------------------
# Hypothesis strategies
# ---------------------------------------------------------------------------------------

@st.composite
def layouts(draw, mesh_ndims=(1, 2, 3), tensor_ndims=(1, 2, 3), nested=False, random_order=True):
    """(global_shape, mesh_shape, placements, order-for-oracle, order-for-library)."""
    m = draw(st.sampled_from(mesh_ndims))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 5), min_size=m, max_size=m)))
    n = draw(st.sampled_from(tensor_ndims))
    # keep the tensor small when it has several dims
    max_len = 17 if n == 1 else (12 if n == 2 else 6)
    global_shape = tuple(draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n)))
    if nested:  # every mesh dim shards the same tensor dim
        d = draw(st.integers(0, n - 1))
        placements = tuple(Shard(d) for _ in range(m))
    else:
        placement = st.one_of(
            st.builds(Shard, st.integers(0, n - 1)),
            st.just(Replicate()),
            st.builds(Partial, st.sampled_from(REDUCE_OPS)),
        )
        placements = tuple(draw(st.lists(placement, min_size=m, max_size=m)))
    default = _oracle_exec_lists(placements, None)
    if random_order and draw(st.booleans()):
        order = tuple((d, tuple(draw(st.permutations(default[d])))) for d in sorted(default))
        lib_order = order
    else:
        order = None
        lib_order = draw(st.sampled_from([None, tuple((d, tuple(js)) for d, js in sorted(default.items()))]))
    return global_shape, mesh_shape, placements, order, lib_order


# ---------------------------------------------------------------------------------------
# 1. Property tests
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", range(1, 6))
@pytest.mark.parametrize("length", range(0, 18))
def test_chunk_matches_torch_chunk_exhaustive(length, k):
    t = torch.arange(length)
    sizes = chunk_sizes(length, k)
    assert len(sizes) == k
    assert sum(sizes) == length
    for r in range(k):
        piece = _take_chunk(t, k, r, 0)
        size, offset = chunk(length, k, r)
        assert size == len(piece) == sizes[r]
        expect_off = piece[0].item() if len(piece) else None
        if expect_off is not None:
            assert offset == expect_off
        # 1-D mesh through local_shape_and_offset
        shape, off = local_shape_and_offset((length,), (k,), (r,), (Shard(0),))
        assert shape == (len(piece),)
        assert off == ((expect_off,) if expect_off is not None else (length,))


@pytest.mark.parametrize("length", range(0, 18))
def test_nested_2d_exhaustive(length):
    for k0, k1 in itertools.product(range(1, 6), repeat=2):
        for order in (None, ((0, (0, 1)),), ((0, (1, 0)),)):
            check_against_oracle((length,), (k0, k1), (Shard(0), Shard(0)), order, order)


@SETTINGS
@given(layouts(mesh_ndims=(1,)))
def test_1d_mesh_tiles(layout):
    check_against_oracle(*layout)


@SETTINGS
@given(layouts(mesh_ndims=(2,)))
def test_2d_mesh_tiles(layout):
    check_against_oracle(*layout)


@SETTINGS
@given(layouts(mesh_ndims=(3,)))
def test_3d_mesh_tiles(layout):
    check_against_oracle(*layout)


@SETTINGS
@given(layouts(mesh_ndims=(2, 3), tensor_ndims=(1, 2), nested=True))
def test_nested_tiles_random_order(layout):
    check_against_oracle(*layout)


@SETTINGS
@given(layouts(mesh_ndims=(1, 2, 3), random_order=False))
def test_default_order_equals_explicit_default(layout):
    global_shape, mesh_shape, placements, _, _ = layout
    explicit = default_shard_order(placements)
    assert validate_shard_order(placements, explicit) == explicit
    for coord in all_coords(mesh_shape):
        assert local_shape_and_offset(global_shape, mesh_shape, coord, placements) == \
            local_shape_and_offset(global_shape, mesh_shape, coord, placements, explicit)


@SETTINGS
@given(layouts(mesh_ndims=(1, 2, 3)))
def test_random_orders_are_valid(layout):
    _, _, placements, order, lib_order = layout
    if lib_order is not None:
        assert validate_shard_order(placements, lib_order) == lib_order
    lists = _oracle_exec_lists(placements, order)
    got = execution_order(placements, lib_order)
    # only the order within each tensor dim matters
    for d, js in lists.items():
        assert [j for j in got if placements[j] == Shard(d)] == js
    assert sorted(got) == sorted(j for js in lists.values() for j in js)


# ---------------------------------------------------------------------------------------
# 2. Worked tables
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("length, sizes, offsets", [
    (8, (2, 2, 2, 2), (0, 2, 4, 6)),
    (7, (2, 2, 2, 1), (0, 2, 4, 6)),
    (6, (2, 2, 2, 0), (0, 2, 4, 6)),
    (5, (2, 2, 1, 0), (0, 2, 4, 5)),
    (3, (1, 1, 1, 0), (0, 1, 2, 3)),
    (2, (1, 1, 0, 0), (0, 1, 2, 2)),
])
def test_chunk_table(length, sizes, offsets):
    assert tuple(chunk_sizes(length, 4)) == sizes
    assert tuple(chunk(length, 4, r) for r in range(4)) == tuple(zip(sizes, offsets))
    for r in range(4):
        assert local_shape_and_offset((length,), (4,), (r,), (Shard(0),)) == ((sizes[r],), (offsets[r],))


def test_chunk_is_not_tensor_split():
    assert chunk_sizes(5, 4) == [2, 2, 1, 0]


def test_example_7x5_on_2x3():
    pl = (Shard(0), Shard(1))
    coords = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    shapes = [(4, 2), (4, 2), (4, 1), (3, 2), (3, 2), (3, 1)]
    offsets = [(0, 0), (0, 2), (0, 4), (4, 0), (4, 2), (4, 4)]
    for c, s, o in zip(coords, shapes, offsets):
        assert local_shape_and_offset((7, 5), (2, 3), c, pl) == (s, o)


_TABLE_13 = {
    # coordinate: (default rows, default offset, order (2,0,1) rows, offset)
    (0, 0, 0): (2, 0, 2, 0),
    (0, 0, 1): (2, 2, 2, 7),
    (0, 1, 0): (2, 4, 2, 2),
    (0, 1, 1): (1, 6, 1, 9),
    (1, 0, 0): (2, 7, 2, 4),
    (1, 0, 1): (1, 9, 2, 10),
    (1, 1, 0): (2, 10, 1, 6),
    (1, 1, 1): (1, 12, 1, 12),
}


@pytest.mark.parametrize("coord", sorted(_TABLE_13))
def test_table_13_rows_on_2x2x2(coord):
    pl = (Shard(0),) * 3
    rows, off, rows201, off201 = _TABLE_13[coord]
    assert local_shape_and_offset((13,), (2, 2, 2), coord, pl) == ((rows,), (off,))
    assert local_shape_and_offset((13,), (2, 2, 2), coord, pl, ((0, (0, 1, 2)),)) == ((rows,), (off,))
    assert local_shape_and_offset((13,), (2, 2, 2), coord, pl, ((0, (2, 0, 1)),)) == ((rows201,), (off201,))


def test_table_13_rows_matches_oracle():
    pl = (Shard(0),) * 3
    check_against_oracle((13,), (2, 2, 2), pl, None, None)
    check_against_oracle((13,), (2, 2, 2), pl, ((0, (2, 0, 1)),), ((0, (2, 0, 1)),))


def test_execution_order_of_2_0_1():
    # the reference bug applies the inverse order (1, 2, 0); the shard order means (2, 0, 1)
    assert execution_order((Shard(0),) * 3, ((0, (2, 0, 1)),)) == [2, 0, 1]


def test_three_d_order_does_not_split_along_replicate():
    # the reference bug may split along a mesh dim that is R
    pl = (Shard(0), Replicate(), Shard(0))
    order = ((0, (2, 0)),)
    for coord in all_coords((2, 3, 2)):
        shape, offset = local_shape_and_offset((13,), (2, 3, 2), coord, pl, order)
        # mesh dim 2 splits 13 -> 7 | 6, then mesh dim 0 splits that piece
        first = [(7, 0), (6, 7)][coord[2]]
        s, o = chunk(first[0], 2, coord[0])
        assert shape == (s,)
        assert offset == ((first[1] + o,) if s else (13,))


_TABLE_5 = {
    # order: {coordinate: (rows, offset)}
    None: {(0, 0): (2, 0), (0, 1): (1, 2), (1, 0): (1, 3), (1, 1): (1, 4)},
    ((0, (0, 1)),): {(0, 0): (2, 0), (0, 1): (1, 2), (1, 0): (1, 3), (1, 1): (1, 4)},
    ((0, (1, 0)),): {(0, 0): (2, 0), (0, 1): (1, 3), (1, 0): (1, 2), (1, 1): (1, 4)},
}


@pytest.mark.parametrize("order", list(_TABLE_5))
def test_five_rows_nested_on_2x2(order):
    pl = (Shard(0), Shard(0))
    for coord, (rows, off) in _TABLE_5[order].items():
        assert local_shape_and_offset((5,), (2, 2), coord, pl, order) == ((rows,), (off,)), coord


def test_nested_is_not_flat():
    flat = [local_shape_and_offset((5,), (4,), (r,), (Shard(0),))[0][0] for r in range(4)]
    assert flat == [2, 2, 1, 0]
    nested = [local_shape_and_offset((5,), (2, 2), c, (Shard(0), Shard(0)))[0][0] for c in all_coords((2, 2))]
    assert nested == [2, 1, 1, 1]


def test_two_rows_nested_is_1_0_1_0():
    pl = (Shard(0), Shard(0))
    got = [local_shape_and_offset((2,), (2, 2), c, pl) for c in all_coords((2, 2))]
    assert [s[0] for s, _ in got] == [1, 0, 1, 0]
    # empty pieces report the global length as their offset
    assert [o[0] for _, o in got] == [0, 2, 1, 2]


def test_rank_outside_mesh():
    assert local_shape_and_offset((7, 5), (2, 3), None, (Shard(0), Shard(1))) == ((0,), ())
    assert local_shape_and_offset((4,), (2,), None, (Replicate(),)) == ((0,), ())


def test_replicate_and_partial_change_nothing():
    for pl in [(Replicate(), Partial()), (Partial("max"), Replicate())]:
        for c in all_coords((2, 3)):
            assert local_shape_and_offset((7, 5), (2, 3), c, pl) == ((7, 5), (0, 0))


def test_empty_global_dim_reports_offset_zero_length():
    # L = 0: every piece is empty, offset = L = 0
    for c in all_coords((3, 2)):
        assert local_shape_and_offset((0, 4), (3, 2), c, (Shard(0), Shard(1))) == \
            ((0, (2, 2)[c[1]]), (0, (0, 2)[c[1]]))


# ---------------------------------------------------------------------------------------
# 3. Placement objects, validation and display
# ---------------------------------------------------------------------------------------

def test_placements_hashable_and_equal():
    assert Shard(0) == Shard(0) and hash(Shard(0)) == hash(Shard(0))
    assert Shard(0) != Shard(1)
    assert Replicate() == Replicate() and hash(Replicate()) == hash(Replicate())
    assert Partial() == Partial("sum") and hash(Partial()) == hash(Partial("sum"))
    assert Partial("sum") != Partial("avg")
    assert Shard(0) != Replicate() and Replicate() != Partial() and Shard(0) != Partial()
    s = {Shard(0), Shard(0), Shard(1), Replicate(), Replicate(), Partial(), Partial("sum"), Partial("max")}
    assert len(s) == 5
    d = {(Shard(0), Replicate()): 1}
    assert d[(Shard(0), Replicate())] == 1
    for p in (Shard(0), Replicate(), Partial()):
        assert isinstance(p, Placement)


def test_placements_immutable():
    with pytest.raises(Exception):
        Shard(0).dim = 1  # type: ignore[misc]
    with pytest.raises(Exception):
        Partial().reduce_op = "max"  # type: ignore[misc]


def test_placement_predicates():
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert not Shard(1).is_replicate() and not Shard(1).is_partial()
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial("max").is_partial() and Partial("max").is_partial("max") and not Partial("max").is_partial("sum")
    assert not Partial().is_shard() and not Partial().is_replicate()


def test_placement_repr_and_str():
    assert repr(Shard(2)) == "Shard(dim=2)"
    assert str(Shard(2)) == "S(2)"
    assert repr(Replicate()) == "Replicate()"
    assert str(Replicate()) == "R"
    assert "avg" in repr(Partial("avg")) and repr(Partial("avg")).startswith("Partial")
    assert str(Partial("avg")) == "P(avg)"
    assert str(Partial()) == "P(sum)"


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_partial_accepts_known_ops(op):
    assert Partial(op).reduce_op == op
    assert set(REDUCE_OPS) == {"sum", "avg", "max", "min", "product"}


@pytest.mark.parametrize("op", ["mean", "SUM", "mul", "", None, "band"])
def test_partial_rejects_unknown_ops(op):
    with pytest.raises(ValueError):
        Partial(op)


@pytest.mark.parametrize("dim", [0.0, 1.5, "0", None, True, False, [0]])
def test_shard_rejects_non_int(dim):
    with pytest.raises(TypeError):
        Shard(dim)


def test_shard_accepts_negative_int():
    assert Shard(-1).dim == -1


def test_normalize_wraps_negative_dims():
    got = normalize_placements([Shard(-1), Replicate(), Shard(-3), Partial()], 3, 4)
    assert got == (Shard(2), Replicate(), Shard(0), Partial())
    assert isinstance(got, tuple)
    assert normalize_placements((Shard(1),), 2, 1) == (Shard(1),)


@pytest.mark.parametrize("dim, ndim", [(2, 2), (5, 2), (-3, 2), (0, 0), (-1, 0)])
def test_normalize_rejects_out_of_range(dim, ndim):
    with pytest.raises(ValueError) as e:
        normalize_placements([Shard(dim)], ndim, 1)
    assert str(dim) in str(e.value)


@pytest.mark.parametrize("n, mesh_ndim", [(1, 2), (3, 2), (0, 1)])
def test_normalize_rejects_wrong_count(n, mesh_ndim):
    with pytest.raises(ValueError) as e:
        normalize_placements([Replicate()] * n, 2, mesh_ndim)
    assert str(n) in str(e.value) and str(mesh_ndim) in str(e.value)


@pytest.mark.parametrize("bad", [Shard(0), None, 0, [0], ["S(0)"], [Replicate(), "R"], [Shard], [None]])
def test_normalize_rejects_non_placements(bad):
    mesh_ndim = len(bad) if isinstance(bad, list) else 1
    with pytest.raises(TypeError):
        normalize_placements(bad, 2, mesh_ndim)


def test_default_shard_order():
    assert default_shard_order((Replicate(), Partial())) == ()
    assert default_shard_order((Shard(1), Shard(0), Shard(1))) == ((0, (1,)), (1, (0, 2)))
    assert default_shard_order((Shard(0), Shard(0), Shard(0))) == ((0, (0, 1, 2)),)


def test_validate_shard_order_accepts_valid():
    pl = (Shard(1), Shard(0), Shard(1))
    assert validate_shard_order(pl, ((0, (1,)), (1, (2, 0)))) == ((0, (1,)), (1, (2, 0)))
    assert validate_shard_order(pl, ((0, (1,)), (1, (0, 2)))) == ((0, (1,)), (1, (0, 2)))
    assert validate_shard_order((Replicate(),), ()) == ()
    # lists are accepted and canonicalised to tuples
    assert validate_shard_order(pl, [[0, [1]], [1, [2, 0]]]) == ((0, (1,)), (1, (2, 0)))


@pytest.mark.parametrize("placements, order", [
    ((Shard(0), Shard(0)), ((0, (0,)),)),                 # mesh dim 1 missing
    ((Shard(0), Shard(0)), ((0, (0, 0)),)),               # duplicate, 1 missing
    ((Shard(0), Shard(0)), ((0, (0, 1, 1)),)),            # duplicate
    ((Shard(0), Shard(0)), ((0, (0, 1, 2)),)),            # mesh dim out of range
    ((Shard(0), Shard(0)), ((0, (-1, 0)),)),              # negative mesh dim
    ((Shard(0), Replicate()), ((0, (0, 1)),)),            # R listed
    ((Shard(0), Partial()), ((0, (1,)),)),                # P listed, S missing
    ((Shard(0), Shard(1)), ((0, (0, 1)),)),               # S(1) listed under tensor dim 0
    ((Shard(0), Shard(1)), ((0, (1,)), (1, (0,)))),       # swapped
    ((Shard(0), Shard(1)), ((0, (0,)),)),                 # tensor dim 1 missing
    ((Shard(0),), ((0, (0,)), (1, ()))),                  # empty list
    ((Shard(0),), ((0, ()),)),                            # empty list
    ((Shard(0),), ()),                                    # sharding mesh dim not listed
    ((Replicate(),), ((0, (0,)),)),                       # nothing shards
    ((Shard(0), Shard(0)), ((0, (0,)), (0, (1,)))),       # two entries for tensor dim 0
    ((Shard(0), Shard(0)), ((0, (1,)), (0, (0,)))),       # two entries for tensor dim 0
])
def test_validate_shard_order_rejects_invalid(placements, order):
    with pytest.raises(ValueError):
        validate_shard_order(placements, order)


@pytest.mark.parametrize("order", [((0, (0.5, 1)),), ((0, (True, 0)),), ((0.0, (0, 1)),)])
def test_validate_shard_order_rejects_non_int_entries(order):
    # a float / bool is not a mesh dim; it must not be silently truncated into one
    with pytest.raises((ValueError, TypeError)):
        validate_shard_order((Shard(0), Shard(0)), order)


@pytest.mark.parametrize("order", [((0, 1),), (0, (0,)), ((0,),)])
def test_validate_shard_order_rejects_malformed(order):
    with pytest.raises((ValueError, TypeError)):
        validate_shard_order((Shard(0), Replicate()), order)


def test_validate_shard_order_unsorted_entries():
    # the form is sorted by tensor dim: either reject an unsorted one or return the sorted form
    pl = (Shard(1), Shard(0))
    try:
        got = validate_shard_order(pl, ((1, (0,)), (0, (1,))))
    except ValueError:
        return
    assert got == ((0, (1,)), (1, (0,)))


def test_execution_order():
    pl = (Shard(1), Replicate(), Shard(0), Shard(1), Partial())
    assert execution_order(pl, None) == [0, 2, 3]
    got = execution_order(pl, ((0, (2,)), (1, (3, 0))))
    assert [j for j in got if pl[j] == Shard(1)] == [3, 0]
    assert sorted(got) == [0, 2, 3]
    assert execution_order((Replicate(), Partial()), None) == []


def test_display():
    assert display((Shard(0), Replicate(), Partial())) == "(S(0), R, P(sum))"
    assert display((Shard(0), Shard(0))) == "(S(0)[0], S(0)[1])"
    assert display((Shard(0), Shard(0)), ((0, (0, 1)),)) == "(S(0)[0], S(0)[1])"
    assert display((Shard(0), Shard(0)), ((0, (1, 0)),)) == "(S(0)[1], S(0)[0])"
    assert display((Shard(0),) * 3, ((0, (2, 0, 1)),)) == "(S(0)[1], S(0)[2], S(0)[0])"
    assert display((Shard(1), Shard(0), Partial("max")), ((0, (1,)), (1, (0,)))) == "(S(1), S(0), P(max))"
    assert display((Shard(0), Replicate(), Shard(0)), ((0, (2, 0)),)) == "(S(0)[1], R, S(0)[0])"
    assert display((Replicate(),)) == "(R)"


# ---------------------------------------------------------------------------------------
# DTensorSpec.build
# ---------------------------------------------------------------------------------------

def _mesh(shape, ranks=None, world=None):
    n = math.prod(shape)
    ranks = torch.arange(n).reshape(shape) if ranks is None else ranks
    world = n if world is None else world
    return DeviceMesh("cpu", ranks, _transport=SimTransport(SimWorld(world), 0), _prepare=False)


def test_spec_build_default_order_and_normalisation():
    mesh = _mesh((2, 2, 2))
    spec = DTensorSpec.build(mesh, [Shard(-1), Replicate(), Shard(-1)], (13, 6), None, torch.float32)
    assert spec.placements == (Shard(1), Replicate(), Shard(1))
    assert spec.shard_order == ((1, (0, 2)),)
    assert spec.is_default_order
    assert spec.stride == (6, 1)
    assert tuple(spec.shape) == (13, 6)
    assert spec.ndim == 2


def test_spec_build_non_default_order():
    mesh = _mesh((2, 2, 2))
    pl = (Shard(0),) * 3
    spec = DTensorSpec.build(mesh, pl, (13,), None, torch.float32, ((0, (2, 0, 1)),))
    assert spec.shard_order == ((0, (2, 0, 1)),)
    assert not spec.is_default_order
    for coord, (_, _, rows, off) in _TABLE_13.items():
        assert spec.local_shape_and_offset(coord) == ((rows,), (off,))
    default = DTensorSpec.build(mesh, pl, (13,), None, torch.float32)
    explicit_default = DTensorSpec.build(mesh, pl, (13,), None, torch.float32, ((0, (0, 1, 2)),))
    assert default == explicit_default and hash(default) == hash(explicit_default)
    assert default != spec  # equality includes the order
    assert len({default, spec, explicit_default}) == 2
    assert "S(0)[1], S(0)[2], S(0)[0]" in repr(spec)
    # this process is rank 0 of the world: coordinate (0, 0, 0)
    assert spec.local_shape_and_offset() == ((2,), (0,))
    assert spec.local_shape == (2,)


@pytest.mark.parametrize("placements, order, exc", [
    ((Shard(0), Shard(0), Replicate()), ((0, (0,)),), ValueError),
    ((Shard(0), Shard(0), Replicate()), ((0, (0, 1, 2)),), ValueError),
    ((Shard(0), Shard(0)), None, ValueError),                 # 2 placements on a 3-D mesh
    ((Shard(2), Replicate(), Replicate()), None, ValueError),  # dim out of range
    ((Shard(0), Replicate(), "R"), None, TypeError),
])
def test_spec_build_rejects(placements, order, exc):
    with pytest.raises(exc):
        DTensorSpec.build(_mesh((2, 2, 2)), placements, (13, 6), None, torch.float32, order)


def test_spec_build_rejects_non_mesh():
    with pytest.raises(TypeError):
        DTensorSpec.build((2, 2), (Shard(0), Shard(1)), (4, 4), None, torch.float32)


def test_spec_rank_outside_mesh():
    mesh = _mesh((1,), ranks=torch.tensor([1]), world=2)  # this process is rank 0, not in the mesh
    spec = DTensorSpec.build(mesh, (Shard(0),), (7,), None, torch.float32)
    assert spec.local_shape_and_offset() == ((0,), ())


@SETTINGS
@given(layouts(mesh_ndims=(1, 2, 3), tensor_ndims=(1, 2)))
def test_spec_matches_function(layout):
    global_shape, mesh_shape, placements, order, lib_order = layout
    spec = DTensorSpec.build(_mesh(mesh_shape), placements, global_shape, None, torch.float32, lib_order)
    assert spec.shard_order == (lib_order if lib_order is not None else default_shard_order(placements))
    for coord in all_coords(mesh_shape):
        assert spec.local_shape_and_offset(coord) == \
            local_shape_and_offset(global_shape, mesh_shape, coord, placements, order)
