"""Continuous batching for a server: requests join and leave a running batch at every step
(:class:`RowBatch`, over :class:`~eyas.engine.batched.BatchedLlama`'s rows, cache and step).

:meth:`BatchedLlama.run <eyas.engine.batched.BatchedLlama.run>` answers a list of prompts known up
front and reads the device every ``sync_every`` steps. A server does not know its requests up front,
streams every token and stops a row at once (a stop string, a client gone), so :class:`RowBatch`
exposes the same state one step at a time:

- :meth:`RowBatch.admit` prefills requests into free rows (eagerly, in groups, as ``run`` does) and
  returns each one's first token; a request that already has tokens (one that decoded speculatively
  alone and is joined by others) is *resumed*: its prompt and its tokens but the last are prefilled,
  and its last token is fed next, so the row continues exactly where the request stood;
- :meth:`RowBatch.step` runs one decode step (the fixed-shape step ``run`` runs: one compiled
  function and CUDA graph per key bucket and mode) and reads its tokens back once, [2, R] longs:
  the token each busy row chose, and whether it is still active on the device. The step covers the
  first n rows, n the smallest of ``row_buckets`` above the highest busy row (a request takes the
  lowest free row, so busy rows gather at the front). On a CPU a step's cost grows with its rows
  (default buckets 1, 2, 4, ... R: one request alone in 8 rows would pay for 8); on a GPU a step
  reads the weights once for all rows, but each row also reads its K cache entries per block, and
  each bucket costs a compilation and a CUDA graph per key bucket and mode, so the default there is
  4, 16, 64, ... R (a few clients' step and round do not pay for R rows' attention). A shape not
  compiled yet is stood in for by a prepared one with at least its keys, rows and mode, until the
  steps run in its place have cost what its compilation would (rent or buy: :meth:`RowBatch._stand_in`),
  so a server right after its start does not stall every row for each new shape;
- :meth:`RowBatch.speculate` (with a drafter) runs one batched speculative round instead
  (:mod:`eyas.engine.row_speculation`: a chain of ``depth`` drafts per row, or a tree, verified in
  one forward) and reads back each row's accepted drafts and bonus token, cut at the row's eos and
  limit; after plain steps the drafter first catches up on the tokens it did not read (the last
  ``FOLLOW`` a row: :meth:`RowSpeculation.catch_up`);
- :meth:`RowBatch.release` frees a row at once (its request ended on the host, or was cancelled).

Each row has its own sampling parameters (temperature, top-p; greedy rows take the argmax in a
sampled step, ``Rows.greedy``), its own limit and its own random key (from the request's seed).
A step's mode is the widest its busy rows need: ``greedy`` when every row is greedy, ``top_p`` when
one filters, else ``sample``. Invariants:

- a row's cache holds its own tokens only: entries 0 .. pos of row r are its request's sequence;
  rows never read each other's entries (the step's mask is per row), so a greedy row's tokens are
  the ones its request gets alone, up to the numerics of a batched product (equal in float32 on
  the tested models; the server tests check it);
- the host knows every busy row's position exactly (prompt + tokens - 1), so each step attends the
  smallest key bucket above the longest row without reading the device;
- a row is busy from its admission until :meth:`release`; a row the device finished (an eos token
  or its limit) is reported ``finished`` once and must then be released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from eyas.drafter.model import Eagle3Drafter
from eyas.engine.batched import BatchedLlama
from eyas.engine.errors import RequestError
from eyas.engine.row_speculation import MAX_DEPTH, Draft, RoundKey, RowSpeculation
from eyas.engine.sampling import SamplingParams

_KEY_SPACE = 1 << 31  # counter_uniform's keys are int64; a seed of any size maps into this


@dataclass(frozen=True)
class RowRequest:
    """What a row decodes.

    prompt: the tokens prefilled into the row (a resumed request: its prompt and every token it has
        generated but the last).
    max_new_tokens: the row's whole budget of new tokens, the ones already generated included.
    next_token: resume only: the request's last token (already emitted), fed at the first step.
    generated: resume only: the tokens the request has emitted (``next_token`` the last of them).
    """

    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    next_token: int | None = None
    generated: int = 0

    @property
    def resumed(self) -> bool:
        return self.next_token is not None


@dataclass(frozen=True)
class RowTokens:
    """A row's new tokens from :meth:`RowBatch.admit` or :meth:`RowBatch.step`; ``finished``: the
    device ended the row (an eos token, or its limit) with the last of them."""

    row: int
    tokens: list[int]
    finished: bool
    drafted: int = 0  # a speculative round: the row's drafts, and how many of them it accepted
    accepted: int = 0


def step_mode(samplings: Sequence[SamplingParams]) -> str:
    """The decode step's mode for rows with these sampling parameters (module docstring)."""
    if all(s.greedy for s in samplings):
        return "greedy"
    return "top_p" if any(not s.greedy and s.top_p < 1 for s in samplings) else "sample"


