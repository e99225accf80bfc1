"""Ops models use: complex views (rotary embeddings), conj, F.pad, broadcast copy_, histc, multinomial.

Differential against one device (``opcheck.check``: meshes (4,) and (2, 2), uneven sizes,
Partial inputs, forward and backward), plus placement and communication assertions.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from opcheck import MESHES, check, data, gen, run_recorded  # noqa: E402

from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402


def _x(shape, tag="x"):
    return data("any", shape, gen((tag, shape)))


def _rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Llama's apply_rotary_emb: pairs of the last dim as complex numbers, times the frequencies."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2)


def _freqs(seq: int, half: int) -> torch.Tensor:
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), 1.0 / (10000 ** (torch.arange(half) / half)))
    return torch.polar(torch.ones_like(angles), angles)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_rotary_embedding_forward_backward(mesh):
    x = _x((3, 7, 8))  # batch, seq (uneven over 4), head dim
    freqs = _freqs(7, 4)
    check(lambda a, f: _rotary(a, f), [x, freqs], mesh, limit=14, tol={"rtol": 1e-5, "atol": 1e-5})


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("name", ["as_complex", "as_real", "conj"])
def test_complex_views(mesh, name):
    fns = {"as_complex": (lambda a: torch.view_as_complex(a), _x((5, 3, 2))),
           "as_real": (lambda a: torch.view_as_real(torch.view_as_complex(a) * 2), _x((5, 3, 2))),
           "conj": (lambda a: torch.view_as_real(torch.view_as_complex(a).conj().resolve_conj()), _x((7, 2)))}
    fn, x = fns[name]
    check(fn, [x], mesh, limit=12, partial=("sum", "max"))


def test_view_as_complex_keeps_shards_and_linear_partials():
    def body(mesh):
        x = distribute_tensor(_x((8, 4, 2)), mesh, [Shard(0)])
        p = DTensor.from_local(torch.ones(8, 4, 2), mesh, [Partial()])
        c, q = torch.view_as_complex(x), torch.view_as_complex(p)
        return c.placements, c.dtype, q.placements, torch.view_as_real(c).placements

    out, events = run_recorded((4,), body)
    assert out[0] == ((Shard(0),), torch.complex64, (Partial(),), (Shard(0),))


PADS = [(1, 2), (0, 0, 2, 1), (1, 1, 0, 3), (-1, 2)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("pad", PADS, ids=str)
@pytest.mark.parametrize("value", [0.0, 1.5])
def test_constant_pad(mesh, pad, value):
    check(lambda a: F.pad(a, pad, value=value), [_x((7, 5))], mesh, limit=12, partial=("sum", "max"))


def test_pad_on_an_unpadded_sharded_dim_is_local_and_zero_pad_keeps_partial_sum():
    def body(mesh):
        x = distribute_tensor(_x((8, 5)), mesh, [Shard(0)])
        p = DTensor.from_local(torch.ones(8, 5), mesh, [Partial()])
        from shardtensor import comm
        with comm.scope("pad"):
            a, b, c = F.pad(x, (1, 2)), F.pad(p, (1, 1)), F.pad(p, (1, 1), value=2.0)
        return a.placements, b.placements, c.placements, b.full_tensor()

    out, events = run_recorded((4,), body)
    a, b, c, full = out[0]
    assert a == (Shard(0),) and b == (Partial(),) and c == (Replicate(),)
    assert torch.equal(full, F.pad(torch.full((8, 5), 4.0), (1, 1)))
    assert [e.kind for e in events if "pad" in e.scope] == ["all_reduce"] * 4  # only value=2.0 reduces


COPIES = {
    "broadcast_row": ((9, 6), (6,)),
    "broadcast_col": ((9, 6), (9, 1)),
    "same_shape": ((9, 6), (9, 6)),
    "scalar_dim": ((9, 6), (1, 6)),
}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(COPIES))
def test_copy_broadcast_and_other_placements(mesh, name):
    dshape, sshape = COPIES[name]

    def fn(dst, src):
        out = dst * 1  # a fresh tensor to copy into, placed like dst
        return out.copy_(src)

    check(fn, [_x(dshape, "d"), _x(sshape, "s")], mesh, limit=16, grad=False, partial=("sum",))


def test_copy_plain_scalar_into_partial():
    def body(mesh):
        p = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()])
        p.copy_(torch.tensor(2.5))
        return p.placements, p.full_tensor()

    for pl, full in run_recorded((4,), body)[0]:
        assert pl == (Partial(),) and torch.equal(full, torch.full((4, 3), 2.5))


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("bounds", [(0, 0), (-1.0, 1.0), (0.5, 0.5)], ids=str)
def test_histc(mesh, bounds):
    x = _x((13, 5))
    lo, hi = bounds
    check(lambda a: torch.histc(a, 7, lo, hi), [x], mesh, limit=12, grad=False, partial=("sum", "max"))


def test_histc_constant_and_empty_inputs():
    def body(mesh):
        c = distribute_tensor(torch.full((6,), 3.0), mesh, [Shard(0)])
        e = distribute_tensor(torch.empty(0, 3), mesh, [Shard(0)])
        h = torch.histc(c, 4)
        return h.placements, h.full_tensor(), torch.histc(e, 3).full_tensor()

    for pl, h, he in run_recorded((4,), body)[0]:
        assert pl == (Partial(),)
        assert torch.equal(h, torch.histc(torch.full((6,), 3.0), 4))
        assert torch.equal(he, torch.histc(torch.empty(0, 3), 3))


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("placements", [[Shard(0)], [Replicate()], [Shard(1)]], ids=str)
def test_multinomial_placements_and_distribution(replacement, placements):
    """The draws do not depend on the placements; each row's frequencies follow its probabilities."""
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.7], [0.25, 0.25, 0.25, 0.25],
                          [0.0, 0.0, 0.5, 0.5], [0.9, 0.1, 0.0, 0.0]] * 40)

    def body(mesh):
        torch.manual_seed(0)
        p = distribute_tensor(probs, mesh, placements)
        s = torch.multinomial(p, 2, replacement=replacement)
        torch.manual_seed(0)
        ref = torch.multinomial(distribute_tensor(probs, mesh, [Replicate()]), 2, replacement=replacement)
        return s.placements, s.full_tensor(), ref.full_tensor()

    out = run_recorded((4,), body)[0]
    pl, s, ref = out[0]
    assert pl == ((Shard(0),) if placements == [Shard(0)] else (Replicate(),))
    assert all(torch.equal(o[1], s) for o in out)  # every rank sees the same draws
    assert torch.equal(s, ref) and s.dtype == torch.int64 and s.shape == (200, 2)
    assert (probs.gather(1, s) > 0).all()  # never a zero-probability category
    if not replacement:
        assert (s[:, 0] != s[:, 1]).all()
    first = s[0::5, 0]
    assert abs((first == 0).float().mean().item() - 0.7) < 0.2


