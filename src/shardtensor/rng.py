"""Random numbers: one device's values, every rank's generator in step, a generator per simulated rank.

The guarantee.  A random op on DTensors (``normal_``, ``uniform_`` and the other fills behind
``nn.init``; ``rand_like``, ``randn_like``, ``randint_like``; the factories ``shardtensor.randn``
& co.) draws the GLOBAL tensor from the op's generator (the device's default one unless a
``generator=`` is given) and keeps this rank's block.  So after ``torch.manual_seed(s)`` the
sharded result equals the same call on one device after ``torch.manual_seed(s)``, sliced, for
every mesh, placement and uneven size; and every rank's generator advances exactly as one
device's would, so later plain random ops (``torch.rand(4)``) still agree across ranks.

Replicas agree even when the ranks' generators do not.  Before drawing, the ranks compare a
64-bit fingerprint of their generator states (one 16-byte all-reduce).  Where they differ, mesh
coordinate 0 broadcasts its state, every rank draws from that, and each rank advances its own
generator by the same draw: a rank seeded on purpose for its own data keeps its own stream.

Cost: the fingerprint all-reduce per random op, and every rank materializes the global tensor
once (transiently).  Dropout-like ops (``rules.nn``) draw a 2-int seed this way and build the
mask from a counter-based hash, so they never materialize the global mask.

The simulated world.  In :func:`~shardtensor.run_spmd` each rank has its own default generators,
as a process would: they start as copies of the caller's, ``torch.manual_seed``,
``torch.get_rng_state`` & co. called on a rank act on the rank's, and plain random functions
(``torch.rand``, ``Tensor.uniform_``, ``F.dropout``, ...) draw from them.  The plain ones are
caught by a thread-local ``TorchFunctionMode`` that swaps the rank's state into torch's default
generator under a lock for the call.
"""
from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from .mesh import DeviceMesh

__all__ = ["default_generator", "draw", "rank_generators", "agreed"]

T = TypeVar("T")


class _Rank(threading.local):
    gens: dict[str, torch.Generator] | None = None
    seed: int | None = None


_rank = _Rank()
_swap_lock = threading.Lock()


def _key(device: torch.device | str | None) -> torch.device:
    dev = torch.device("cpu" if device is None else device)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, getattr(torch, dev.type).current_device())
    return dev


def _torch_default(dev: torch.device) -> torch.Generator:
    if dev.type == "cpu":
        return torch.default_generator
    return getattr(torch, dev.type).default_generators[dev.index]


def default_generator(device: torch.device | str | None = None) -> torch.Generator:
    """The generator a plain random op on ``device`` uses here: the simulated rank's, else torch's."""
    dev = _key(device)
    gens = _rank.gens
    if gens is None:
        return _torch_default(dev)
    g = gens.get(str(dev))
    if g is None:
        g = torch.Generator(dev)
        if _rank.seed is not None:
            g.manual_seed(_rank.seed)
        else:
            g.set_state(_torch_default(dev).get_state())
        gens[str(dev)] = g
    return g


# -- drawing on DTensors -------------------------------------------------------------------

def _fingerprint(g: torch.Generator) -> int:
    state = g.get_state().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little") >> 2


def _all_equal(value: int, mesh: "DeviceMesh", device: torch.device) -> bool:
    """Whether every rank of ``mesh`` holds the same 62-bit ``value`` (one 16-byte all-reduce)."""
    from . import comm

    t = comm.all_reduce(torch.tensor([value, -value], dtype=torch.int64, device=device), "max", mesh, None)
    return int(t[0]) == -int(t[1])


def draw(mesh: "DeviceMesh", generator: torch.Generator | None, device: torch.device | str | None,
         fn: Callable[[torch.Generator], T]) -> T:
    """``fn(g)`` with a generator state every rank of ``mesh`` agrees on (see the module docstring).

    ``fn`` must draw the same amount on every rank (the global tensor, or a seed).  Each rank's
    own generator ends where one device's would after ``fn``.
    """
    dev = _key(device)
    own = generator if generator is not None else default_generator(dev)
    if mesh.size() == 1:
        return fn(own)
    first = all(c == 0 for c in mesh.get_coordinate() or [0])
    if generator is not None and _rank.gens is not None and _all_equal(id(generator), mesh, dev):
        # one generator object shared by the simulated ranks: only coordinate 0 may touch it
        return _from_first(mesh, own, dev, fn, first, advance_own=False)
    if _all_equal(_fingerprint(own), mesh, dev):
        return fn(own)
    return _from_first(mesh, own, dev, fn, first, advance_own=True)


