"""View ops alias their base as on one device.

For every op of the view family, shape (size-1, uneven and even sharded dims) and placement on
meshes (4,) and (2, 2): when one device's result shares storage with its input,

- and the DTensor view moved no data, each rank's local result shares its local base's storage
  and a write through the view shows in the base (differential against one device);
- and the view had to gather (a copy), a write through it is written back into the base, and a
  write into the base refreshes the copy (differential against one device).

Results that are copies on one device too (``repeat``, ``tile``) never write back; writes into
overlapping views (``expand``) raise as on one device.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from opcheck import run_recorded  # noqa: E402

from shardtensor import DTensor, comm, Partial, Replicate, Shard, distribute_tensor, implicit_replication  # noqa: E402

VIEWS = {
    "view_unit_lead": ((1, 2, 2, 2), lambda t: t.view(1, 2, 4)),
    "view_unit_mid": ((3, 1, 4), lambda t: t.view(3, 1, 2, 2)),
    "view_uneven": ((5, 2, 2), lambda t: t.view(5, 4)),
    "view_merge": ((8, 3), lambda t: t.view(24)),
    "view_split": ((8, 6), lambda t: t.view(4, 2, 6)),
    "reshape": ((7, 4), lambda t: t.reshape(7, 2, 2)),
    "flatten": ((3, 2, 5), lambda t: t.flatten(1)),
    "unflatten": ((6, 7), lambda t: t.unflatten(1, (7, 1))),
    "squeeze_unit": ((1, 6), lambda t: t.squeeze(0)),
    "squeeze_other": ((5, 1), lambda t: t.squeeze(1)),
    "unsqueeze": ((5, 3), lambda t: t.unsqueeze(1)),
    "expand": ((5, 1), lambda t: t.expand(5, 3)),
    "expand_new": ((1, 3), lambda t: t.expand(4, 1, 3)),
    "movedim": ((3, 5, 2), lambda t: t.movedim(0, -1)),
    "transpose": ((7, 3), lambda t: t.t()),
    "select_other": ((7, 3), lambda t: t[:, 1]),
    "select_sharded": ((7, 3), lambda t: t[2]),
    "slice_rows": ((8, 3), lambda t: t[1:5]),
    "narrow_cols": ((5, 6), lambda t: t.narrow(1, 1, 3)),
    "split": ((7, 4), lambda t: t.split(2, dim=1)[1]),
    "unbind": ((3, 4), lambda t: t.unbind(0)[1]),
    "diagonal": ((4, 4), lambda t: t.diagonal()),
    "as_strided_identity": ((4, 3), lambda t: t.as_strided((4, 3), (3, 1))),
    "detach": ((6, 2), lambda t: t.detach()),
    "repeat": ((3, 4), lambda t: t.repeat(2, 1)),
    "tile": ((3, 4), lambda t: t.tile((1, 2))),
}


def _placements(ndim: int, mesh_shape: tuple[int, ...]) -> list[tuple]:
    opts = [Replicate()] + [Shard(d) for d in range(ndim)]
    return list(itertools.product(opts, repeat=len(mesh_shape)))


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _case(mesh, shape, fn, pl, refresh):
    dense = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    x = distribute_tensor(dense.clone(), mesh, list(pl))
    with comm.scope("view"):
        v = fn(x)
    local_alias = v._local_tensor.numel() == 0 or _aliases(v._local_tensor, x._local_tensor)
    try:
        v.add_(1)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    seen = None
    if refresh:
        x.mul_(2)  # a write into the base shows in the view (a copy is refreshed)
        seen = v.full_tensor().clone()  # (a replicated whole may be the local tensor itself)
        x.div_(2)
    return local_alias, raised, x.full_tensor(), v._local_tensor.numel() == 0, seen


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_aliases_or_raises(name, mesh_shape):
    shape, fn = VIEWS[name]
    t = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    v = fn(t)
    dense_alias = _aliases(v, t)
    if dense_alias and name in ("repeat", "tile"):
        pytest.fail("torch's repeat/tile are expected to copy")
    original = t.clone()
    try:
        dv = fn(t)
        dv.add_(1)
        dense_raised = False
        t.mul_(2)
        dense_seen = dv.clone()
        t.div_(2)
    except RuntimeError:  # torch refuses writes into overlapping views (expand)
        dense_raised = True
    for pl in _placements(len(shape), mesh_shape):
        out, events = run_recorded(mesh_shape, _case, shape, fn, pl, not dense_raised)
        moved = any("view" in e.scope for e in events)
        for local_alias, raised, full, empty, seen in out:
            what = f"{name} {pl}"
            if dense_raised:
                assert (raised is not None or empty) and (local_alias or moved), what
                assert torch.equal(full, original), f"{what}: base changed"
            elif not dense_alias:
                assert raised is None, what
                assert torch.equal(full, torch.arange(float(t.numel())).reshape(shape)), f"{what}: a copy wrote back"
            else:
                if not moved:
                    assert local_alias, f"{what}: no data moved, yet the local result is not a view of the local base"
                assert raised is None, f"{what}: {raised}"
                assert torch.equal(full, t), f"{what}: the write did not reach the base"
                assert torch.equal(seen, dense_seen), f"{what}: a write into the base did not reach the view"


def test_size_one_sharded_dim_view_is_local():
    """The issue's case: 1 row on 4 ranks (only rank 0 holds data) views with no communication."""
    def body(mesh):
        x = distribute_tensor(torch.zeros(1, 2, 2, 2), mesh, [Shard(0)])
        with comm.scope("view"):
            v = x.view(1, 2, 4)
            v.add_(1)
        return v.placements, x.full_tensor().sum().item(), tuple(v._local_tensor.shape)

    out, events = run_recorded((4,), body)
    assert not [e for e in events if "view" in e.scope]
    assert out[0] == ((Shard(0),), 8.0, (1, 2, 4))
    assert out[1] == ((Shard(0),), 8.0, (0, 2, 4))


