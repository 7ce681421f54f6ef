"""Jagged batches of whole histories under a token budget, with fixed shapes.

Shapes (dimension glossary): ``B`` sequences per batch (``PackConfig.max_sequences``, fixed),
``T_pad`` token slots per batch (fixed: ``token_budget`` rounded up to a multiple of
``block_size``; or, with ``pad_tokens='block'``, the batch's real token count rounded up, so a
few shapes), ``T`` a batch's real tokens (``T <= token_budget``).

Layout of :class:`JaggedBatch` (every padding entry is 0):
  * ``values`` int32 [T_pad]: the item ids of the batch's sequences, one after another; slots
    ``[T, T_pad)`` are padding, only at the tail (no padding inside or between sequences).
  * ``offsets`` int32 [B + 1]: sequence ``b`` is ``values[offsets[b]:offsets[b + 1]]``; padding
    sequences (``b`` past the real ones) are empty, so ``offsets[b] == T`` for them and
    ``offsets[B] == T`` (the tail slots belong to no sequence).
  * ``targets`` int32 [T_pad]: the item each token should predict, 0 where none. With
    ``targets='next'`` it is the next item of the same sequence, and at a sequence's last token
    its final target (the held-out item) when one is given, else 0; with ``targets='final'``
    only a sequence's last token has one, its final target (evaluation of held-out items).
  * ``num_targets`` int32 [B]: the non-zero targets of each sequence (0 for padding).
  * ``weights`` float32 [B]: 1 for a real sequence, 0 for a padding one.
  * ``user_rows`` int32 [B]: the row of each sequence in the packed ``Histories``, -1 for padding.
  * ``side``: name -> [T_pad] per-token columns (the histories' side columns, and ``time``
    when asked for), aligned with ``values``.

Packing (:class:`Packer`): each epoch visits every user once, in an order that is a pure
function of ``(seed, epoch)`` (users sorted by a splitmix64 hash of ``(seed, epoch, row)``; in
row order without ``shuffle``), and cuts that order greedily into batches: a batch takes the next
users while their tokens fit ``token_budget`` and there are fewer than ``B``. A user is never
split across batches; a history longer than the budget is cut to its most recent
``token_budget`` events (counted in ``truncated_users`` / ``truncated_events``). The batch at
global step ``s`` is a pure function of ``(histories, config, seed, s)``, so resuming at ``s``
gives the same data as running through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

import numpy as np

from data import counter_rng as rng
from data.sequences.histories import Histories, HistoryError

_S_ORDER = 0x5E0  # stream id of the epoch order hash


class JaggedBatch(NamedTuple):
    """Packed sequences (module docstring). A NamedTuple, so a jax pytree without registration."""

    values: np.ndarray
    """int32 [T_pad] item ids, 0 in the tail padding."""
    offsets: np.ndarray
    """int32 [B + 1] sequence boundaries; padding sequences are empty at the end."""
    targets: np.ndarray
    """int32 [T_pad] the item each token predicts, 0 for none."""
    num_targets: np.ndarray
    """int32 [B] non-zero targets per sequence."""
    weights: np.ndarray
    """float32 [B] 1 for a real sequence, 0 for a padding one."""
    user_rows: np.ndarray
    """int32 [B] row in the packed histories, -1 for padding."""
    side: dict[str, np.ndarray]
    """name -> [T_pad] per-token side columns."""

    @property
    def num_tokens(self) -> int:
        """T: the real tokens (``offsets[-1]``)."""
        return int(self.offsets[-1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackConfig:
    """How histories are packed into :class:`JaggedBatch` es (``data/sequences/jagged.py``)."""

    token_budget: int = 8192
    """Most real tokens in one batch; longer histories are cut to their most recent events."""
    max_sequences: int = 256
    """B: sequences per batch (the fixed batch axis; short batches are padded with empty ones)."""
    block_size: int = 128
    """T_pad is a multiple of this (a kernel's token block)."""
    pad_tokens: Literal["budget", "block"] = "budget"
    """``budget``: T_pad = token_budget rounded up to a block (one shape for every batch);
    ``block``: T_pad = the batch's own tokens rounded up to a block (fewer padded tokens, up to
    ``token_budget / block_size`` shapes)."""
    shuffle: bool = True
    """Visit users in a seeded order per epoch (False: in row order, e.g. for evaluation)."""

    def __post_init__(self):
        for name in ("token_budget", "max_sequences", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"PackConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.pad_tokens not in ("budget", "block"):
            raise ValueError(
                f"PackConfig.pad_tokens must be 'budget' or 'block', got {self.pad_tokens!r}"
            )

    @property
    def max_tokens_padded(self) -> int:
        return -(-self.token_budget // self.block_size) * self.block_size


class Packer:
    """Index-based packing of ``hist`` into batches (module docstring).

    Args:
        hist: The histories; each is one sequence.
        cfg: Budget, batch size, block size, order.
        seed: Seed of the epoch orders.
        final_targets: int [U] per-user held-out item (0 = none), the target after the history's
            last event; None: no final targets.
        targets: ``next`` (every token predicts the next; training) or ``final`` (only the last
            token, its final target; evaluation).
        side: names of ``hist.side`` columns to carry (default all); ``time`` means ``hist.times``.
    """

    def __init__(
        self,
        hist: Histories,
        cfg: PackConfig,
        *,
        seed: int = 0,
        final_targets: np.ndarray | None = None,
        targets: Literal["next", "final"] = "next",
        side: Sequence[str] | None = None,
    ):
        if targets not in ("next", "final"):
            raise ValueError(f"Packer: targets must be 'next' or 'final', got {targets!r}")
        if targets == "final" and final_targets is None:
            raise ValueError("Packer: targets='final' needs final_targets")
        if final_targets is not None:
            final_targets = np.asarray(final_targets)
            if final_targets.shape != (hist.num_users,):
                raise HistoryError(
                    f"Packer: final_targets has shape {final_targets.shape}, expected "
                    f"[{hist.num_users}] (one per user)"
                )
            if (final_targets < 0).any() or (final_targets > hist.n_items).any():
                raise HistoryError(f"Packer: final_targets must be in 0..{hist.n_items}")
        names = list(hist.side) if side is None else list(side)
        for name in names:
            if (hist.times is None) if name == "time" else (name not in hist.side):
                raise HistoryError(f"Packer: no side column {name!r} in the histories")
        self.hist, self.cfg, self.seed = hist, cfg, int(seed)
        self.targets_mode = targets
        self.final_targets = (
            np.zeros(hist.num_users, np.int32)
            if final_targets is None
            else final_targets.astype(np.int32)
        )
        self.side_names = names
        full = hist.lengths()
        self.lengths = np.minimum(full, cfg.token_budget)
        self.truncated_users = int((full > cfg.token_budget).sum())
        self.truncated_events = int((full - self.lengths).sum())
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._counts: list[int] = []

    # ------------------------------------------------------------------------------- order

    def epoch_order(self, epoch: int) -> np.ndarray:
        """int64 [U]: the user rows in the order epoch ``epoch`` visits them."""
        u = self.hist.num_users
        if not self.cfg.shuffle:
            return np.arange(u)
        key = np.uint64(rng.salt(_S_ORDER, self.seed, epoch))
        h = rng.mix(np.arange(u, dtype=np.uint64) * rng.U64_GOLDEN + key)
        return np.argsort(h, kind="stable")

    def epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(order, cuts)``: batch ``k`` of the epoch packs rows ``order[cuts[k]:cuts[k+1]]``."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch not in self._plans:
            order = self.epoch_order(epoch)
            cum = np.concatenate([[0], np.cumsum(self.lengths[order])])
            cuts, i, u = [0], 0, order.shape[0]
            while i < u:
                # The largest j with tokens(i..j) <= budget, at most B users; j > i since every
                # (cut) history fits the budget.
                j = int(np.searchsorted(cum, cum[i] + self.cfg.token_budget, side="right")) - 1
                i = min(j, i + self.cfg.max_sequences)
                cuts.append(i)
            if len(self._plans) >= 4:  # keep a few epochs' plans, not all
                self._plans.pop(next(iter(self._plans)))
            self._plans[epoch] = (order, np.array(cuts, np.int64))
        return self._plans[epoch]

    def num_batches(self, epoch: int = 0) -> int:
        """Batches in epoch ``epoch`` (the greedy cut depends on the epoch's order)."""
        while len(self._counts) <= epoch:  # kept for every epoch seen: one int each
            e = len(self._counts)
            self._counts.append(int(self.epoch_plan(e)[1].shape[0] - 1))
        return self._counts[epoch]

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, k)`` of global step ``step`` (epochs follow one another)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.hist.num_users == 0:
            raise HistoryError("Packer: no histories to pack")
        epoch = 0
        while step >= (n := self.num_batches(epoch)):
            step -= n
            epoch += 1
        return epoch, step

    # ------------------------------------------------------------------------------- batches

    def batch(self, step: int) -> JaggedBatch:
        """The batch of global step ``step``."""
        return self.batch_at(*self.position(step))

    def batches(self, start_step: int = 0) -> Iterator[JaggedBatch]:
        """Batches from global step ``start_step`` on, without end."""
        epoch, k = self.position(start_step)
        while True:
            for kk in range(k, self.num_batches(epoch)):
                yield self.batch_at(epoch, kk)
            epoch, k = epoch + 1, 0

    def epoch_batches(self, epoch: int = 0) -> Iterator[JaggedBatch]:
        """The batches of one epoch (every user exactly once)."""
        for k in range(self.num_batches(epoch)):
            yield self.batch_at(epoch, k)

    def batch_at(self, epoch: int, k: int) -> JaggedBatch:
        """Batch ``k`` of epoch ``epoch``."""
        order, cuts = self.epoch_plan(epoch)
        if not 0 <= k < cuts.shape[0] - 1:
            raise ValueError(f"epoch {epoch} has {cuts.shape[0] - 1} batches, asked for {k}")
        return self.pack_rows(order[cuts[k] : cuts[k + 1]])

    def pack_rows(self, rows: np.ndarray) -> JaggedBatch:
        """One batch of the user rows ``rows`` (at most B of them, within the budget)."""
        cfg, hist = self.cfg, self.hist
        rows = np.asarray(rows, np.int64)
        n = self.lengths[rows]
        total, b = int(n.sum()), cfg.max_sequences
        if rows.shape[0] > b or total > cfg.token_budget:
            raise ValueError(
                f"pack_rows: {rows.shape[0]} sequences / {total} tokens exceed B = {b} / "
                f"token_budget = {cfg.token_budget}"
            )
        if cfg.pad_tokens == "budget":
            t_pad = cfg.max_tokens_padded
        else:
            t_pad = max(-(-total // cfg.block_size), 1) * cfg.block_size
        ends = np.cumsum(n)
        # Event index of every token: the last n[r] events of each user.
        first = hist.offsets[rows + 1] - n
        idx = np.repeat(first - (ends - n), n) + np.arange(total)
        is_last = np.zeros(total, bool)
        is_last[ends - 1] = True
        final = np.repeat(self.final_targets[rows], n)
        values = np.zeros(t_pad, np.int32)
        values[:total] = hist.items[idx]
        targets = np.zeros(t_pad, np.int32)
        if self.targets_mode == "next":
            nxt = hist.items[np.minimum(idx + 1, max(hist.num_events - 1, 0))]
            targets[:total] = np.where(is_last, final, nxt)
        else:
            targets[:total] = np.where(is_last, final, 0)
        seq_of_token = np.repeat(np.arange(rows.shape[0]), n)
        num_targets = np.zeros(b, np.int32)
        num_targets[: rows.shape[0]] = np.bincount(
            seq_of_token[targets[:total] > 0], minlength=rows.shape[0]
        )
        offsets = np.full(b + 1, total, np.int32)
        offsets[0] = 0
        offsets[1 : rows.shape[0] + 1] = ends
        weights = np.zeros(b, np.float32)
        weights[: rows.shape[0]] = 1.0
        user_rows = np.full(b, -1, np.int32)
        user_rows[: rows.shape[0]] = rows
        side = {}
        for name in self.side_names:
            col = hist.times if name == "time" else hist.side[name]
            out = np.zeros(t_pad, col.dtype)
            out[:total] = col[idx]
            side[name] = out
        return JaggedBatch(values, offsets, targets, num_targets, weights, user_rows, side)
