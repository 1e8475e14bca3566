"""Per-slot fingerprints of captured hidden states (the ``fingerprint`` section of the contract).

For every captured slot (boundary) the fingerprint records the mean and the spread of the per-token
RMS, and the means of a few fixed channels. ``eyas trace`` and ``eyas doctor`` hold live captures
against it: a wrong boundary, a post-norm capture or a missing embedding scale moves the RMS by
large factors, and swapped slots show up in the channel means.

Which tokens count: **every real token except the first of each sequence** (no padding), prompt
and answer alike, not only the loss-masked ones. At serving time the drafter sees the hidden states
of all tokens (the prompt during prefill, the answer while decoding), and that is what a live trace
measures; a statistic of answer tokens only would flag prompt-heavy requests as drift. The first
token is left out because it is the attention sink: its residual stream carries a "massive
activation" (SmolLM2-135M, boundary 15: RMS ~1040 at position 0, ~6.5 everywhere else) that
would dominate both the mean and the spread (std 74 with it, about 1 without). Use
:meth:`FingerprintAccumulator.update_sequence` / :meth:`~FingerprintAccumulator.update_batch`
(they apply this rule); whoever compares live values against the fingerprint must apply it too.

Sums are kept in float64 and are plain sums, so accumulators from several ranks or shards merge
exactly by addition (:meth:`FingerprintAccumulator.merge`), and :meth:`state` / :meth:`from_state`
round-trip them through JSON without loss (Python floats print exactly).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from eyas.contract import SlotFingerprint

DEFAULT_NUM_CHANNELS = 8


def default_channels(hidden_size: int, num: int = DEFAULT_NUM_CHANNELS) -> list[int]:
    """``num`` channel indices evenly spaced over ``0..hidden_size-1`` (ends included)."""
    if hidden_size <= num:
        return list(range(hidden_size))
    return sorted({round(i * (hidden_size - 1) / (num - 1)) for i in range(num)})


def fingerprint_token_mask(attention_mask: Tensor) -> Tensor:
    """[B, T] attention mask -> [B, T] bool: the tokens a fingerprint counts (real tokens except the
    first real one of each row, the attention sink; see the module docstring)."""
    real = attention_mask.bool()
    first = real & (real.long().cumsum(-1) == 1)
    return real & ~first


class FingerprintAccumulator:
    """Running per-slot statistics over captured tokens.

    >>> acc = FingerprintAccumulator([2, 15, 27], hidden_size=576)
    >>> acc.update_sequence(slots)   # [T, S, H]: one sequence, S slots in boundary order
    >>> acc.update(tokens)           # [N, S, H]: tokens already selected by the caller
    >>> acc.result()                 # list[SlotFingerprint], one per slot
    """

    def __init__(self, boundaries: Sequence[int], hidden_size: int,
                 channels: Sequence[int] | None = None) -> None:
        self.boundaries = [int(b) for b in boundaries]
        self.hidden_size = int(hidden_size)
        self.channels = [int(c) for c in (channels if channels is not None
                                          else default_channels(self.hidden_size))]
        bad = [c for c in self.channels if not 0 <= c < self.hidden_size]
        if bad:
            raise ValueError(f"fingerprint channels {bad} out of range 0..{self.hidden_size - 1}")
        s, c = len(self.boundaries), len(self.channels)
        self.count = 0
        self.rms_sum = torch.zeros(s, dtype=torch.float64)  # [S]  sum over tokens of RMS
        self.rms_sq_sum = torch.zeros(s, dtype=torch.float64)  # [S]  sum over tokens of RMS^2
        self.channel_sum = torch.zeros(s, c, dtype=torch.float64)  # [S, C]

    @property
    def num_slots(self) -> int:
        return len(self.boundaries)

    def update(self, slots: Tensor, mask: Tensor | None = None) -> None:
        """Add exactly these tokens: ``slots`` [N, S, H], or [B, T, S, H] with a bool/0-1 ``mask``
        [B, T] selecting tokens; any float dtype, any device. (No first-token rule here.)"""
        if mask is not None:
            slots = slots[mask.bool()]  # [B, T, S, H] -> [N, S, H]
        if slots.dim() != 3 or slots.shape[1:] != (self.num_slots, self.hidden_size):
            raise ValueError(
                f"fingerprint update: expected slots [N, {self.num_slots}, {self.hidden_size}], "
                f"found {list(slots.shape)}"
            )
        if slots.shape[0] == 0:
            return
        x = slots.float()  # bf16 -> fp32 for the square; per-token sums over H are exact enough
        rms = x.pow(2).mean(dim=-1).sqrt().double()  # [N, S]
        self.rms_sum += rms.sum(0).cpu()
        self.rms_sq_sum += rms.pow(2).sum(0).cpu()
        idx = torch.tensor(self.channels, device=x.device)
        self.channel_sum += x.index_select(-1, idx).double().sum(0).cpu()  # [S, C]
        self.count += int(slots.shape[0])

    def update_sequence(self, slots: Tensor) -> None:
        """One sequence [T, S, H] (real tokens only, position 0 first): all but the first token."""
        self.update(slots[1:])

    def update_batch(self, slots: Tensor, attention_mask: Tensor) -> None:
        """A padded batch [B, T, S, H] (left or right padding): every real token but the first of each row."""
        self.update(slots, fingerprint_token_mask(attention_mask))

    def _check_compatible(self, other: "FingerprintAccumulator") -> None:
        mine = (self.boundaries, self.hidden_size, self.channels)
        theirs = (other.boundaries, other.hidden_size, other.channels)
        if mine != theirs:
            raise ValueError(
                f"cannot merge fingerprints of different captures: (boundaries, hidden, channels) "
                f"{mine} vs {theirs}"
            )

    def merge(self, other: "FingerprintAccumulator") -> "FingerprintAccumulator":
        """Add ``other``'s tokens into this accumulator (in place; returns self)."""
        self._check_compatible(other)
        self.count += other.count
        self.rms_sum += other.rms_sum
        self.rms_sq_sum += other.rms_sq_sum
        self.channel_sum += other.channel_sum
        return self

    @classmethod
    def merged(cls, parts: Sequence["FingerprintAccumulator"]) -> "FingerprintAccumulator":
        """A new accumulator holding the sum of ``parts`` (added in the given order)."""
        if not parts:
            raise ValueError("merged: expected at least one accumulator")
        out = cls(parts[0].boundaries, parts[0].hidden_size, parts[0].channels)
        for p in parts:
            out.merge(p)
        return out

    def all_reduce(self) -> None:
        """Sum across torch.distributed ranks (no-op when not initialised)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        flat = torch.cat([torch.tensor([float(self.count)], dtype=torch.float64), self.rms_sum,
                          self.rms_sq_sum, self.channel_sum.flatten()])
        if dist.get_backend() == "nccl":
            flat = flat.cuda()
        dist.all_reduce(flat)
        flat = flat.cpu()
        s = self.num_slots
        self.count = int(round(flat[0].item()))
        self.rms_sum = flat[1:1 + s].clone()
        self.rms_sq_sum = flat[1 + s:1 + 2 * s].clone()
        self.channel_sum = flat[1 + 2 * s:].reshape(s, -1).clone()

    # -- serialisation (progress files of a capture run) ----------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "boundaries": self.boundaries, "hidden_size": self.hidden_size, "channels": self.channels,
            "count": self.count, "rms_sum": self.rms_sum.tolist(),
            "rms_sq_sum": self.rms_sq_sum.tolist(), "channel_sum": self.channel_sum.tolist(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "FingerprintAccumulator":
        acc = cls(state["boundaries"], state["hidden_size"], state["channels"])
        acc.count = int(state["count"])
        acc.rms_sum = torch.tensor(state["rms_sum"], dtype=torch.float64)
        acc.rms_sq_sum = torch.tensor(state["rms_sq_sum"], dtype=torch.float64)
        acc.channel_sum = torch.tensor(state["channel_sum"], dtype=torch.float64).reshape(
            len(acc.boundaries), len(acc.channels))
        return acc

    # -- result -----------------------------------------------------------------------------------

    def result(self) -> list[SlotFingerprint]:
        """One :class:`SlotFingerprint` per slot, in slot order. std is the population std."""
        if self.count == 0:
            raise ValueError("fingerprint: no tokens were accumulated")
        n = float(self.count)
        out = []
        for i, b in enumerate(self.boundaries):
            mean = self.rms_sum[i].item() / n
            var = max(self.rms_sq_sum[i].item() / n - mean * mean, 0.0)  # clamp rounding below 0
            out.append(SlotFingerprint(
                boundary=b, rms_mean=mean, rms_std=math.sqrt(var), channels=list(self.channels),
                channel_means=[v / n for v in self.channel_sum[i].tolist()], num_tokens=self.count,
            ))
        return out
