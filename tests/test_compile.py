"""torch.compile over DTensors: eager, aot_eager and inductor give what eager shardtensor gives.

Each case runs a function or a TP model compiled and uncompiled on the same inputs, forward
and backward, in the simulated world (ranks are threads that share dynamo's cache, so the
rank guard matters) and in gloo processes.  The graphs must hold shardtensor's collectives
as ops (``shardtensor::all_to_all`` ...) and run them when the compiled code runs.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from distributed import gloo_available, run_multiprocess  # noqa: E402

from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd  # noqa: E402
from shardtensor.comm import recording  # noqa: E402
from shardtensor.compile import methods_traced  # noqa: E402
from shardtensor.mesh import DeviceMesh, mesh_of  # noqa: E402
from shardtensor.placement import NormPartial, StridedShard  # noqa: E402
from shardtensor.parallel import (ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel,  # noqa: E402
                                  SequenceParallel, parallelize_module)

BACKENDS = ["eager", "aot_eager", "inductor"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _close(a: torch.Tensor, b: torch.Tensor, backend: str) -> bool:
    tol = 0 if backend == "eager" else 1e-6 if backend == "aot_eager" else 1e-5  # fusions reorder float math
    return bool(torch.allclose(a, b, rtol=tol, atol=tol))


def _redistribute_fn(backend: str):
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    a = torch.randn(7, 5)
    x = distribute_tensor(a, mesh, [Shard(0), Shard(1)])

    def g(t):
        r = t.redistribute(mesh, [Replicate(), Shard(0)])
        return (r * 2 + 1).relu(), r.sum()

    out, total = torch.compile(g, backend=backend)(x)
    ref, ref_total = g(x)
    assert out.placements == ref.placements and total.placements == ref_total.placements
    return (_close(out.full_tensor(), ref.full_tensor(), backend) and _close(total.full_tensor(), ref_total.full_tensor(), backend)
            and torch.allclose(ref.full_tensor(), (a * 2 + 1).relu()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_redistribute_equals_eager(backend):
    assert run_spmd(_redistribute_fn, 4, backend) == [True] * 4


def _method_graphs(backend: str, world_shape: tuple[int, ...]):
    """redistribute (placements built inside the compiled code, Partial included), full_tensor and
    to_local under fullgraph=True: the number of graphs, no recompile on the second call, and
    values and gradients equal to eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm) if backend == "aot_eager" else gm.forward

    compiler = aot_autograd(fw_compiler=count, bw_compiler=count) if backend == "aot_eager" else count
    mesh = init_device_mesh("cpu", world_shape)
    torch.manual_seed(0)
    a, w = torch.randn(7, 5), torch.randn(5, 3)
    nd = mesh.ndim
    src = [Shard(0), Shard(1)][:nd]

    def g(t, wt):
        r = t.redistribute(mesh, [Replicate(), Shard(0)][-nd:])
        p = (r @ wt).redistribute(mesh, [Replicate()] * nd)  # the sum of a Partial, in the graph
        return (r * 2 + 1).relu().full_tensor().sum() + p.to_local().sin().sum()

    def inputs():
        x = distribute_tensor(a, mesh, src).requires_grad_()
        y = distribute_tensor(w, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)).requires_grad_()
        return x, y

    compiled = torch.compile(g, backend=compiler, fullgraph=True)
    x, y = inputs()
    out = compiled(x, y)
    out.backward()
    first = len(graphs)
    compiled(*inputs())  # the same layouts again: no recompile (see the test for the simulated world's exception)
    rx, ry = inputs()
    ref = g(rx, ry)
    ref.backward()
    dense_x = a.clone().requires_grad_()
    ((dense_x * 2 + 1).relu().sum() + (dense_x @ w).sin().sum()).backward()
    return (first, len(graphs), _close(out, ref, backend), _close(x.grad.full_tensor(), rx.grad.full_tensor(), backend),
            _close(y.grad.full_tensor(), ry.grad.full_tensor(), backend), torch.allclose(rx.grad.full_tensor(), dense_x.grad))


