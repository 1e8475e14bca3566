"""Speculative decoding (EAGLE-3 drafter, EAGLE-2 dynamic tree) and the plain decoder it is
measured against, over the same :class:`~eyas.engine.target.Target`.

One round, with committed tokens x_0 .. x_m (the target has seen x_0 .. x_{m-1}):

    draft    the drafter proposes a tree rooted at x_m (tree.py)
    verify   ONE target forward over [x_m, tree nodes] at positions m + depth, each node attending the
             committed prefix, its ancestors and itself: p at every node, features f at every node
    accept   the longest path the target agrees with (sampling.py), then the bonus token sampled from
             the target where the path stops: a + 1 new tokens for a accepted drafts
    commit   the target's cache keeps x_m and the accepted nodes; the drafter re-reads the accepted
             tokens with the TARGET's features from verification (entry t reads (f_t, x_{t+1}), as in
             training), which also rolls its cache back past the rejected nodes.

Both functions return a :class:`GenerationResult`; ``result.stats`` holds the statistics of stats.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from eyas.drafter.model import Eagle3Drafter
from eyas.engine.sampling import (
    GREEDY, AcceptRule, SamplingParams, accept_greedy, accept_sampling, probabilities, rejection_rule, sample,
)
from eyas.engine.stats import STOP_MAX_LENGTH, STOP_MAX_NEW_TOKENS, Clock, GenerationStats
from eyas.engine.stopping import StopCriteria
from eyas.engine.target import Target
from eyas.engine.tree import DraftState, TreeSpec


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens (prompt excluded); the stop token (EOS...) included
    stats: GenerationStats


def _prompt_list(input_ids: Sequence[int] | Tensor) -> list[int]:
    ids = input_ids.flatten().tolist() if isinstance(input_ids, Tensor) else [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids: expected at least one prompt token, found none")
    return ids


def _next_token(logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's own choice from logits [V]: argmax, or a draw from p."""
    if sampling.greedy:
        return int(logits.argmax())
    return sample(probabilities(logits, sampling), generator)


class _Output:
    """The new tokens, streamed and checked one by one."""

    def __init__(self, stop: StopCriteria, on_token: Callable[[int], None] | None) -> None:
        self.tokens: list[int] = []
        self.stop, self.on_token = stop, on_token
        self.reason: str | None = None

    def emit(self, tokens: list[int]) -> int:
        """Append tokens until a stop condition fires; returns how many were kept."""
        for i, t in enumerate(tokens):
            self.tokens.append(t)
            if self.on_token is not None:
                self.on_token(t)
            self.reason = self.stop.check(self.tokens)
            if self.reason:
                return i + 1
        return len(tokens)


def _begin(target: Target, input_ids: Sequence[int] | Tensor, max_new_tokens: int, stop: StopCriteria,
           on_token: Callable[[int], None] | None) -> tuple[list[int], int, GenerationStats, Clock, _Output]:
    """The prompt as a list; max_len, the length the sequence may reach (prompt + new tokens, the
    last at position max_len - 1); fresh statistics, clock and output."""
    x = _prompt_list(input_ids)
    if len(x) > target.max_length:
        raise ValueError(f"prompt of {len(x)} tokens is longer than the target's context ({target.max_length} positions)")
    stats = GenerationStats(prompt_tokens=len(x))
    return x, min(target.max_length, len(x) + max_new_tokens), stats, Clock(stats, target.device), _Output(stop, on_token)


