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
once (transiently), dropout masks included (``rules.nn``).

The simulated world gives each rank its own default generators (``comm/generators.py``).
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable, TypeVar

import torch

from . import comm
from .comm.generators import default_generator, device_key, on_simulated_rank

if TYPE_CHECKING:
    from .mesh import DeviceMesh

__all__ = ["default_generator", "draw", "agreed"]

T = TypeVar("T")


# -- drawing on DTensors -------------------------------------------------------------------

def _fingerprint(g: torch.Generator) -> int:
    state = g.get_state().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little") >> 2


def _all_equal(value: int, mesh: "DeviceMesh", device: torch.device) -> bool:
    """Whether every rank of ``mesh`` holds the same 62-bit ``value`` (one 16-byte all-reduce)."""
    t = comm.all_reduce(torch.tensor([value, -value], dtype=torch.int64, device=device), "max", mesh, None)
    return int(t[0]) == -int(t[1])


def draw(mesh: "DeviceMesh", generator: torch.Generator | None, device: torch.device | str | None,
         fn: Callable[[torch.Generator], T]) -> T:
    """``fn(g)`` with a generator state every rank of ``mesh`` agrees on (see the module docstring).

    ``fn`` must draw the same amount on every rank (the global tensor, or a seed).  Each rank's
    own generator ends where one device's would after ``fn``.
    """
    dev = device_key(device)
    own = generator if generator is not None else default_generator(dev)
    if mesh.size() == 1:
        return fn(own)
    first = all(c == 0 for c in mesh.get_coordinate() or [0])
    if generator is not None and on_simulated_rank() and _all_equal(id(generator), mesh, dev):
        # one generator object shared by the simulated ranks: only coordinate 0 may touch it
        return _from_first(mesh, own, dev, fn, first, advance_own=False)
    if _all_equal(_fingerprint(own), mesh, dev):
        return fn(own)
    return _from_first(mesh, own, dev, fn, first, advance_own=True)


def _from_first(mesh: "DeviceMesh", own: torch.Generator, dev: torch.device, fn: Callable[[torch.Generator], T],
                first: bool, advance_own: bool) -> T:
    """Coordinate 0 draws from its generator; the others from a copy of its state."""
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
    data = t.detach().contiguous()
    digest = hashlib.blake2b(data.cpu().reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8)
    digest.update(repr((tuple(t.shape), t.dtype)).encode())
    if _all_equal(int.from_bytes(digest.digest(), "little") >> 2, mesh, t.device):
        return t
    return comm.broadcast(data, 0, mesh, None)