def test_uneven_sharded_dim_view_is_local():
    def body(mesh):
        x = distribute_tensor(torch.zeros(5, 2, 2), mesh, [Shard(0)])
        with comm.scope("view"):
            v = x.view(5, 4)
            v[:, 0].fill_(2.0)
        return v.placements, x.full_tensor().sum().item()

    out, events = run_recorded((4,), body)
    assert not [e for e in events if "view" in e.scope]
    assert all(o == ((Shard(0),), 10.0) for o in out)


def test_setitem_on_a_sharded_row_writes_the_base():
    """``x[1] = 5`` on a row-sharded ``x``: the selected row is a copy; the write goes back into x."""
    def body(mesh):
        x = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
        x[1] = 5.0
        x[2:4, 1] = 3.0
        return x.placements, x.full_tensor()

    want = torch.zeros(8, 4)
    want[1] = 5.0
    want[2:4, 1] = 3.0
    for pl, full in run_recorded((4,), body)[0]:
        assert pl == (Shard(0),) and torch.equal(full, want)


def test_copies_of_copies_and_siblings_stay_in_step():
    """A view of a gathered view, a sibling copy and a true view of the base: any write shows in all."""
    def body(mesh):
        x = distribute_tensor(torch.zeros(1, 6), mesh, [Shard(0), Replicate()][:mesh.ndim])
        s = x.squeeze(0)             # a copy (the sharded unit dim goes)
        s[1:3].detach().mul_(2)      # a view of the copy: writes through to x
        s[1:3].add_(1)
        torch._foreach_add_([s], 1.0)
        d = x.squeeze(0)             # a sibling copy
        x[0, 5] = 7.0                # a write into the base refreshes s and d
        t = x.view(6)                # a view that is a copy
        t[0] = -1.0                  # ... written back, and s and d refreshed
        return x.full_tensor(), s.full_tensor(), d.full_tensor()

    want = torch.tensor([[-1.0, 2.0, 2.0, 1.0, 1.0, 7.0]])
    for mesh_shape in ((4,), (2, 2)):
        for x, s, d in run_recorded(mesh_shape, body)[0]:
            assert torch.equal(x, want) and torch.equal(s, want[0]) and torch.equal(d, want[0]), (mesh_shape, x, s, d)