def _from_first(mesh: "DeviceMesh", own: torch.Generator, dev: torch.device, fn: Callable[[torch.Generator], T],
                first: bool, advance_own: bool) -> T:
    """Coordinate 0 draws from its generator; the others from a copy of its state."""
    from . import comm

    state = own.get_state() if first else torch.empty_like(torch.Generator(own.device).get_state())
    state = comm.broadcast(state.to(dev), 0, mesh, None).cpu()
    if first:
        return fn(own)
    out = fn(torch.Generator(own.device).set_state(state))
    if advance_own:
        fn(own)  # this rank's own stream moves on as one device's would; the values are not used
    return out


def agreed(t: torch.Tensor, mesh: "DeviceMesh") -> torch.Tensor:
    """``t``, a plain tensor every rank built: as it is where every rank of ``mesh`` built the same
    one (a 64-bit fingerprint compared), else coordinate 0's (random numbers drawn from generators
    that differ: any one rank's draw is a valid draw, and replicas must agree)."""
    from . import comm

    data = t.detach().contiguous()
    digest = hashlib.blake2b(data.cpu().reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8)
    digest.update(repr((tuple(t.shape), t.dtype)).encode())
    if _all_equal(int.from_bytes(digest.digest(), "little") >> 2, mesh, t.device):
        return t
    return comm.broadcast(data, 0, mesh, None)


# -- one default generator per simulated rank ----------------------------------------------

_RANDOM_NAMES = frozenset("""
rand randn randint randperm rand_like randn_like randint_like normal normal_ uniform_ bernoulli bernoulli_
multinomial poisson binomial exponential_ geometric_ log_normal_ cauchy_ random_ dropout dropout_ dropout1d
dropout2d dropout3d alpha_dropout alpha_dropout_ feature_dropout feature_dropout_ feature_alpha_dropout
feature_alpha_dropout_ native_dropout rrelu rrelu_ rrelu_with_noise _standard_gamma _sample_dirichlet
_fused_dropout kaiming_uniform_ gumbel_softmax fractional_max_pool2d fractional_max_pool3d
fractional_max_pool2d_with_indices fractional_max_pool3d_with_indices
""".split())


def _has_dtensor(args: tuple, kwargs: dict) -> bool:
    from .tensor import DTensor

    return any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0])


class _RankRandomMode(TorchFunctionMode):
    """Plain random functions on a simulated rank draw from the rank's generators."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (getattr(func, "__name__", None) not in _RANDOM_NAMES or kwargs.get("generator") is not None
                or _has_dtensor(args, kwargs)):
            return func(*args, **kwargs)  # DTensor rules take the rank's generator themselves
        with _rank_state_in_default():
            return func(*args, **kwargs)


@contextmanager
def _rank_state_in_default() -> Iterator[None]:
    """torch's default generators hold this rank's states for the duration (under a lock)."""
    devs = [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devs.append(_key("cuda"))
    with _swap_lock:
        pairs = [(_torch_default(d), default_generator(d)) for d in devs]
        saved = [t.get_state() for t, _ in pairs]
        for t, mine in pairs:
            t.set_state(mine.get_state())
        try:
            yield
        finally:
            for (t, mine), s in zip(pairs, saved):
                mine.set_state(t.get_state())
                t.set_state(s)


def _on_rank(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.<name>`` that acts on the simulated rank's CPU generator when called on a rank."""

    def patched(*args: Any, **kwargs: Any) -> Any:
        if _rank.gens is None:
            return original(*args, **kwargs)
        g = default_generator("cpu")
        if name == "manual_seed":
            seed = int(args[0] if args else kwargs["seed"])
            _rank.gens, _rank.seed = {}, seed
            return default_generator("cpu").manual_seed(seed)
        if name == "seed":
            return g.seed()
        if name == "initial_seed":
            return g.initial_seed()
        if name == "get_rng_state":
            return g.get_state()
        return g.set_state(args[0] if args else kwargs["new_state"])

    patched.__wrapped__ = original  # type: ignore[attr-defined]
    patched.__name__ = name
    patched.__doc__ = original.__doc__
    return patched


_patched = False


def _install() -> None:
    global _patched
    with _swap_lock:
        if _patched:
            return
        for name in ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state"):
            wrapped = _on_rank(name, getattr(torch.random, name))
            setattr(torch.random, name, wrapped)
            setattr(torch, name, wrapped)
        _patched = True


@contextmanager
def rank_generators(cpu_state: torch.Tensor) -> Iterator[None]:
    """Run a simulated rank with its own default generators, starting from ``cpu_state``."""
    _install()
    _rank.gens, _rank.seed = {"cpu": torch.Generator().set_state(cpu_state)}, None
    try:
        with _RankRandomMode():
            yield
    finally:
        _rank.gens, _rank.seed = None, None