def _end(out: _Output, stats: GenerationStats, clock: Clock) -> GenerationResult:
    stats.new_tokens, stats.stop_reason = len(out.tokens), out.reason
    clock.finish()
    return GenerationResult(out.tokens, stats)


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: Eagle3Drafter,
    input_ids: Sequence[int] | Tensor,
    *,
    tree: TreeSpec = TreeSpec.chain(5),
    sampling: SamplingParams = GREEDY,
    max_new_tokens: int = 256,
    eos_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    on_token: Callable[[int], None] | None = None,
    generator: torch.Generator | None = None,
    accept_rule: AcceptRule = rejection_rule,
) -> GenerationResult:
    """Generate from ``input_ids`` (a prompt of target token ids) with speculative decoding.

    Greedy (``sampling.temperature == 0``) output is token-identical to :func:`plain_generate`;
    sampled output has the target's distribution. The sequence never grows past
    ``target.max_length`` tokens (stop reason ``max_length``). ``on_token`` sees every new token as it
    is committed; ``decode`` (token ids -> text) is needed for ``stop_strings``. ``accept_rule`` is
    the per-child rule of sampling verification (tests inject broken ones).
    """
    if drafter.config.num_slots != target.spec.num_slots or drafter.config.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter (num_slots={drafter.config.num_slots}, vocab_size={drafter.config.vocab_size}) does not "
            f"fit the target (num_slots={target.spec.num_slots}, vocab_size={target.vocab_size})"
        )
    drafter_device = drafter.fc.weight.device
    if drafter_device != target.device:
        raise ValueError(f"drafter on {drafter_device}, target on {target.device}: move the drafter with .to()")
    x, max_len, stats, clock, out = _begin(target, input_ids, max_new_tokens,
                                           StopCriteria(max_new_tokens, eos_token_ids, stop_strings, decode), on_token)
    n = len(x)

    if n < max_len:
        # Prefill: p and f at every prompt position; x_n comes from the target alone.
        with clock("prefill"):
            logits, f = target.prefill(torch.tensor([x], device=target.device))  # [1, n, V], [1, n, S*H]
            x_next = _next_token(logits[0, -1], sampling, generator)
            stats.rounds += 1
        out.emit([x_next])
        x.append(x_next)
        if out.reason is None:
            with clock("draft"):
                draft = DraftState(drafter, max_len + tree.scratch_slots)
                draft.extend(x[1:], f[0])  # entry t reads (f_t, x_{t+1}), t = 0 .. n-1
    m = len(x) - 1  # the last committed token is x_m, at position m, not yet seen by the target

    while out.reason is None:
        # gamma: the deepest draft this round; a accepted drafts + the bonus must fit in max_len.
        gamma = min(tree.depth, max_len - 2 - m)
        if gamma < 0:
            out.reason = STOP_MAX_NEW_TOKENS if len(out.tokens) >= max_new_tokens else STOP_MAX_LENGTH
            break
        with clock("draft"):
            t = draft.draft(tree, gamma, sampling, generator, target.vocab_size)  # the tree; t.tokens[0] = x_m
        with clock("verify"):
            # logits [1, N+1, V], f [1, N+1, S*H]: after each node, given its ancestors
            logits, f = target.forward(t.tokens[None], (m + t.depths)[None], t.ancestor_mask())
        with clock("bookkeeping"):
            tokens = t.tokens.tolist()
            if sampling.greedy:
                path, x_bonus = accept_greedy(tokens, t.children, logits[0])
            else:
                path, x_bonus = accept_sampling(tokens, t.children, logits[0], t.proposals, sampling,
                                                generator, accept_rule)
            target.keep(path)  # x_m and the accepted nodes, in path order
            accepted = [tokens[i] for i in path[1:]] + [x_bonus]  # x_{m+1} .. x_{m+a+1}
            kept = out.emit(accepted)
            stats.record_round(t.depth, len(path) - 1, kept)
        if out.reason is not None:
            break
        with clock("draft"):
            # The drafter re-reads x_{m+1} .. x_{m+a+1} with the target's f_m .. f_{m+a}.
            draft.extend(accepted, f[0, path])
        m += len(accepted)
        assert draft.length == target.cache_len == m, (draft.length, target.cache_len, m)

    if out.reason is None:  # the prompt filled the context
        out.reason = STOP_MAX_LENGTH
    return _end(out, stats, clock)


@torch.no_grad()
def plain_generate(
    target: Target,
    input_ids: Sequence[int] | Tensor,
    *,
    sampling: SamplingParams = GREEDY,
    max_new_tokens: int = 256,
    eos_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    on_token: Callable[[int], None] | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """The baseline: one target forward per token, no drafter, no feature capture."""
    x, max_len, stats, clock, out = _begin(target, input_ids, max_new_tokens,
                                           StopCriteria(max_new_tokens, eos_token_ids, stop_strings, decode), on_token)
    if len(x) < max_len:
        with clock("prefill"):
            logits, _ = target.prefill(torch.tensor([x], device=target.device), capture=False)
        while True:
            with clock("bookkeeping"):
                x.append(_next_token(logits[0, -1], sampling, generator))
                stats.rounds += 1
                out.emit(x[-1:])
            if out.reason is not None or len(x) >= max_len:
                break
            with clock("verify"):
                m = len(x) - 1
                logits, _ = target.forward(torch.tensor([[x[m]]], device=target.device),
                                           torch.tensor([[m]], device=target.device), capture=False)
    if out.reason is None:
        out.reason = STOP_MAX_NEW_TOKENS if len(out.tokens) >= max_new_tokens else STOP_MAX_LENGTH
    return _end(out, stats, clock)
