"""Local windows over packed (jagged) token slots, for attention within sequences without a
padded ``[B, N, ...]`` layout.

A pack's ``T`` slots hold its sequences one after another; a token of a sequence cut to ``N``
positions attends only to slots at most ``N - 1`` away in its own sequence. So the slots are
cut into ``G`` chunks of ``C``, and chunk g's queries score the slots of chunks ``g - M .. g +
A`` (``M = ceil((N - 1) / C)`` chunks back, ``A`` ahead: 0 for causal attention, ``M`` where
a token may attend forward): ``[G, C, W]`` scores with ``W = (M + 1 + A) C``, built from
slices and reshapes only (no gather, so no scatter in the backward). Against the padded layout
(``[B, N, N]`` scores, gathers both ways) this scores ``T · W`` pairs instead of ``B · N²``:
fewer when histories are short against ``N``, about the same when they fill it. Callers mask
the pairs of different sequences (:func:`chunks` / :func:`window` of each slot's sequence id).

Dimension glossary: ``T`` slots, ``G`` chunks, ``C`` slots per chunk, ``W`` window slots per
chunk, ``N`` max_seq_len.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def chunk_size(max_seq_len: int) -> int:
    """The default ``C``: the power of two at least ``(N - 1) / 2`` (so a window is the chunk
    and the two before it, ``M = 2``: ``W = 3C``, between ``1.5 (N - 1)`` and ``3 (N - 1)``
    slots), and at least 8: up to a quarter fewer pairs than ``C >= N - 1`` (``W = 2C``), in
    matmuls not yet small. On CPU at ``N = 50`` the trainer's step ran as fast at C = 16, 32
    and 64, within a shared box's noise (``benchmarks/sequential_step.py --chunks``,
    BENCHMARKS.md)."""
    half = -(-(max_seq_len - 1) // 2)
    return max(8, 1 << max(half - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class Windows:
    """The chunking of ``slots`` token slots for attention reaching ``N - 1`` slots (module
    docstring); static (shapes only)."""

    slots: int
    """T."""
    chunk: int
    """C."""
    back: int
    """M: chunks a window reaches back."""
    ahead: int
    """A: chunks a window reaches ahead."""

    @classmethod
    def of(cls, slots: int, max_seq_len: int, *, ahead: bool = False, chunk: int = 0) -> Windows:
        """The windows of ``slots`` slots for sequences of at most ``max_seq_len`` positions
        (``ahead``: also reaching forward; ``chunk``: C, 0 for :func:`chunk_size`)."""
        c = chunk or chunk_size(max_seq_len)
        back = -(-(max_seq_len - 1) // c)
        return cls(slots, c, back, back if ahead else 0)

    @property
    def groups(self) -> int:
        """G."""
        return -(-self.slots // self.chunk)

    @property
    def width(self) -> int:
        """W."""
        return (self.back + 1 + self.ahead) * self.chunk

    def distance(self) -> jax.Array:
        """int32 ``[C, W]``: query slot minus key slot of each (query, window) pair."""
        c = self.chunk
        i = jnp.arange(c, dtype=jnp.int32)[:, None]
        j = jnp.arange(self.width, dtype=jnp.int32)[None, :]
        return i + self.back * c - j

    def chunks(self, x: jax.Array, fill=0) -> jax.Array:
        """``[T, ...] -> [G, C, ...]`` (slots past ``T`` are ``fill``)."""
        g, c = self.groups, self.chunk
        x = jnp.pad(x, _rows(x, 0, g * c - self.slots), constant_values=fill)
        return x.reshape(g, c, *x.shape[1:])

    def window(self, x: jax.Array, fill=0) -> jax.Array:
        """``[T, ...] -> [G, W, ...]``: the slots of chunks ``g - M .. g + A`` for each chunk
        g (slots outside ``[0, T)`` are ``fill``)."""
        g, c = self.groups, self.chunk
        after = g * c - self.slots + self.ahead * c
        x = jnp.pad(x, _rows(x, self.back * c, after), constant_values=fill)
        parts = [x[p * c : p * c + g * c] for p in range(self.back + 1 + self.ahead)]
        return jnp.concatenate([p.reshape(g, c, *x.shape[1:]) for p in parts], axis=1)

    def unchunk(self, x_gc: jax.Array) -> jax.Array:
        """``[G, C, ...] -> [T, ...]``: :meth:`chunks`' inverse."""
        return x_gc.reshape(-1, *x_gc.shape[2:])[: self.slots]

    def unwindow(self, x_gw: jax.Array) -> jax.Array:
        """``[G, W, ...] -> [T, ...]``: :meth:`window`'s transpose (each slot the sum of its
        entries in every window), as a backward pass needs it."""
        like = jax.ShapeDtypeStruct((self.slots, *x_gw.shape[2:]), x_gw.dtype)
        (out,) = jax.linear_transpose(self.window, like)(x_gw)
        return out


def _rows(x: jax.Array, before: int, after: int) -> list[tuple[int, int]]:
    return [(before, after)] + [(0, 0)] * (x.ndim - 1)
