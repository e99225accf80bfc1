"""Plain tensors meeting DTensors: replicated where every rank builds the same one, refused elsewhere.

Autograd formulas build plain ``zeros``/index tensors from global shapes (prod, topk, sort,
max.dim backward on older torch), decompositions build masks, and one-element tensors and
``implicit_replication()`` blocks are taken as replicated values, as torch's DTensor does.
"""
from __future__ import annotations


import pytest
import torch

from opcheck import MESHES, check, data, gen  # noqa: E402

from shardtensor import (MixedTensorError, Replicate, Shard, distribute_tensor, implicit_replication,  # noqa: E402
                         init_device_mesh, run_spmd)
from shardtensor.propagation.rules.attention import OPS as ATTENTION_OPS  # noqa: E402

X = data("nonzero", (7, 5), gen("implicit"))


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name,fn", [
    ("prod1", lambda t: t.prod(1)), ("prod0_keep", lambda t: t.prod(0, keepdim=True)), ("prod", lambda t: t.prod()),
    ("topk", lambda t: t.topk(2, dim=1)[0]), ("sort", lambda t: t.sort(dim=0)[0]),
    ("max1", lambda t: t.max(1)[0]), ("min0", lambda t: t.min(0, keepdim=True)[0]),
    ("kthvalue", lambda t: t.kthvalue(2, dim=1)[0]), ("cummax", lambda t: t.cummax(0)[0]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_backward_formulas_with_plain_tensors(name, fn, mesh_shape):
    """Backward formulas that build plain tensors (zeros, index tensors, cat of pieces) run on every layout."""
    x = data("distinct", (7, 5), gen(name)) + 0.5
    check(fn, [x], mesh_shape, limit=10, seed=name)


def _mixed(mesh_shape, plain, how):
    mesh = init_device_mesh("cpu", mesh_shape)
    d = distribute_tensor(X, mesh, [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1))
    if how == "outside":
        try:
            d * plain
        except MixedTensorError as e:
            return str(e)
        return "no error"
    if how == "one_element":
        return (d * plain + plain).full_tensor()
    with implicit_replication():
        with implicit_replication():
            inner = (d * plain).full_tensor()
        nested_ok = (d + plain).full_tensor()
    if how == "inplace_plain_self":
        with implicit_replication():
            p = plain.clone()
            r = p.add_(d)
        return r is p, p, inner, nested_ok
    try:
        d - plain
    except MixedTensorError:
        return inner, nested_ok, "restored"
    return inner, nested_ok, "still implicit after the block"


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_implicit_replication_scope(mesh_shape):
    plain = data("any", (7, 5), gen("plain"))
    for inner, nested_ok, after in run_spmd(_mixed, 4, mesh_shape, plain, "inside"):
        torch.testing.assert_close(inner, X * plain)
        torch.testing.assert_close(nested_ok, X + plain)
        assert after == "restored"
    for is_self, p, _, _ in run_spmd(_mixed, 4, mesh_shape, plain, "inplace_plain_self"):
        assert is_self, "an in-place op returns its plain self"
        torch.testing.assert_close(p, plain + X)


def test_plain_tensor_outside_scope_is_refused():
    for msg in run_spmd(_mixed, 4, (4,), torch.ones(5), "outside"):
        assert "plain torch.Tensor of shape (5,)" in msg and "implicit_replication" in msg, msg


@pytest.mark.parametrize("plain", [torch.tensor(2.5), torch.tensor([2.5]), torch.tensor([[2.5]])], ids=str)
def test_one_element_plain_tensors_are_replicated(plain):
    for out in run_spmd(_mixed, 4, (2, 2), plain, "one_element"):
        torch.testing.assert_close(out, X * plain + plain)


def test_attention_ops_exist():
    """The CPU fused attention op of this torch has a rule (the CUDA ones where torch has them)."""
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ATTENTION_OPS


def _param_in_decomposition(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    d = distribute_tensor(X, mesh, [Shard(0)])
    try:
        torch.allclose(d, torch.nn.Parameter(X.clone()))  # allclose decomposes: its inner ops run lifted
    except MixedTensorError as e:
        return str(e)
    return "no error"


def test_plain_parameter_is_refused_before_a_decomposition():
    """A user's nn.Parameter is a plain tensor too: it must not ride the decomposition's replication scope."""
    for msg in run_spmd(_param_in_decomposition, 4, (4,)):
        assert "plain torch.Tensor of shape (7, 5)" in msg, msg


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name,fn", [
    ("rows", lambda t: t[[0, 2, 6]]), ("cols", lambda t: t[:, [1, 3]]), ("both", lambda t: t[[0, 6], [4, 1]]),
    ("repeat", lambda t: t[[3, 3, 0]]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_python_list_indices_are_replicated_values(name, fn, mesh_shape):
    """``x[[0, 2]]``: torch's C++ turns the list into a plain index tensor, built alike on every rank."""
    check(fn, [X], mesh_shape, limit=8)


def test_list_index_assignment_and_a_plain_index_tensor():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(X.clone(), mesh, [Shard(1)])
        d[[1, 4]] = 0.0
        try:
            d[torch.tensor([0, 1])]  # a caller's plain tensor stays refused
            refused = False
        except MixedTensorError:
            refused = True
        return d.full_tensor(), refused
    want = X.clone()
    want[[1, 4]] = 0.0
    for full, refused in run_spmd(body, 4):
        assert torch.equal(full, want) and refused


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name,fn", [
    ("combinations", lambda t: torch.combinations(t[0], 2)),
    ("matrix_power_0", lambda t: torch.linalg.matrix_power(t[:5, :5], 0) * t[:5, :5]),
    ("masked_var", lambda t: torch.masked.var(t, 1)),
    ("quantile", lambda t: torch.quantile(t, 0.3, dim=1)),
    ("sdpa_causal_3d", lambda t: torch.nn.functional.scaled_dot_product_attention(
        t.unsqueeze(0), t.unsqueeze(0), t.unsqueeze(0), is_causal=True)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_plain_tensors_torch_builds_inside_its_own_functions(name, fn, mesh_shape):
    """torch's code builds plain masks, identities and counts from its DTensor arguments: each
    is built alike on every rank, so it is taken as replicated (after the ranks compare it)."""
    check(fn, [X], mesh_shape, limit=8, seed=name, tol=dict(rtol=1e-4, atol=1e-4))


def test_a_plain_tensor_of_user_code_inside_a_module_is_still_refused():
    """A module's forward is user code: its plain buffer is the user's, not torch's, even though
    ``nn.Module.__call__`` (torch's Python) called it with DTensors only."""
    class M(torch.nn.Module):
        def forward(self, x):
            return x * torch.arange(5.0)

    def body():
        mesh = init_device_mesh("cpu", (4,))
        M()(distribute_tensor(X, mesh, [Shard(0)]))

    with pytest.raises(MixedTensorError, match="plain torch.Tensor of shape \\(5,\\)"):
        run_spmd(body, 4)


def test_random_plain_tensors_torch_draws_inside_agree_across_ranks():
    """``svd_lowrank`` draws a plain random projection: ranks whose generators differ take
    coordinate 0's, so the replicated result is the same on every rank."""
    a = data("any", (9, 6), gen("lowrank"))

    def body():
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(10 + mesh.get_rank())
        u, s, v = torch.svd_lowrank(distribute_tensor(a, mesh, [Shard(0)]), q=3, niter=2)
        return (u @ torch.diag_embed(s) @ v.mT).full_tensor()

    outs = run_spmd(body, 4)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.linalg.matrix_norm(outs[0] - a) <= torch.linalg.matrix_norm(a)