def test_multinomial_bad_probabilities_raise_on_every_rank():
    def body(mesh):
        p = distribute_tensor(torch.tensor([[0.5, 0.5], [0.0, 0.0], [1.0, 0.0], [0.2, 0.8]]), mesh, [Shard(0)])
        try:
            torch.multinomial(p, 1)
        except RuntimeError as e:
            return "multinomial" in str(e)
        return False

    assert run_recorded((4,), body)[0] == [True] * 4


@pytest.mark.parametrize("points", [[1, 4], [3], 3])
def test_tensor_split_at_a_dtensor_of_split_points(points):
    """torch's C++ reads a 1-D tensor of split points from memory a DTensor lacks: it is read whole."""
    x = data("any", (7, 5), gen("tensor_split"))
    idx = torch.tensor(points)
    dense = torch.tensor_split(x, idx, dim=0)

    def body(mesh):
        d = distribute_tensor(x, mesh, [Shard(1)])
        i = distribute_tensor(idx, mesh, [Replicate()] if idx.ndim == 0 else [Shard(0)])
        outs = [torch.tensor_split(d, i, dim=0), d.tensor_split(i), torch.tensor_split(d, tensor_indices_or_sections=i)]
        return [[(o.placements, o.full_tensor()) for o in out] for out in outs]

    for out in run_recorded((4,), body)[0][0]:
        assert len(out) == len(dense)
        for (pls, full), want in zip(out, dense):
            assert pls == (Shard(1),) and torch.equal(full, want)


@pytest.mark.parametrize("placements", [(Replicate(),), (Shard(0),), (Shard(1),), (Partial(),)], ids=str)
@pytest.mark.parametrize("shape", [(3, 4), (2, 1), (8, 6)], ids=str)
def test_resize_keeps_the_first_elements_in_order(placements, shape):
    """resize_ (and resize_as_) as on one device: the whole tensor, replicated, keeps its first
    elements in row-major order; the wrapper takes the new shape and allocates nothing."""
    x = torch.arange(35.0).reshape(7, 5)
    numel = min(35, torch.Size(shape).numel())

    def body(mesh):
        d = (DTensor.from_local(x / 4, mesh, [Partial()]) if placements == (Partial(),)
             else distribute_tensor(x, mesh, list(placements)))
        out = d.resize_(*shape)
        e = distribute_tensor(x, mesh, list(placements)) if placements != (Partial(),) else DTensor.from_local(x / 4, mesh, [Partial()])
        e.resize_as_(distribute_tensor(torch.zeros(shape), mesh, [Shard(0)]))
        return out is d, d.placements, tuple(d.shape), d.full_tensor(), (d * 2).shape, e.full_tensor()

    for same, pls, got, full, doubled, full_as in run_recorded((4,), body)[0]:
        assert same and pls == (Replicate(),) and got == shape and tuple(doubled) == shape
        assert torch.equal(full.flatten()[:numel], x.flatten()[:numel])
        assert torch.equal(full_as.flatten()[:numel], x.flatten()[:numel])


def test_resize_of_a_sharded_non_contiguous_tensor_is_refused():
    def body(mesh):
        d = distribute_tensor(torch.arange(35.0).reshape(7, 5), mesh, [Shard(0)]).t()
        with pytest.raises(NotImplementedError, match="resize_.*non-contiguous"):
            d.resize_(2, 2)
        return tuple(d.shape)

    assert run_recorded((4,), body)[0] == [(5, 7)] * 4