@pytest.mark.skipif(not methods_traced(), reason="placements become graph constants on torch 2.13 and newer")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("world_shape", [(4,), (2, 2)])
def test_redistribute_full_tensor_and_to_local_trace_into_one_graph(backend, world_shape):
    graphs = 1 if backend == "eager" else 2  # aot_eager: a forward and a backward graph
    res = run_spmd(_method_graphs, 4, backend, world_shape)
    # Simulated ranks are threads sharing dynamo's cache; a guard built on one thread sometimes sees
    # another thread's dispatch keys and a rank compiles once more (values stay right).  Separate
    # processes never do: test_methods_trace_without_recompiles_in_gloo_processes.
    assert [r[0] for r in res] == [graphs] * 4 and all(r[1] in (graphs, 2 * graphs) for r in res)
    assert [r[2:] for r in res] == [(True,) * 4] * 4


def _gloo_methods(rank: int, world: int, backend: str):
    torch._dynamo.reset()
    return _method_graphs(backend, (world,))


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
@pytest.mark.skipif(not gloo_available() or not methods_traced(), reason="needs gloo and torch 2.13 or newer")
def test_methods_trace_without_recompiles_in_gloo_processes():
    res = run_multiprocess(_gloo_methods, 2, timeout=240, args=("aot_eager",))
    assert res == [(2, 2, True, True, True, True)] * 2, res


def test_placements_and_meshes_write_themselves_into_graph_code():
    def fn():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        code, names = mesh.__fx_repr__()
        other = mesh_of(("cpu", (2,), (1, 0), None))  # never seen: built from its key
        return eval(code, dict(names)) == mesh, other == DeviceMesh("cpu", [1, 0]) and other.mesh.tolist() == [1, 0]
    assert run_spmd(fn, 4) == [(True, True)] * 4
    for p in (Shard(1), StridedShard(0, split_factor=3), Replicate(), Partial("max"), NormPartial(float("inf")),
              NormPartial(3)):
        code, names = p.__fx_repr__()
        assert eval(code, dict(names)) == p and type(eval(code, dict(names))) is type(p)


def _traced_collectives(device: str = "cpu"):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[str] = []

    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm)

    mesh = init_device_mesh(device, (4,))
    torch.manual_seed(0)
    a, b = torch.randn(7, 6, device=device), torch.randn(7, 6, device=device)  # uneven over 4: graphs differ
    x = distribute_tensor(a, mesh, [Shard(0)]).requires_grad_()
    y = distribute_tensor(b, mesh, [Shard(1)]).requires_grad_()
    g = torch.compile(lambda x, y: (x * y.sin()).sum(0), backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    with recording() as log:
        out = g(x, y)
        out = g(x, y)  # no recompilation: the second call reuses the graph
    kinds = [e.kind for e in log.events if e.rank == mesh.get_rank()]
    out.sum().backward()
    a.requires_grad_(), b.requires_grad_()
    (a * b.sin()).sum().backward()
    return (out.placements, kinds, any("shardtensor.all_to_all" in c for c in graphs),
            torch.allclose(out.full_tensor(), (a * b.sin()).sum(0).detach()),
            torch.allclose(x.grad.full_tensor(), a.grad), torch.allclose(y.grad.full_tensor(), b.grad))


def test_implicit_redistribution_becomes_a_traced_collective_that_runs_and_is_recorded():
    res = run_spmd(_traced_collectives, 4)
    for placements, kinds, in_graph, fwd, gx, gy in res:
        assert placements == (Partial(),)
        assert kinds == ["all_to_all", "all_to_all"], kinds  # one per call, recorded by the compiled code
        assert in_graph and fwd and gx and gy


def _tp_mlp(backend: str, world: int | None = None, device: str = "cpu", fullgraph: bool = False):
    """A TP MLP compiled and not: equal outputs and gradients, and both near one device's.
    ``fullgraph``: the styles' hooks in the graph (separate processes; simulated ranks, which
    share dynamo's cache, run them eagerly: traceable.py)."""
    mesh = init_device_mesh(device, (world or 4,))
    torch.manual_seed(1)
    dense = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 16)).to(device)  # 30 hidden: uneven over 4
    models = []
    for _ in range(2):
        m = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 16)).to(device)
        m.load_state_dict(dense.state_dict())
        models.append(parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}))
    compiled = torch.compile(models[0], backend=backend, fullgraph=fullgraph)
    ok = []
    for step in range(2):
        inp = torch.randn(5, 16, generator=torch.Generator().manual_seed(step)).to(device)
        out, eager, want = compiled(inp), models[1](inp), dense(inp)
        ok.append(not isinstance(out, DTensor) and _close(out, eager, backend) and torch.allclose(out, want, atol=1e-5))
        for o in (out, eager, want):
            o.square().sum().backward()
    for p, q, r in zip(models[0].parameters(), models[1].parameters(), dense.parameters()):
        g = p.grad.full_tensor()
        ok.append(_close(g, q.grad.full_tensor(), backend) and torch.allclose(g, r.grad, atol=1e-5))
    return ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_tp_mlp_trains_like_one_device(backend):
    assert run_spmd(_tp_mlp, 4, backend) == [[True] * 6] * 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 30), nn.Linear(30, 16)

    def forward(self, x):
        return x + self.down(self.up(self.norm(x)).relu())