def test_backward_writes_into_gathered_views_reach_their_base():
    """Backward formulas write into views of their temporaries (householder_product's
    ``K.diagonal().fill_(1)`` on a row-sharded or Partial ``K``): the write must reach K."""
    from opcheck import check

    g = torch.Generator().manual_seed(0)
    a, tau = torch.randn(5, 3, generator=g), torch.randn(3, generator=g) * 0.5
    for mesh in ((4,), (2, 2)):
        check(torch.linalg.householder_product, [a, tau], mesh, limit=None,
              combos=[((Shard(0),) * len(mesh), (Replicate(),) * len(mesh)),
                      ((Shard(1),) * len(mesh), (Replicate(),) * len(mesh)),
                      ((Partial(),) * len(mesh), (Replicate(),) * len(mesh))], tol=dict(rtol=1e-4, atol=1e-4))


def test_backward_through_gathering_views_accumulates_gradients():
    """Autograd's own views of gradients carry no note: accumulation in place keeps working."""
    def body(mesh):
        w = distribute_tensor(torch.ones(5, 4), mesh, [Shard(0)]).requires_grad_()
        for _ in range(2):
            (w.view(20) * 2).sum().backward()
            (w.squeeze(1) if w.shape[1] == 1 else w[1]).sum().backward()
        return w.grad.full_tensor()

    want = torch.full((5, 4), 4.0)
    want[1] += 2
    for g in run_recorded((4,), body)[0]:
        assert torch.equal(g, want)


def test_partial_view_stays_partial_and_aliases():
    def body(mesh):
        part = DTensor.from_local(torch.ones(1, 4), mesh, [Partial()])
        v = part.view(4)
        v.mul_(2)
        return v.placements, part.full_tensor().sum().item()

    for pl, total in run_recorded((4,), body)[0]:
        assert pl == (Partial(),) and total == 32.0


def test_inplace_that_changes_placements_keeps_a_tensor_with_views():
    """x.add_(1) on Partial(sum) reduces x; with views sharing its memory the result goes back
    into that memory as Partial terms, so base and views agree, as on one device."""
    def body(mesh):
        x = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()])
        v = x.view(6)
        x.add_(1)
        v.add_(1)
        v.mul_(2)  # stays Partial(sum): no new memory, the view and its base agree
        lone = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()])
        lone.add_(1)  # no views: reduced in place, as before
        return (x.placements, v.placements, x.full_tensor().sum().item(), v.full_tensor().sum().item(),
                lone.full_tensor().sum().item())

    assert run_recorded((4,), body)[0] == [((Partial(),), (Partial(),), 72.0, 72.0, 30.0)] * 4


def test_results_of_decomposed_ops_are_their_own_memory():
    """repeat decomposes into views of its own temporaries: its Partial result may change placement."""
    def body(mesh):
        p = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()])
        r = p.repeat(2, 1)
        r.add_(1)
        return r.full_tensor().sum().item()

    assert run_recorded((4,), body)[0] == [60.0] * 4


