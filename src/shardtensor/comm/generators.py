"""One default generator per simulated rank: a rank of ``run_spmd`` draws as a process would.

In :func:`~shardtensor.run_spmd` each rank has its own default generators,
as a process would: they start as copies of the caller's, ``torch.manual_seed``,
``torch.get_rng_state`` & co. called on a rank act on the rank's, and plain random functions
(``torch.rand``, ``Tensor.uniform_``, ``F.dropout``, ...) draw from them.  The plain ones are
caught by a thread-local ``TorchFunctionMode`` that swaps the rank's state into torch's default
generator under a lock for the call.  Calls on DTensors are left to their rules, which draw
through ``shardtensor.rng`` (tensor types register with ``draws_itself``).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["default_generator", "device_key", "draws_itself", "on_simulated_rank", "rank_generators"]


class _Rank(threading.local):
    gens: dict[str, torch.Generator] | None = None
    seed: int | None = None


_rank = _Rank()
_swap_lock = threading.Lock()


def device_key(device: torch.device | str | None) -> torch.device:
    dev = torch.device("cpu" if device is None else device)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, getattr(torch, dev.type).current_device())
    return dev


def _torch_default(dev: torch.device) -> torch.Generator:
    if dev.type == "cpu":
        return torch.default_generator
    return getattr(torch, dev.type).default_generators[dev.index]


def on_simulated_rank() -> bool:
    """Whether the caller is a rank of ``run_spmd`` (with generators of its own)."""
    return _rank.gens is not None


def default_generator(device: torch.device | str | None = None) -> torch.Generator:
    """The generator a plain random op on ``device`` uses here: the simulated rank's, else torch's."""
    dev = device_key(device)
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


_RANDOM_NAMES = frozenset("""
rand randn randint randperm rand_like randn_like randint_like normal normal_ uniform_ bernoulli bernoulli_
multinomial poisson binomial exponential_ geometric_ log_normal_ cauchy_ random_ dropout dropout_ dropout1d
dropout2d dropout3d alpha_dropout alpha_dropout_ feature_dropout feature_dropout_ feature_alpha_dropout
feature_alpha_dropout_ native_dropout rrelu rrelu_ rrelu_with_noise _standard_gamma _sample_dirichlet
_fused_dropout kaiming_uniform_ gumbel_softmax fractional_max_pool2d fractional_max_pool3d
fractional_max_pool2d_with_indices fractional_max_pool3d_with_indices
""".split())


_SELF_DRAWING: list[type] = []


def draws_itself(cls: type) -> type:
    """Register a tensor type whose random ops take the rank's generator themselves (DTensor,
    whose rules draw through ``rng.draw``): calls with one are left alone here."""
    _SELF_DRAWING.append(cls)
    return cls


def _has_self_drawing(args: tuple, kwargs: dict) -> bool:
    kinds = tuple(_SELF_DRAWING)
    return bool(kinds) and any(isinstance(a, kinds) for a in tree_flatten((args, kwargs))[0])


class _RankRandomMode(TorchFunctionMode):
    """Plain random functions on a simulated rank draw from the rank's generators."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (getattr(func, "__name__", None) not in _RANDOM_NAMES or kwargs.get("generator") is not None
                or _has_self_drawing(args, kwargs)):
            return func(*args, **kwargs)  # DTensor rules take the rank's generator themselves
        with _rank_state_in_default():
            return func(*args, **kwargs)


@contextmanager
def _rank_state_in_default() -> Iterator[None]:
    """torch's default generators hold this rank's states for the duration (under a lock)."""
    devs = [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devs.append(device_key("cuda"))
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