def _sequence_parallel_block(backend: str, world: int = 4, fullgraph: bool = False):
    """PrepareModuleInputOutput, SequenceParallel, Colwise and Rowwise on a residual block, compiled
    (``fullgraph`` in separate processes): forward and gradients equal to eager and to one device."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(2)
    dense = nn.Sequential(_Block())
    plan = {"0": PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                          output_layouts=Shard(1), desired_output_layouts=Replicate()),
            "0.norm": SequenceParallel(), "0.up": ColwiseParallel(input_layouts=Shard(1)),
            "0.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    models = []
    for _ in range(2):
        m = nn.Sequential(_Block())
        m.load_state_dict(dense.state_dict())
        models.append(parallelize_module(m, mesh, plan))
    compiled = torch.compile(models[0], backend=backend, fullgraph=fullgraph)
    ok = []
    for step in range(2):
        inp = torch.randn(3, 12, 16, generator=torch.Generator().manual_seed(step))  # 12 positions over 4 ranks
        out, eager, want = compiled(inp), models[1](inp), dense(inp)
        ok.append(_close(out, eager, backend) and torch.allclose(out, want, atol=1e-5))
        for o in (out, eager, want):
            o.square().sum().backward()
    for (name, p), q, r in zip(models[0].named_parameters(), models[1].parameters(), dense.parameters()):
        ok.append(_close(p.grad.full_tensor(), q.grad.full_tensor(), backend)
                  and torch.allclose(p.grad.full_tensor(), r.grad, atol=1e-5))
    return ok


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_sequence_parallel_block_equals_eager(backend):
    assert run_spmd(_sequence_parallel_block, 4, backend) == [[True] * 8] * 4


def _gloo_fullgraph(rank: int, world: int, what: str):
    torch._dynamo.reset()
    if what == "block":
        return _sequence_parallel_block("aot_eager", world, fullgraph=True)
    if what == "local_map":
        return _local_map_in_graph(world)
    return _from_local_in_graph("aot_eager", fullgraph=True)


def _local_map_in_graph(world: int):
    """``local_map`` in ``fullgraph=True`` code, as torch's: uneven pieces (5 rows), a replicated
    weight whose local gradients are Partial, a Partial output; forward and backward equal eager."""
    from shardtensor.experimental import local_map

    mesh = init_device_mesh("cpu", (world,))
    scale = local_map(lambda t, w: (t * w, (t * w).sum()), out_placements=([Shard(0)], [Partial()]),
                      in_placements=([Shard(0)], [Replicate()]), in_grad_placements=(None, [Partial()]))

    def g(x, w):
        y, total = scale(x, w)
        return y.redistribute(mesh, [Replicate()]).to_local(), total.full_tensor()

    got = []
    for fn in (g, torch.compile(g, backend="aot_eager", fullgraph=True)):
        x = distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)]).requires_grad_()
        w = distribute_tensor(torch.tensor([2.0, 3.0]), mesh, [Replicate()]).requires_grad_()
        y, total = fn(x, w)
        (y.pow(2).sum() + total).backward()
        got.append((y, total, x.grad.full_tensor(), w.grad.full_tensor()))
    a, wd = torch.arange(10.0).reshape(5, 2).requires_grad_(), torch.tensor([2.0, 3.0], requires_grad=True)
    ((a * wd).pow(2).sum() + (a * wd).sum()).backward()
    want = (a.detach() * wd.detach(), (a * wd).sum().detach(), a.grad, wd.grad)
    return [all(torch.allclose(u, v) for u, v in zip(run, want)) for run in got]


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
@pytest.mark.skipif(not gloo_available() or not methods_traced(), reason="needs gloo and torch 2.13 or newer")
def test_tensor_parallel_models_compile_into_one_graph_in_gloo_processes():
    """fullgraph=True: the styles' hooks and from_local are nodes of the graph (no graph break)."""
    res = run_multiprocess(_gloo_fullgraph, 2, timeout=300, args=("block",))
    assert res == [[True] * 8] * 2, res
    assert run_multiprocess(_gloo_fullgraph, 4, timeout=300, args=("from_local",)) == [True] * 4


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
@pytest.mark.skipif(not gloo_available() or not methods_traced(), reason="needs gloo and torch 2.13 or newer")
def test_local_map_compiles_into_one_graph_in_gloo_processes():
    """fullgraph=True: dynamo reads local_map's wrapper (its DTensor reads, methods and from_local
    are graph nodes); an uneven output's global shape comes from the pieces' sizes exchanged while
    tracing, a constant of the graph."""
    assert run_multiprocess(_gloo_fullgraph, 2, timeout=300, args=("local_map",)) == [[True, True]] * 2


