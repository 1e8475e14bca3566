"""The data order: which training samples each rank reads at each step.

Invariant (exact resume, data parallel): the samples of (step, rank) are a function of the step,
the rank, the world size, the config's seed and batching fields and the sample lengths alone, so
a run resumed at step s reads exactly what an uninterrupted run reads from step s on, and the
ranks of a torchrun job read disjoint parts of the same global order.

Two orders, both over a seeded permutation of the training split per epoch (epoch e's permutation
depends on (seed, e) only):

* :class:`FixedOrder` (``tokens_per_batch`` None): ``batch_size`` samples per rank per step; the
  global sample stream is epoch 0's permutation, then epoch 1's, ...; step s of rank r reads
  positions ``s * B * W + r * B ...`` of it (B = batch_size, W = world size).

* :class:`BucketOrder` (``tokens_per_batch`` set): each epoch's permutation is cut into windows of
  about ``WINDOW_BATCHES`` batches' worth of tokens; within a window the samples are sorted by
  length (longest first, ties by permutation position) and cut greedily into batches whose
  ``rows * padded_len <= tokens_per_batch`` (padded_len: the batch's longest sample rounded up to
  ``PAD_MULTIPLE``; a sample longer than the budget makes a batch of its own); then the epoch's
  batches are shuffled (seeded by (seed, epoch) as well). The global batch stream is epoch 0's
  batches, then epoch 1's, ...; step s of rank r reads batch ``s * W + r``. Similar lengths share
  a batch (little padding), few shapes occur, and the shuffle keeps long and short batches mixed.

Each epoch's plan is computed once, when first needed, and kept (a few ints per sample).
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Sequence

import torch

PAD_MULTIPLE = 64  # bucketed batches are padded to a multiple of this many tokens
WINDOW_BATCHES = 64  # sort-by-length windows hold about this many batches' worth of tokens


def _padded(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def epoch_permutation(n: int, epoch: int, seed: int) -> list[int]:
    """Positions 0..n-1 in epoch ``epoch``'s order (a function of (seed, epoch) only)."""
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return torch.randperm(n, generator=g).tolist()


class FixedOrder:
    """``batch_size`` samples per rank per step (see the module docstring)."""

    pad_multiple = 1  # padded to the batch's longest sample, as before buckets existed

    def __init__(self, train_idx: Sequence[int], batch_size: int, seed: int) -> None:
        self.train_idx, self.batch_size, self.seed = list(train_idx), batch_size, seed
        self._epochs: dict[int, list[int]] = {}

    def epoch(self, e: int) -> list[int]:
        """Epoch ``e``'s sample indices in order (computed once)."""
        if e not in self._epochs:
            self._epochs[e] = [self.train_idx[i] for i in epoch_permutation(len(self.train_idx), e, self.seed)]
        return self._epochs[e]

    def step(self, step: int, rank: int = 0, world: int = 1) -> list[int]:
        B, n = self.batch_size, len(self.train_idx)
        start = step * B * world + rank * B
        return [self.epoch(j // n)[j % n] for j in range(start, start + B)]

    def steps_for(self, epochs: float, world: int) -> int:
        return math.ceil(epochs * len(self.train_idx) / (self.batch_size * world))


class BucketOrder:
    """Length-bucketed batches under a token budget (see the module docstring)."""

    pad_multiple = PAD_MULTIPLE

    def __init__(self, train_idx: Sequence[int], lengths: Sequence[int], tokens_per_batch: int, seed: int) -> None:
        """``lengths[i]``: tokens of sample ``train_idx[i]``."""
        if len(lengths) != len(train_idx):
            raise ValueError(f"lengths: expected one per training sample ({len(train_idx)}), found {len(lengths)}")
        self.train_idx, self.lengths = list(train_idx), list(lengths)
        self.tokens_per_batch, self.seed = tokens_per_batch, seed
        self._epochs: list[list[list[int]]] = []  # epoch -> batches -> sample indices
        self._ends: list[int] = []  # cumulative batch counts: epoch e holds batches [_ends[e-1], _ends[e])

    def plan(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s batches, each a list of sample indices (longest first)."""
        while len(self._epochs) <= epoch:
            self._epochs.append(self._plan(len(self._epochs)))
            self._ends.append((self._ends[-1] if self._ends else 0) + len(self._epochs[-1]))
        return self._epochs[epoch]

    def _plan(self, epoch: int) -> list[list[int]]:
        perm = epoch_permutation(len(self.train_idx), epoch, self.seed)
        window_tokens = WINDOW_BATCHES * self.tokens_per_batch
        batches: list[list[int]] = []
        i = 0
        while i < len(perm):
            j, tokens = i, 0
            while j < len(perm) and tokens < window_tokens:  # one window of the permutation
                tokens += self.lengths[perm[j]]
                j += 1
            batches += budget_batches(perm[i:j], self.lengths, self.tokens_per_batch)
            i = j
        g = torch.Generator().manual_seed(self.seed * 1000003 + epoch + 7919)
        order = torch.randperm(len(batches), generator=g).tolist()
        return [[self.train_idx[p] for p in batches[k]] for k in order]

    def batch(self, g: int) -> list[int]:
        """Global batch ``g`` of the stream epoch 0, epoch 1, ..."""
        while not self._ends or self._ends[-1] <= g:
            self.plan(len(self._epochs))
        e = bisect.bisect_right(self._ends, g)
        return self._epochs[e][g - (self._ends[e - 1] if e else 0)]

    def step(self, step: int, rank: int = 0, world: int = 1) -> list[int]:
        return self.batch(step * world + rank)

    def steps_for(self, epochs: float, world: int) -> int:
        """Steps of ``epochs`` passes: whole epochs' batch counts plus the fraction of the next."""
        whole = int(epochs)
        n = sum(len(self.plan(e)) for e in range(whole))
        if epochs > whole:
            n += (epochs - whole) * len(self.plan(whole))
        return max(1, math.ceil(n / world))


def budget_batches(items: Sequence[int], lengths: Sequence[int], tokens_per_batch: int) -> list[list[int]]:
    """``items`` sorted by ``lengths[item]`` (longest first; stable, so ties keep their order) and cut
    greedily into batches with ``rows * padded_len <= tokens_per_batch`` (padded_len: the batch's
    first, longest, item rounded up to PAD_MULTIPLE); an item longer than the budget is a batch alone."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for p in sorted(items, key=lambda p: -lengths[p]):
        width = _padded(lengths[batch[0]] if batch else lengths[p])
        if batch and (len(batch) + 1) * width > tokens_per_batch:
            batches.append(batch)
            batch = []
        batch.append(p)
    if batch:
        batches.append(batch)
    return batches


def make_order(train_idx: Sequence[int], lengths: Sequence[int] | None, batch_size: int,
               tokens_per_batch: int | None, seed: int) -> FixedOrder | BucketOrder:
    """The order the config asks for; ``lengths`` (per training sample) only for buckets."""
    if tokens_per_batch is None:
        return FixedOrder(train_idx, batch_size, seed)
    if lengths is None:
        raise ValueError("lengths: expected the training samples' lengths for tokens_per_batch, found None")
    return BucketOrder(train_idx, lengths, tokens_per_batch, seed)


def sample_lengths(samples: Any, indices: Sequence[int]) -> list[int]:
    """Tokens of each of ``samples[indices]``: from the shard index (no sample read) offline."""
    lengths = getattr(samples, "lengths", None)
    if lengths is not None:
        return [lengths[i] for i in indices]
    return [int(samples[i]["input_ids"].shape[0]) for i in indices]