def test_inplace_op_keeps_self_placements_and_memory():
    """index_copy_ on a row-sharded self: its rule gathers the indexed dim, and the result goes
    back into self's own shards, so self keeps S(0) and a view of it sees the write."""
    x0 = torch.arange(35.0).reshape(7, 5)
    idx, src = torch.tensor([1, 5]), -torch.ones(2, 5)
    expected = x0.clone().index_copy_(0, idx, src)

    def body(mesh):
        x = distribute_tensor(x0, mesh, [Shard(0)])
        before = x._local_tensor
        col = x[:, 1]
        with implicit_replication():
            x.index_copy_(0, idx, src)
        return x.placements, x._local_tensor is before, x.full_tensor(), col.full_tensor()

    for pls, kept, full, col in run_recorded((4,), body)[0]:
        assert pls == (Shard(0),) and kept
        assert torch.equal(full, expected) and torch.equal(col, expected[:, 1])


def _stale_write_cases() -> dict:
    """Each case: ``(setup, write)``. ``setup(x, y, w)`` returns a loss that saved tensors for
    backward; ``write(x, y, w)`` then writes one of them in place."""
    def saved_x(x, y, w):
        return (w * x).sum()

    def step(cls, **kw):
        def write(x, y, w):
            w.grad = torch.ones_like(w)
            cls([w], lr=0.1, **kw).step()
        return write

    def index_copy(x, y, w):
        with implicit_replication():
            x.index_copy_(0, torch.tensor([1, 5]), -torch.ones(2, 5))

    return {
        "mul_": (saved_x, lambda x, y, w: x.mul_(3)),
        "foreach_mul_": (saved_x, lambda x, y, w: torch._foreach_mul_([x], 3.0)),
        "foreach_add_list": (saved_x, lambda x, y, w: torch._foreach_add_([y, x], [x, y])),
        "foreach_lerp_": (saved_x, lambda x, y, w: torch._foreach_lerp_([x], [y], 0.5)),
        "add_out": (saved_x, lambda x, y, w: torch.add(y, y, out=x)),
        "copy_": (saved_x, lambda x, y, w: x.copy_(y)),
        "index_copy_gathers": (saved_x, index_copy),
        "local_saved_then_mul_": (lambda x, y, w: (_local(w) * _local(x)).sum(), lambda x, y, w: x.mul_(3)),
        "adamw_fused": (lambda x, y, w: (w * w).sum(), step(torch.optim.AdamW, fused=True)),
        "adamw_foreach": (lambda x, y, w: (w * w).sum(), step(torch.optim.AdamW, foreach=True)),
        "sgd_single": (lambda x, y, w: (w * w).sum(), step(torch.optim.SGD, foreach=False, momentum=0.9)),
        "sgd_fused": (lambda x, y, w: (w * w).sum(), step(torch.optim.SGD, fused=True, momentum=0.9)),
    }


_STALE = _stale_write_cases()
_TORCH_MISSES = {"adamw_fused", "sgd_fused"}
"""Cases one device does not catch: torch's fused CPU steps leave the version counters alone, so
a plain tensor gives stale gradients there; a DTensor raises, as the other implementations do."""


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _stale_outcome(x, y, w, case: str) -> str:
    setup, write = _STALE[case]
    loss = setup(x, y, w)
    write(x, y, w)
    try:
        loss.backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e), e
        return "raised"
    return "ran"


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("case", sorted(_STALE))
def test_a_write_into_a_tensor_saved_for_backward_raises_as_on_one_device(case, mesh_shape):
    """Autograd sees every write: a tensor saved for backward and written afterwards (in place,
    by a foreach op, by ``out=``, by a fused optimizer step, through the local tensor) makes
    backward raise, as on one device, instead of computing gradients from the new values."""
    x0, y0, w0 = torch.arange(35.0).reshape(7, 5), torch.ones(7, 5), torch.full((7, 5), 2.0)
    dense = _stale_outcome(x0.clone(), y0.clone(), w0.clone().requires_grad_(), case)
    assert dense == "raised" or case in _TORCH_MISSES

    def body(mesh):
        pls = [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)
        x, y = distribute_tensor(x0, mesh, pls), distribute_tensor(y0, mesh, pls)
        w = distribute_tensor(w0, mesh, pls).requires_grad_()
        return _stale_outcome(x, y, w, case)

    assert run_recorded(mesh_shape, body)[0] == ["raised"] * 4