def _from_local_in_graph(backend: str, fullgraph: bool = False):
    mesh = init_device_mesh("cpu", (2, 2))
    a = torch.arange(35.0).reshape(7, 5)

    def g(t):
        d = DTensor.from_local(t.to_local() * 3, mesh, [Shard(0), Shard(1)], shape=t.shape, stride=t.stride())
        return d.redistribute(mesh, [Replicate(), Replicate()]).to_local()

    x = distribute_tensor(a, mesh, [Shard(0), Shard(1)])
    return torch.equal(torch.compile(g, backend=backend, fullgraph=fullgraph)(x), a * 3)


@pytest.mark.skipif(not methods_traced(), reason="torch 2.11's dynamo rewrites redistribute(mesh, ...) on a "
                    "DTensor made in the compiled code and fails on a mesh it cannot make a constant")
def test_a_compiled_from_local_equals_eager():
    assert run_spmd(_from_local_in_graph, 4, "aot_eager") == [True] * 4


def _plain_input_graph(backend: str):
    """No DTensor input, so no rank in the metadata guards: each simulated rank must still run
    its own graph (its own block of the uneven split)."""
    mesh = init_device_mesh("cpu", (4,))

    def g(x):
        return DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local()

    x = torch.arange(7.0)
    return torch.compile(g, backend=backend)(x).tolist(), g(x).tolist()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_graph_without_dtensor_inputs_keeps_each_simulated_ranks_block(backend):
    res = run_spmd(_plain_input_graph, 4, backend)
    assert [r[0] for r in res] == [r[1] for r in res] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0]]


def _broken_by_distribute_tensor(backend: str):
    mesh = init_device_mesh("cpu", (2,))

    def g(x):  # distribute_tensor runs eagerly (a graph break) with placements built in the compiled code
        return (distribute_tensor(x, mesh, [Shard(0)]) * 2).to_local()

    def after_a_graph(t):  # ... after a graph over a DTensor: the placements reach eager code as stand-ins
        return distribute_tensor(t.to_local() * 3, mesh, [Replicate()]).to_local()

    x = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    return torch.compile(g, backend=backend)(torch.arange(6.0)).tolist(), torch.compile(after_a_graph, backend=backend)(x).tolist()


@pytest.mark.skipif(not methods_traced(), reason="the stand-ins exist where placements are graph constants (torch 2.13+); "
                    "torch 2.11's dynamo also sees one thread's FX tracing from another's compile here")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.xfail(
    methods_traced() and torch.__version__ < (2, 15), strict=True, raises=TypeError,
    reason="inductor hands eager code None for a placement built in the compiled code after a graph (docs/compile.md)"))])
def test_a_graph_break_hands_placements_built_in_compiled_code_to_eager_code(backend):
    assert run_spmd(_broken_by_distribute_tensor, 2, backend) == [([0.0, 2.0, 4.0], [0.0, 3.0, 6.0]),
                                                                  ([6.0, 8.0, 10.0], [0.0, 3.0, 6.0])]  # rank 0's data


def _gloo_get_group(rank: int, world: int):
    """``dist.all_reduce(t, group=mesh.get_group(dim))`` in a fullgraph-compiled function, called
    before any eager ``get_group`` (Hugging Face's TP layers do this at inference)."""
    import torch.distributed as dist

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]  # slicing names this rank's row: not in compiled code (see the simulated world)

    def f(t):
        t = t * 2
        dist.all_reduce(t, group=mesh.get_group("tp"))
        dist.all_reduce(t, group=dp.get_group())
        return t + 1

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.full((3,), float(rank)))
    return out.tolist(), mesh.get_group("tp") is mesh["tp"].get_group()


