"""Model shapes to plan for: a Llama-style decoder of any size, built on the meta device.

``build(spec)`` reads ``NAME[:key=value,...]``: ``demo`` (the demo's TinyLM), ``gpt`` (12 layers,
d=768, 12 heads, vocabulary 50257, sequence 1024), ``llama3-8b`` (32 layers, d=4096, 32 heads, 8 KV
heads, FFN 14336, vocabulary 128256, sequence 8192), and ``llama`` (a small one) with any of
``layers, dim, heads, kv_heads, ffn, vocab, seq, batch, dtype`` overridden, e.g.
``llama3-8b:layers=4,batch=16``.  It returns the model (parameters on meta) and a global batch of
token ids (meta).  The decoder is RMSNorm, grouped-query attention through
``scaled_dot_product_attention`` and a SwiGLU MLP; positions are left out (they do not change
what is sharded or moved).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Shape", "PRESETS", "Decoder", "parse", "build"]


@dataclass(frozen=True)
class Shape:
    layers: int = 2
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 172
    vocab: int = 256
    seq: int = 32
    batch: int = 8
    dtype: str = "float32"


PRESETS = {
    "llama": Shape(),
    "gpt": Shape(layers=12, dim=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, seq=1024, batch=64),
    "llama3-8b": Shape(layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192, batch=64,
                       dtype="bfloat16"),
}


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.hd = s.dim // s.heads
        self.q = nn.Linear(s.dim, s.heads * self.hd, bias=False)
        self.k = nn.Linear(s.dim, s.kv_heads * self.hd, bias=False)
        self.v = nn.Linear(s.dim, s.kv_heads * self.hd, bias=False)
        self.o = nn.Linear(s.heads * self.hd, s.dim, bias=False)
        self.group = s.heads // s.kv_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.group > 1:  # each KV head serves ``group`` query heads (as Hugging Face's repeat_kv)
            k, v = (y.repeat_interleave(self.group, dim=1) for y in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(s.dim, s.ffn, bias=False), nn.Linear(s.dim, s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(s.dim), Attention(s)
        self.mlp_norm, self.mlp = nn.RMSNorm(s.dim), MLP(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm, self.head = nn.RMSNorm(s.dim), nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def parse(spec: str) -> tuple[str, Shape]:
    """``NAME[:key=value,...]`` -> (name, shape); a clear error naming what is wrong."""
    name, _, rest = spec.partition(":")
    if name != "demo" and name not in PRESETS:
        raise ValueError(f"model spec {spec!r}: unknown model {name!r}; one of demo, {', '.join(PRESETS)}")
    shape = PRESETS.get(name, Shape())
    known = {f.name: f.type for f in fields(Shape)}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise ValueError(f"model spec {spec!r}: {item!r} is not key=value with a key among {', '.join(known)}")
        if key != "dtype" and not value.isdigit():
            raise ValueError(f"model spec {spec!r}: {key} needs a positive integer, got {value!r}")
        new: dict[str, Any] = {key: value if key == "dtype" else int(value)}
        shape = replace(shape, **new)
    if name != "demo" and (min(shape.layers, shape.dim, shape.heads, shape.kv_heads, shape.ffn, shape.vocab, shape.seq,
                               shape.batch) < 1 or shape.dim % shape.heads or shape.heads % shape.kv_heads):
        raise ValueError(f"model spec {spec!r}: sizes must be positive, dim must divide into heads and heads into "
                         "kv_heads")
    return name, shape


def build(spec: str) -> tuple[nn.Module, torch.Tensor]:
    """The model of ``spec`` on meta and a meta global batch of token ids for it."""
    name, s = parse(spec)
    if name == "demo":
        from . import tiny_lm as T

        with torch.device("meta"):
            return T.TinyLM(), torch.zeros(T.BATCH, T.SEQ, dtype=torch.long)
    dtype = getattr(torch, s.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model spec {spec!r}: unknown dtype {s.dtype!r}")
    with torch.device("meta"):
        model = Decoder(s).to(dtype)
        return model, torch.zeros(s.batch, s.seq, dtype=torch.long)