def test_writes_bump_the_local_tensors_version_once_seen():
    """The wrapper's and the local tensor's version counters both move on every kind of write;
    ops that write nothing move neither."""
    def body(mesh):
        x = distribute_tensor(torch.ones(8, 3), mesh, [Shard(0)])
        seen = []
        for write in (lambda: x.mul_(2), lambda: torch._foreach_add_([x], 1.0), lambda: x.add(1),
                      lambda: torch.mul(x, 2, out=x)):
            before = (x._version, x.to_local()._version)
            write()
            seen.append((x._version > before[0], x.to_local()._version > before[1]))
        return seen

    for seen in run_recorded((4,), body)[0]:
        assert seen == [(True, True), (True, True), (False, False), (True, True)]


def test_a_copy_taken_every_step_does_not_grow_its_family():
    """A gathering view of a parameter taken every step: the family keeps only live copies."""
    def body(mesh):
        x = distribute_tensor(torch.zeros(5, 4), mesh, [Shard(0)])
        for _ in range(50):
            v = x.view(20)  # a copy: the sharded rows are split across ranks
            v[0] = 1.0
        return len(x._copies), x.full_tensor()[0, 0].item()

    for n, first in run_recorded((4,), body)[0]:
        assert n <= 8 and first == 1.0


def test_resize_of_a_sharded_tensor_with_views_is_refused_before_anything_changes():
    """resize_ gathers a sharded self into new memory; a view of the old memory would keep the old
    placements, so it raises first (dispatch's check, from the decomposition's declared fact) and
    the tensor and its view are as they were.  Without views, or replicated, it resizes."""
    def body(mesh):
        a = torch.arange(24.0).reshape(8, 3)
        x = distribute_tensor(a, mesh, [Shard(0)])
        v = x.view(24)
        with pytest.raises(RuntimeError, match="shares storage with views"):
            x.resize_(4, 3)
        kept = (x.placements, tuple(x.shape), torch.equal(x.full_tensor(), a), torch.equal(v.full_tensor(), a.view(24)))
        r = distribute_tensor(a, mesh, [Replicate()])
        rv = r.view(24)
        r.resize_(4, 3)
        lone = distribute_tensor(a, mesh, [Shard(0)]).resize_(4, 3)
        return kept, torch.equal(r.full_tensor(), a[:4]), rv.shape, torch.equal(lone.full_tensor(), a[:4])

    out = run_recorded((4,), body)[0]
    assert out == [(((Shard(0),), (8, 3), True, True), True, torch.Size([24]), True)] * 4


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_views_of_packed_and_fallback_results_are_copies(mesh_shape):
    """A view of a StridedShard tensor, and a view op run on replicated inputs (``unfold``'s
    ``as_strided`` of a sharded tensor), return copies of the gathered input: a write through
    them reaches the base, as on one device."""
    from shardtensor import StridedShard

    def body(mesh):
        a = torch.arange(48.0).reshape(8, 6)
        pl = [StridedShard(1, 2)] if mesh.ndim == 1 else [Shard(0), StridedShard(1, 2)]
        x = distribute_tensor(a, mesh, pl)
        x[2].fill_(-1.0)
        x.diagonal().mul_(10)
        want = a.clone()
        want[2] = -1.0
        want.diagonal().mul_(10)
        y = distribute_tensor(a, mesh, [Shard(1)] * mesh.ndim)
        y.unfold(0, 2, 3).fill_(0.0)
        dense = a.clone()
        dense.unfold(0, 2, 3).fill_(0.0)
        return torch.equal(x.full_tensor(), want), x.placements == tuple(pl), torch.equal(y.full_tensor(), dense)

    assert run_recorded(mesh_shape, body)[0] == [(True, True, True)] * 4