@pytest.mark.skipif(not gloo_available() or not methods_traced(), reason="needs gloo and torch 2.13 or newer")
def test_get_group_in_fullgraph_compiled_code_in_gloo_processes():
    res = run_multiprocess(_gloo_get_group, 4, timeout=300)
    assert res == [([2.0 * (0 + 1 + 2 + 3) + 1] * 3, True)] * 4, res


def test_get_group_in_compiled_code_in_the_simulated_world_raises_as_eager():
    def fn():
        mesh = init_device_mesh("cpu", (2,))
        with pytest.raises(RuntimeError, match="no torch.distributed process groups"):
            torch.compile(lambda t: (t + 1, mesh.get_group()), backend="aot_eager")(torch.ones(1))
        return True
    assert run_spmd(fn, 2) == [True, True]


def test_mesh_attributes_read_in_compiled_code():
    def fn():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def g(t):
            return t * mesh.ndim + mesh.size(1), mesh.shape, mesh.mesh_dim_names

        out, shape, names = torch.compile(g, backend="eager", fullgraph=methods_traced())(torch.ones(2))

        def mine(t):  # the calling rank's: read eagerly (a graph break), never baked into a shared graph
            return t + mesh.get_rank(), mesh.get_coordinate(), mesh.get_local_rank("tp")

        here, coord, local = torch.compile(mine, backend="aot_eager")(torch.zeros(1))
        return out.tolist(), shape, names, here.item(), coord, local
    assert run_spmd(fn, 4) == [([4.0, 4.0], (2, 2), ("dp", "tp"), float(r), [r // 2, r % 2], r % 2) for r in range(4)]


def test_the_compile_metadata_names_the_rank():
    def fn():
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
        _, meta = x.__tensor_flatten__()
        other = (meta[0], 1 - meta[1])
        return meta[1], DTensor.__metadata_guard__(meta, meta), DTensor.__metadata_guard__(meta, other)

    assert run_spmd(fn, 2) == [(0, True, False), (1, True, False)]


def test_the_compile_metadata_follows_a_changed_spec():
    # guards read it twice per DTensor input per call, so it is made once; an in-place op that
    # changes the placements must still show in it (else a graph for the old ones would run)
    def fn():
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
        first = x.__tensor_flatten__()[1]
        same = x.__tensor_flatten__()[1] is first
        x._spec = x._spec.with_placements([Replicate()])
        return same, x.__tensor_flatten__()[1] == (x._spec, first[1]), first[0] != x._spec

    assert run_spmd(fn, 2) == [(True, True, True)] * 2


def test_the_compile_metadata_names_the_rank_that_reads_it():
    # a DTensor made (and flattened) on one rank and read on others, as a deep copy carries
    # the cached pair along: each simulated rank must see its own rank there
    x = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Replicate()])
    assert x.__tensor_flatten__()[1][1] == 0
    assert run_spmd(lambda: x.__tensor_flatten__()[1][1], 3) == [0, 1, 2]


def _gloo_compiled(rank: int, world: int, backend: str):
    torch._dynamo.reset()
    return _tp_mlp(backend, world, fullgraph=methods_traced())


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
@pytest.mark.skipif(not gloo_available(), reason="needs gloo")
def test_compiled_tp_mlp_in_gloo_processes():
    res = run_multiprocess(_gloo_compiled, 2, timeout=240, args=("aot_eager",))
    assert res == [[True] * 6] * 2, res


class _BrokenMLP(nn.Module):
    """Colwise then Rowwise with a graph break between them: the plain local piece crosses it."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 30), nn.Linear(30, 8)

    def forward(self, x):
        h = self.up(x)
        torch._dynamo.graph_break()
        return x + self.down(h.relu())


def _graph_break_between_styles(backend: str, world: int):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(4)
    dense, m, eager = _BrokenMLP(), _BrokenMLP(), _BrokenMLP()
    for o in (m, eager):
        o.load_state_dict(dense.state_dict())
        parallelize_module(o, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compiled = torch.compile(m, backend=backend)
    x = torch.randn(2, 5, 8)
    outs = [compiled(x), eager(x), dense(x)]
    for o in outs:
        o.square().sum().backward()
    ok = [type(outs[0]) is torch.Tensor, _close(outs[0], outs[1], backend),
          torch.allclose(outs[0], outs[2], atol=1e-5)]
    for p, q, r in zip(m.parameters(), eager.parameters(), dense.parameters()):
        ok.append(_close(p.grad.full_tensor(), q.grad.full_tensor(), backend)
                  and torch.allclose(p.grad.full_tensor(), r.grad, atol=1e-5))
    return ok


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_graph_break_between_tp_layers_trains_like_eager(backend, world):
    # the graph after the break took the plain piece's gradient for a DTensor (torch.autograd.grad
    # in AOTAutograd's traced backward wrapped it), and the graph before refused it in backward.
    # One simulated rank keeps the hooks in the graph (more ranks run them eagerly: _convert's
    # backward then runs outside AOTAutograd); gloo processes: test_compiled_tp_models_..._gloo
    assert run_spmd(_graph_break_between_styles, world, backend, world) == [[True] * 7] * world


def _dynamic_view_inputs():
    mesh = init_device_mesh("cpu", (2,))
    base = distribute_tensor(torch.randn(4, 6, 8), mesh, [Shard(0)])
    views = {"view": lambda b: b.view(4, 48), "slice": lambda b: b[:, 1:3], "transpose": lambda b: b.transpose(1, 2)}
    ok = []
    for name, make in views.items():
        v = make(base)
        got = torch.compile(lambda t: (t * 2).sum(-1), backend="aot_eager", dynamic=True)(v)
        ok.append(got.placements == (Shard(0),) and torch.equal(got.full_tensor(), (v * 2).sum(-1).full_tensor()))
    return ok


def test_a_dtensor_view_input_with_dynamic_shapes_compiles():
    # dynamo replays a view input's view on fake tensors with symbolic sizes; a spec holding them
    # could not be hashed (the sizes are now specialized: a guard per dim)
    assert run_spmd(_dynamic_view_inputs, 2) == [[True] * 3] * 2


def _marked_dynamic(strict):
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])
    (torch._dynamo.mark_dynamic if strict else torch._dynamo.maybe_mark_dynamic)(x, 0)
    f = torch.compile(lambda t: (t * 2).sum(0), backend="aot_eager", fullgraph=True)
    try:
        return f(x).full_tensor()
    except Exception as e:  # noqa: BLE001 - dynamo wraps the error; the message is what the user reads
        return str(e)


def test_mark_dynamic_on_a_dtensor_says_sizes_are_static_and_maybe_mark_dynamic_compiles():
    torch._dynamo.reset()
    for msg in run_spmd(_marked_dynamic, 2, True):
        assert isinstance(msg, str) and "mark_dynamic(dtensor, 0)" in msg and "maybe_mark_dynamic" in msg, msg
    want = (torch.arange(24.0).reshape(8, 3) * 2).sum(0)
    assert all(torch.equal(y, want) for y in run_spmd(_marked_dynamic, 2, False))


def _demo_model_fullgraph():
    from shardtensor.examples.tiny_lm import VOCAB, batch, build_model, tp_plan

    mesh = init_device_mesh("cpu", (1,))
    models = [build_model(0) for _ in range(2)]
    for m in models:
        for blk in m.blocks:
            parallelize_module(blk, mesh, tp_plan())
        parallelize_module(m, mesh, {"head": ColwiseParallel(output_layouts=Replicate())})
    compiled = torch.compile(models[0], backend="aot_eager", fullgraph=True)
    x, y = batch(0, 0)
    losses = [nn.functional.cross_entropy(f(x).reshape(-1, VOCAB), y.reshape(-1)) for f in (compiled, models[1])]
    for loss in losses:
        loss.backward()
    def whole(g):
        return g.full_tensor() if isinstance(g, DTensor) else g

    return [torch.allclose(losses[0], losses[1], atol=1e-6)] + [
        torch.allclose(whole(p.grad), whole(q.grad), atol=1e-6)
        for p, q in zip(models[0].parameters(), models[1].parameters())]


@pytest.mark.skipif(not methods_traced(), reason="placements are graph constants from torch 2.13 on")
def test_the_demo_model_is_user_code_that_compiles_into_one_graph():
    # shardtensor.examples was on dynamo's skip list with the library: the demo's blocks never
    # compiled (0 graphs), and every call into them was a graph break
    res = run_spmd(_demo_model_fullgraph, 1)[0]
    assert res == [True] * len(res) and len(res) > 10