class RowBatch:
    """A running batch of up to ``engine.rows`` requests, one per row (module docstring).

    Args:
        engine: the batched engine whose rows, cache and compiled steps it drives (its own: a
            :meth:`BatchedLlama.run` on the same engine would reset the rows).
        capacity: the positions a row may hold (prompt + new tokens): the served context.
        eos_ids: the tokens that end every row.
        row_buckets: the row counts a step may cover (module docstring; R is always one).
        drafter, boundaries: the EAGLE-3 drafter and the target boundaries it reads, for
            :meth:`speculate` (rows then also prefill its cache).
    """

    def __init__(self, engine: BatchedLlama, capacity: int, eos_ids: Sequence[int] = (),
                 row_buckets: Sequence[int] | None = None, drafter: Eagle3Drafter | None = None,
                 boundaries: Sequence[int] = ()) -> None:
        self.engine, self.capacity = engine, int(capacity)
        R = engine.rows
        if row_buckets is None:
            step = 4 if engine.device.type == "cuda" else 2  # (module docstring)
            row_buckets = [min(step ** i, R) for i in range(1 if step == 4 else 0, R.bit_length() + 1)]
        self.row_buckets = sorted({int(b) for b in row_buckets if 1 <= int(b) <= R} | {R})
        # a round writes up to MAX_DEPTH entries past a row's last position (scratch)
        engine.ensure(self.capacity + (MAX_DEPTH + 1 if drafter is not None else 0), self.capacity)
        self.spec = RowSpeculation(engine, drafter, boundaries) if drafter is not None else None
        st = engine.state
        assert st is not None
        self.rows = engine.rows
        st.active.zero_()
        st.is_eos.zero_()
        eos = [int(e) for e in eos_ids if 0 <= int(e) < engine.vocab_size]
        if eos:
            st.is_eos[torch.tensor(eos, device=engine.device)] = True
        self.eos = set(eos)
        self.sampling: list[SamplingParams | None] = [None] * self.rows  # None: the row is free
        self.pos = [0] * self.rows  # the position of the token the row feeds next (host-exact)
        self.generated = [0] * self.rows  # the row's tokens so far (host-exact)
        self.limit = [0] * self.rows  # the row's max_new_tokens
        self.missed = [0] * self.rows  # the row's last tokens its drafter has not read (plain steps)
        self.steps = 0  # decode steps and speculative rounds run
        self.rent: dict[tuple, float] = {}  # a step's or round's shape -> seconds of steps run in its place (_stand_in)

    # -- rows ------------------------------------------------------------------------------------

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling and capturing the plain steps' and the rounds' shapes so far."""
        return self.engine.compile_s + (self.spec.compile_s if self.spec is not None else 0.0)

    @property
    def busy(self) -> list[int]:
        return [r for r, s in enumerate(self.sampling) if s is not None]

    @property
    def free(self) -> list[int]:
        return [r for r, s in enumerate(self.sampling) if s is None]

    def mode(self) -> str:
        return step_mode([s for s in self.sampling if s is not None])

    def check(self, request: RowRequest) -> None:
        """Raise :class:`RequestError` for a request no row can decode (names the field)."""
        n, V = len(request.prompt), self.engine.vocab_size
        if n == 0:
            raise RequestError("prompt: expected at least one token, found none")
        if min(request.prompt) < 0 or max(request.prompt) >= V:
            raise RequestError(f"prompt: token ids must be in [0, {V}), found [{min(request.prompt)}, "
                               f"{max(request.prompt)}]")
        if request.sampling.top_k:
            raise RequestError(f"top_k: the batched step samples with temperature and top_p only, found "
                               f"top_k={request.sampling.top_k}")
        room = request.max_new_tokens - request.generated  # tokens still to come
        # positions fed: the prompt's 0 .. n-1, then n .. n + room - 2 (fresh; the last token is never
        # fed) or n .. n + room - 1 (resumed: next_token at n first)
        if room < 1 or n + room > self.capacity:
            raise RequestError(f"max_new_tokens: {request.max_new_tokens} ({request.generated} generated) after "
                               f"{n} prompt tokens: a row holds {self.capacity} positions")

    @torch.no_grad()
    def admit(self, requests: Sequence[RowRequest]) -> list[RowTokens]:
        """Prefill ``requests`` into free rows (at most ``len(self.free)``), in order; returns each
        one's row and first token (a resumed request: no token, its row feeds ``next_token``)."""
        free = self.free
        if len(requests) > len(free):
            raise RequestError(f"admit: {len(requests)} requests, {len(free)} free rows")
        for q in requests:
            self.check(q)
        if not requests:
            return []
        eng, st = self.engine, self.engine.state
        assert st is not None
        dev = eng.device
        rows = free[:len(requests)]
        index = torch.tensor(rows, dtype=torch.long, device=dev)
        # the rows' parameters before the prefill: its first token is drawn with them
        temps = [q.sampling.temperature if not q.sampling.greedy else 1.0 for q in requests]
        st.temperature.index_copy_(0, index, torch.tensor(temps, dtype=st.temperature.dtype, device=dev))
        st.drop_mass.index_copy_(0, index, torch.tensor([1.0 - q.sampling.top_p for q in requests],
                                                        dtype=st.drop_mass.dtype, device=dev))
        st.greedy.index_copy_(0, index, torch.tensor([q.sampling.greedy for q in requests], device=dev))
        st.limit.index_copy_(0, index, torch.tensor([q.max_new_tokens for q in requests], device=dev))
        keys = torch.tensor([q.seed % _KEY_SPACE for q in requests], dtype=torch.long)
        mode = step_mode([q.sampling for q in requests])
        groups: list[tuple[list[tuple[int, int]], torch.Tensor]] = []
        eng.prefill_rows(list(zip(rows, range(len(requests)))), [list(q.prompt) for q in requests], keys, mode,
                         boundaries=self.spec.boundaries if self.spec else (),
                         on_features=lambda group, feats: groups.append((group, feats)))
        resumed = [(r, q) for r, q in zip(rows, requests) if q.resumed]
        if resumed:  # the row continues the request: its token fed next, its count, active
            at = torch.tensor([r for r, _ in resumed], dtype=torch.long, device=dev)
            st.ids.index_copy_(0, at, torch.tensor([q.next_token for _, q in resumed], device=dev))
            st.n_gen.index_copy_(0, at, torch.tensor([q.generated for _, q in resumed], device=dev))
            st.active.index_fill_(0, at, True)
        first, active = torch.stack((st.ids[index], st.active[index].long())).tolist()
        if self.spec is not None:  # the drafter reads x_1 .. x_m after the prompt's features
            nxt = {r: int(first[j]) for j, r in enumerate(rows)}
            for group, feats in groups:
                self.spec.read([r for r, _ in group], [list(requests[i].prompt[1:]) + [nxt[r]] for r, i in group],
                               feats)
        out = []
        for j, (r, q) in enumerate(zip(rows, requests)):
            self.sampling[r] = q.sampling
            self.pos[r] = len(q.prompt)
            self.generated[r] = q.generated if q.resumed else 1
            self.limit[r] = q.max_new_tokens
            self.missed[r] = 0
            if not q.resumed:
                out.append(RowTokens(r, [int(first[j])], not active[j]))
        return out

    @torch.no_grad()
    def step(self) -> list[RowTokens]:
        """One decode step of every row; each busy row's new token (module docstring)."""
        busy = self.busy
        if not busy:
            return []
        eng, st = self.engine, self.engine.state
        assert st is not None
        need = max(self.pos[r] for r in busy) + 1  # entries 0 .. pos attended
        n = next(b for b in self.row_buckets if b > busy[-1])  # rows 0 .. n-1 step; the rest are free
        shape = (next(b for b in eng.buckets() if b >= need), self.mode(), n)
        run = self._stand_in(shape)
        t0 = time.perf_counter()
        eng.decode_step(*run)
        self.steps += 1
        ids, active = torch.stack((st.ids[:n], st.active[:n].long())).tolist()  # the step's one read of the device
        if run != shape:
            self.rent[shape] = self.rent.get(shape, 0.0) + time.perf_counter() - t0
        out = []
        for r in busy:
            self.pos[r] += 1
            self.generated[r] += 1
            self.missed[r] += 1  # the drafter did not read this token (module docstring of row_speculation)
            out.append(RowTokens(r, [int(ids[r])], not active[r]))
        return out

    def _stand_in(self, shape: tuple[int, str, int]) -> tuple[int, str, int]:
        """The step to run for ``shape`` (keys, mode, rows): itself when it is prepared; else, while
        the steps run in its place have cost less than compiling it would (the engine's mean so
        far), a prepared step that covers it (:meth:`BatchedLlama.cover`); else itself, compiled
        now. A rent-or-buy rule: a shape needed for a few steps never stalls every row for a
        compilation, one needed for long pays it once, and neither costs more than twice the
        better choice made in hindsight."""
        eng = self.engine
        if eng.prepared(*shape):
            return shape
        price = eng.compile_per_shape_s
        cover = eng.cover(*shape) if price is not None else None
        if cover is None or self.rent.get(shape, 0.0) >= price:
            return shape
        return cover

    def round_shape(self, draft: Draft) -> RoundKey:
        """The (rows, draft, mode, key bucket) a round of ``draft`` (a chain's depth or a tree) runs
        now (:meth:`speculate`); its draft a TreeSpec (:meth:`RowSpeculation.check`)."""
        busy = self.busy
        mode = self.mode()
        assert self.spec is not None
        tree = self.spec.check(draft, mode)
        need = max(self.pos[r] for r in busy) + int(tree.total_tokens) + 1  # entries 0 .. pos + the drafts attended
        n = next(b for b in self.row_buckets if b > busy[-1])
        return n, tree, mode, next(b for b in self.engine.buckets() if b >= need)

    def round_ready(self, shape: RoundKey) -> bool:
        """Whether a round of ``shape`` (:meth:`round_shape`) should run now: it is prepared, or the
        plain steps run in its place (:meth:`charge`) have cost what compiling a round has cost on
        average (the rent-or-buy rule of :meth:`_stand_in`, for rounds: a load that never leaves the
        server idle still gets its rounds, after at most twice the stall a compilation would have been)."""
        if self.spec is None or self.spec.prepared(*shape):
            return True
        price = self.spec.compile_per_shape_s or self.engine.compile_per_shape_s
        return price is None or self.rent.get(shape, 0.0) >= price

    def charge(self, shape: tuple, seconds: float) -> None:
        """A step of ``seconds`` ran where ``shape`` (:meth:`round_shape`) was wanted (:meth:`round_ready`)."""
        self.rent[shape] = self.rent.get(shape, 0.0) + seconds

    @torch.no_grad()
    def speculate(self, draft: Draft, shape: RoundKey | None = None) -> list[RowTokens]:
        """One batched speculative round of every row (``draft``: a chain of that many drafts each, or
        a tree, :mod:`eyas.engine.row_trees`; needs a drafter): each busy row's accepted drafts and
        bonus token, cut after an eos token or at the row's limit (``finished`` then, as the device
        has it). ``shape``: this step's :meth:`round_shape` of ``draft``, where the caller has it."""
        if self.spec is None:
            raise RuntimeError("RowBatch.speculate: no drafter (RowBatch(..., drafter=...))")
        busy = self.busy
        if not busy:
            return []
        st = self.engine.state
        assert st is not None
        n, tree, mode, n_keys = shape or self.round_shape(draft)
        if any(self.missed[r] for r in busy):  # plain steps since the drafter's last read
            self.spec.catch_up(n, torch.tensor([self.missed[r] if self.sampling[r] is not None else 0
                                                for r in range(n)]))  # a free row: nothing to catch up
            for r in busy:
                self.missed[r] = 0
        depth = tree.depth
        tokens, accepted = self.spec.round(n, tree, mode, n_keys)
        self.steps += 1
        got = torch.cat([tokens, accepted[:, None], st.active[:n, None].long()], 1).tolist()  # the round's one read
        eos = self.eos
        out = []
        for r in busy:
            row = got[r]
            a, active = row[depth + 1], row[depth + 2]
            new = row[:a + 1][:self.limit[r] - self.generated[r]]
            cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            new = new[:cut]
            self.pos[r] += a + 1
            self.generated[r] += len(new)
            finished = not active or cut < a + 1 or self.generated[r] >= self.limit[r]
            out.append(RowTokens(r, new, finished, drafted=depth, accepted=min(a, len(new))))
        return out

    def step_shapes(self, context: int, modes: Sequence[str] = ("greedy", "sample")) -> list[tuple[int, str, int]]:
        """The (key bucket, mode, rows) of the plain steps that requests of up to ``context`` tokens
        run, fewest keys, then fewest rows, first: what a server prepares while it is idle
        (:meth:`~eyas.engine.batched.BatchedLlama.prepare`), so that a load's first steps of each
        shape do not stall every row on a compilation."""
        keys = self._keys_up_to(context)
        return [(K, mode, n) for K in keys for n in self.row_buckets for mode in modes]

    def round_shapes(self, context: int, depths: Sequence[Draft], max_rows: int,
                     modes: Sequence[str] = ("greedy", "sample")) -> list[RoundKey]:
        """The (rows, draft, mode, key bucket) of the speculative rounds that batches of up to
        ``max_rows`` busy rows run for requests of up to ``context`` tokens, fewest keys, then fewest
        rows, first (:meth:`RowSpeculation.prepare`, as :meth:`step_shapes` for the plain steps)."""
        if self.spec is None:
            return []
        keys = self._keys_up_to(context)
        rows = [n for n in self.row_buckets if n <= max(max_rows, self.row_buckets[0])]
        return [(n, self.spec.check(d, mode), mode, K) for K in keys for n in rows for d in depths for mode in modes]

    def _keys_up_to(self, context: int) -> list[int]:
        """The key buckets a request of up to ``context`` tokens attends, each once."""
        buckets = self.engine.buckets()
        return [K for K in buckets if K < context] + [K for K in buckets if K >= context][:1]

    def release(self, row: int) -> None:
        """Free ``row`` now (its request ended or was cancelled); the device stops advancing it."""
        if self.sampling[row] is None:
            return
        self.sampling[row] = None
        self.engine.state.active[row] = False  # type: ignore[union-attr]
