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

A round stays on the device from drafting to acceptance and reads it back ONCE: the accepted length,
the path's tokens, the bonus token and the tree's depth, in one transfer (the host needs them to
stream tokens and check stop conditions). A plain step reads back its one token. A sampled round
draws its random numbers from a counter-based stream on the device (``sampling.CounterStream``,
keyed by one draw of the request's generator), so it too is one function of device tensors.

On a target with a static cache of fixed shapes, rounds are pipelined (:func:`_pipelined_round`):
keep, re-read and the next round's draft are queued before the host waits for that transfer, with
shapes fixed by the tree's depth, so the device drafts while the host streams tokens; plain steps
likewise feed each token before reading it (:func:`_plain_step`).

A request is a :class:`Session` (the drafter's cache, the committed tokens, the output, the
statistics); :func:`step` runs one round of it. :func:`speculative_generate` and
:func:`plain_generate` start a session and step it to the end; a server steps sessions itself
and may stop stepping one (``cancel``). The target's KV cache holds one session at a time: the
session that last prefilled it (a step on another raises :class:`SessionError`).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from eyas.drafter.model import Eagle3Drafter
from eyas.engine.draft_kernels import kernels_for
from eyas.engine.observe import RoundObserver
from eyas.engine.errors import RequestError, SessionError
from eyas.engine.draft_state import DraftState
from eyas.engine.sampling import GREEDY, AcceptRule, CounterStream, SamplingParams, probabilities, rejection_rule, sample
from eyas.engine.stats import STOP_MAX_LENGTH, STOP_MAX_NEW_TOKENS, Clock, GenerationStats
from eyas.engine.stopping import StopCriteria
from eyas.engine.target import Target
from eyas.engine.tree import DraftTree, TreePlan, TreeSpec
from eyas.engine.verdict import Acceptance, Readback, round_verdict

STOP_CANCELLED = "cancelled"


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens (prompt excluded); the stop token (EOS...) included
    stats: GenerationStats


def _prompt_list(input_ids: Sequence[int] | Tensor) -> list[int]:
    ids = input_ids.flatten().tolist() if isinstance(input_ids, Tensor) else [int(t) for t in input_ids]
    if not ids:
        raise RequestError("input_ids: expected at least one prompt token, found none")
    return ids


def _choose(logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """The target's own choice from logits [V]: argmax, or a draw from p; long [] on the device."""
    return logits.argmax(-1) if sampling.greedy else sample(probabilities(logits, sampling), generator)


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


class Session:
    """One request between rounds: its committed tokens x_0 .. x_m, its output and statistics, and
    (speculative) the drafter's cache. Built by :func:`start`; advanced by :func:`step`.

    max_len: the length the sequence may reach (prompt + new tokens, the last at position
    max_len - 1, within the target's context)."""

    def __init__(self, target: Target, drafter: Eagle3Drafter | None, prompt: list[int], *, tree: TreeSpec,
                 sampling: SamplingParams, max_new_tokens: int, stop: StopCriteria,
                 on_token: Callable[[int], None] | None, generator: torch.Generator | None,
                 accept_rule: AcceptRule, timing: str, observer: RoundObserver | None,
                 sampled_drafts: str = "top-k") -> None:
        if len(prompt) > target.max_length:
            raise RequestError(f"prompt of {len(prompt)} tokens is longer than the target's context "
                             f"({target.max_length} positions)")
        self.target, self.drafter, self.tree, self.sampling = target, drafter, tree, sampling
        self.generator = generator
        # Sampled rounds draw from a stream keyed by one draw of the generator and by the round's
        # committed length (CounterStream): no generator inside a round, so a round is one function
        # of device tensors that a CUDA graph can hold. Plain steps draw from the generator.
        self.draws = (CounterStream.from_generator(generator, target.device)
                      if drafter is not None and not sampling.greedy else None)
        # How the tree is drafted and verified: greedy, top-k drafts (a sampled request on the greedy
        # draft, EAGLE's rule) or gumbel (children drawn from q); the drafter drafts greedily unless
        # children are drawn from q
        self.acceptance = Acceptance.of(sampling, sampled_drafts, accept_rule, self.draws, target.device)
        self.draft_sampling = sampling if self.acceptance.how == "gumbel" else GREEDY
        self.observer = observer  # sees each round's features when given
        self.x = list(prompt)  # committed tokens x_0 .. x_m
        self.max_new_tokens = max_new_tokens
        self.max_len = min(target.max_length, len(prompt) + max_new_tokens)
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.clock = Clock(self.stats, target.device, timing)
        self.out = _Output(stop, on_token)
        self.draft: DraftState | None = None
        self.last: Tensor | None = None  # long [1, 1]: x_m on the device (plain decoding feeds it back)
        self.positions = torch.arange(self.max_len, device=target.device)  # position ids, sliced per step
        self.next_tree: DraftTree | None = None  # a pipelined round's draft of the next round
        self.next_token: Tensor | None = None  # plain decoding: the token after s.last, computed ahead
        self.readback = Readback(target.device)
        self._finished = False

    @property
    def done(self) -> bool:
        return self.out.reason is not None

    @property
    def horizon(self) -> int:
        """The length a round may take the sequence to: the target's whole context, not ``max_len``.
        The rounds that end a request draft and verify the tree's full depth like the others (on a
        fixed-shape target they cost the same and stay pipelined: the next tree drafted ahead); what
        they accept past the request's budget is dropped as it is emitted (``_Output``: the stop
        criteria count max_new_tokens), so the output is unchanged. On the H200 the shallower,
        unpipelined rounds that used to end each request cost SmolLM2 requests milliseconds."""
        return self.target.max_length

    @property
    def m(self) -> int:
        """The position of the last committed token x_m (the one the target has not seen yet)."""
        return len(self.x) - 1

    def cancel(self) -> None:
        """End the request now (a server's cancel); ``result`` reports stop reason 'cancelled'."""
        if self.out.reason is None:
            self.out.reason = STOP_CANCELLED

    def result(self) -> GenerationResult:
        """The output so far, with the statistics (finishes the clock once the session is done)."""
        if self.done and not self._finished:
            self.stats.new_tokens, self.stats.stop_reason = len(self.out.tokens), self.out.reason
            self.clock.finish()
            self._finished = True
        return GenerationResult(self.out.tokens, self.stats)

    def _emit(self, tokens: list[int]) -> int:
        kept = self.out.emit(tokens)
        self.x += tokens[:kept]
        if self.out.reason is None and len(self.x) >= self.max_len:
            self.out.reason = STOP_MAX_NEW_TOKENS if len(self.out.tokens) >= self.max_new_tokens else STOP_MAX_LENGTH
        return kept


# The drafter's state per target and (drafter, tree), each with the drafter it was built for (the key
# holds only its id): it lives as long as the target's KV cache, and goes with the target.
_DRAFT_STATES: weakref.WeakKeyDictionary[Target, dict[tuple[int, TreeSpec], tuple[Eagle3Drafter, DraftState]]] = (
    weakref.WeakKeyDictionary())


def draft_states(target: Target) -> list[DraftState]:
    """The drafter states ``target``'s sessions have used, one per (drafter, tree)."""
    return [state for _, state in _DRAFT_STATES.get(target, {}).values()]


def _draft_state(target: Target, drafter: Eagle3Drafter, tree: TreeSpec, max_len: int) -> DraftState:
    """The drafter's state for a session of up to ``max_len`` tokens on ``target``, emptied.

    One per (target, drafter, tree), reused by the target's sessions (one at a time, like the
    target's cache), so the drafter's CUDA graphs are captured once, not per request. Its cache
    holds the committed entries, one round's scratch and the padding of a fixed-shape re-read,
    rounded up to a power of two (at least 256), so requests of similar lengths share one state.
    On a target with fixed shapes it is sized for the target's whole context at once, so its
    compiled and captured round functions are made once per (drafter, tree), never inside a later request.
    Its shapes follow the target's: fixed (and graphed) when the target's are, and its round functions
    compiled with them unless the target says otherwise (an optional ``compile_drafter`` attribute: False,
    True or a backend). Its steps run through the Triton kernels (``DraftState(kernels="triton")``)
    when the target verifies through them (``LlamaTarget(matvec="triton-verify")``) and the drafter
    can (else, with a warning, its forward: :func:`~eyas.engine.draft_kernels.kernels_for`)."""
    states = _DRAFT_STATES.setdefault(target, {})
    key = (id(drafter), tree)
    need = max_len + tree.scratch_slots + tree.depth + 1
    size = max(256, 1 << (need - 1).bit_length())
    capacity = getattr(target, "max_length", None)
    if getattr(target, "fixed_shapes", False) and capacity:
        # One state for every request the target can hold: a new state would compile and capture
        # the drafter's steps again (seconds, inside a request). A draft step attends the whole
        # cache under its mask (one drafter layer: two small matmuls), so the size is the context
        # rounded up to 256 slots, not to a power of two (4,096 + a round's slots, not 8,192).
        need = max(need, int(capacity) + tree.scratch_slots + tree.depth + 1)
        size = -(-need // 256) * 256
    if key not in states or states[key][0] is not drafter or states[key][1].max_len < need:
        kernels = kernels_for(getattr(target, "matvec", None), drafter)
        states[key] = (drafter, DraftState(drafter, size,
                                           fixed_shapes=getattr(target, "fixed_shapes", False),
                                           cuda_graphs=getattr(target, "cuda_graphs", False),
                                           extend_bucket=tree.depth + 1,
                                           compile=getattr(target, "compile_drafter", None),
                                           kernels=kernels))
        if states[key][1].graphs:  # its graphs and compilations now, not inside a request's rounds
            states[key][1].warm(tree, target.vocab_size)
    state = states[key][1]
    state.reset()
    return state


@torch.no_grad()
def start(target: Target, input_ids: Sequence[int] | Tensor, drafter: Eagle3Drafter | None = None, *,
          tree: TreeSpec | TreePlan = TreeSpec.chain(5), sampling: SamplingParams = GREEDY, max_new_tokens: int = 256,
          eos_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
          decode: Callable[[list[int]], str] | None = None, on_token: Callable[[int], None] | None = None,
          generator: torch.Generator | None = None, accept_rule: AcceptRule = rejection_rule,
          timing: str = "auto", observer: RoundObserver | None = None, sampled_drafts: str = "top-k") -> Session:
    """Begin a request: prefill the target with the prompt (the target's cache now belongs to this
    session) and commit the first new token, which comes from the target alone. With a drafter the
    session decodes speculatively, without one plainly. Arguments as :func:`speculative_generate`."""
    if isinstance(tree, TreePlan):
        tree = tree.for_sampling(sampling)
    if drafter is not None:
        if drafter.config.num_slots != target.spec.num_slots or drafter.config.vocab_size != target.vocab_size:
            raise RequestError(
                f"drafter (num_slots={drafter.config.num_slots}, vocab_size={drafter.config.vocab_size}) does not "
                f"fit the target (num_slots={target.spec.num_slots}, vocab_size={target.vocab_size})"
            )
        drafter_device = drafter.fc.weight.device
        if drafter_device != target.device:
            raise RequestError(f"drafter on {drafter_device}, target on {target.device}: move the drafter with .to()")
    s = Session(target, drafter, _prompt_list(input_ids), tree=tree, sampling=sampling, max_new_tokens=max_new_tokens,
                stop=StopCriteria(max_new_tokens, eos_token_ids, stop_strings, decode), on_token=on_token,
                generator=generator, accept_rule=accept_rule, timing=timing, observer=observer,
                sampled_drafts=sampled_drafts)
    target.session = s
    if len(s.x) >= s.max_len:  # nothing to generate: no new tokens asked for, or the prompt fills the context
        s.out.reason = STOP_MAX_NEW_TOKENS if max_new_tokens <= 0 else STOP_MAX_LENGTH
        return s
    with s.clock("prefill"):
        # p and f at every prompt position; x_n comes from the target alone
        ids = torch.tensor([s.x], device=target.device)  # [1, n]
        logits, f = target.prefill(ids, capture=drafter is not None)
        x_next = _choose(logits[0, -1], sampling, generator)
        s.stats.rounds += 1
    if observer is not None and f is not None:
        observer.target_forward(0, "prefill", s.positions[:len(s.x)], f)
    s._emit([int(x_next)])
    s.last = x_next.view(1, 1)
    if drafter is not None and not s.done:
        with s.clock("draft"):
            s.draft = _draft_state(target, drafter, tree, s.max_len)
            following = torch.cat([ids[0, 1:], x_next.view(1)])  # x_1 .. x_n, on the device
            s.draft.extend(following, f[0])  # entry t reads (f_t, x_{t+1}), t = 0 .. n-1
        if observer is not None:
            observer.drafter_reads(0, "prefill", s.positions[:len(s.x) - 1], following, f[0])
    return s


@torch.no_grad()
def step(s: Session) -> list[int]:
    """One round of the session: a speculative round (draft, verify, accept, commit) or, without a
    drafter, one plain step. Returns the tokens it committed (none once the session is done)."""
    if s.done:
        return []
    if s.target.session is not s:
        raise SessionError("step: the target's KV cache holds another session (started later); a target serves "
                           "one session at a time: finish this one first, or give each request its own target")
    t0 = time.perf_counter()
    tokens = _speculative_round(s) if s.drafter is not None else _plain_step(s)
    s.stats.time_rounds += time.perf_counter() - t0
    return tokens


def _draft(s: Session, depth: int, length: Tensor | None = None) -> DraftTree:
    """The round's tree of ``depth`` levels: the greedy draft (greedy and top-k sampled requests share
    its captured function), or children drawn from q (``gumbel``, from the session's stream)."""
    draws = s.draws if s.acceptance.how == "gumbel" else None
    return s.draft.draft(s.tree, depth, s.draft_sampling, draws, s.target.vocab_size, length=length,
                         params=s.acceptance.params)


def _pipelines(s: Session, gamma: int) -> bool:
    """Whether this round runs pipelined (:func:`_pipelined_round`): on a target with a static cache
    of fixed shapes, drafting the tree's full depth, with no observer (which reads each round's
    features on the host)."""
    return (s.observer is None and gamma == s.tree.depth
            and getattr(s.target, "fixed_shapes", False) and s.draft.extend_bucket == s.tree.depth + 1)


def _speculative_round(s: Session) -> list[int]:
    target, draft, clock, m, r = s.target, s.draft, s.clock, s.m, s.stats.rounds  # r: this round's number
    # gamma: the deepest draft this round; a accepted drafts + the bonus must fit in the horizon
    gamma = min(s.tree.depth, s.horizon - 2 - m)
    if _pipelines(s, gamma):
        return _pipelined_round(s)
    s.next_tree = None
    with clock("draft"):
        t = _draft(s, gamma)  # t.tokens[0] = x_m
    with clock("verify"):
        # logits [1, N+1, V], f [1, N+1, S*H]: after each node, given its ancestors
        logits, f = target.forward(t.tokens[None], (m + t.depths)[None], t.mask)
    if s.observer is not None:
        s.observer.target_forward(r, "verify", m + t.depths, f)
    with clock("bookkeeping"):
        v, verdict, _ = round_verdict(target, s.acceptance, t, logits[0],
                                      torch.full((), m, dtype=torch.long, device=target.device))
        read = verdict.tolist()  # the round's one read of the device
        a, path_tokens, bonus, tree_depth = read[0], read[1:2 + t.depth], read[2 + t.depth], read[3 + t.depth]
        accepted = path_tokens[1:a + 1] + [bonus]  # x_{m+1} .. x_{m+a+1}
        path = v.path[:a + 1]  # x_m and the accepted nodes, on the device
        target.keep(path)
        kept = s._emit(accepted)
        s.stats.record_round(tree_depth, a, kept)
    if not s.done:
        with clock("draft"):
            # The drafter re-reads x_{m+1} .. x_{m+a+1} with the target's f_m .. f_{m+a}.
            tokens, features = torch.cat([t.tokens[path[1:]], v.bonus[None]]), f[0, path]
            draft.extend(tokens, features)
        if s.observer is not None:
            s.observer.drafter_reads(r, "verify", s.positions[m:m + a + 1], tokens, features)
        assert draft.length == target.cache_len == s.m, (draft.length, target.cache_len, s.m)
    return accepted[:kept]


def _pipelined_round(s: Session) -> list[int]:
    """One round in which the host never stands between the device's phases.

    The round above reads the verdict, then commits on the host's word (keep a+1 entries,
    re-read a+1 tokens, draft), so the device waits while the host reads, streams tokens and
    launches the next steps. Here everything after verification is queued at once with shapes
    fixed by the tree's depth D, whatever a turns out to be:

        verify          logits, f after every node (one graph)
        verdict         a, the path [D+1] (past a it repeats its last node), the bonus; the re-read's
                        tokens x_{m+1} .. x_{m+a+1} and features f_m .. f_{m+a}, padded to D+1
        read (start)    the verdict's copy to the host is queued here
        keep            the target keeps the whole path: entries past m+a+1 are dropped below
        re-read         the drafter reads n = a+1 entries (a device count; pads past it)
        draft           the next round's tree, from committed length m + n (a device sum)
        read (wait)     the host waits for the copy only; the device is still drafting

    then the host truncates the target's cache to m+a+1 entries, advances the drafter's length by
    a+1 and streams the tokens while the next tree is being drafted. Output is the same as the
    round above token for token: the same verdict, the same entries kept and re-read. The next
    tree is drafted only when its full depth fits in the session's horizon (the round after this
    one is then pipelined too) and this round may leave tokens to generate; a session that ends
    this round drops it. Sampled rounds run the same way: their draws
    come from the session's CounterStream at the committed length, which the next round's draft
    takes from the device (m + n), so a round drafted ahead draws what it would have drawn in turn."""
    target, draft, clock, m, D = s.target, s.draft, s.clock, s.m, s.tree.depth
    t, s.next_tree = s.next_tree, None
    if t is None:  # the session's first round, or the one after a round that could not draft ahead
        with clock("draft"):
            t = _draft(s, D)
    with clock("verify"):
        logits, f = target.forward(t.tokens[None], (m + t.depths)[None], t.mask)
    with clock("bookkeeping"):
        length = torch.full((), m, dtype=torch.long, device=target.device)
        v, packed, reread = round_verdict(target, s.acceptance, t, logits[0], length, f[0])
        s.readback.start(packed)
        target.keep(v.path)
        draft.reread(reread.tokens, reread.features, reread.n, length)
    # the next round, drafted ahead: when a full-depth draft fits after it (m' <= m + D + 1) and this
    # round, which emits at least one token, may leave some of the budget
    if m + 2 * (D + 1) < s.horizon - 1 and len(s.out.tokens) + 1 < s.max_new_tokens:
        with clock("draft"):
            s.next_tree = _draft(s, D, length + reread.n)
    with clock("bookkeeping"):
        read = s.readback.wait()  # the round's one read of the device
        a, path_tokens, bonus, tree_depth = read[0], read[1:2 + t.depth], read[2 + t.depth], read[3 + t.depth]
        target.truncate(m + a + 1)
        draft.advance(a + 1)
        accepted = path_tokens[1:a + 1] + [bonus]  # x_{m+1} .. x_{m+a+1}
        kept = s._emit(accepted)
        s.stats.record_round(tree_depth, a, kept)
    if s.done:
        s.next_tree = None
    else:
        assert draft.length == target.cache_len == s.m, (draft.length, target.cache_len, s.m)
    return accepted[:kept]


def _plain_forward(s: Session, token: Tensor, position: int) -> Tensor:
    """Feed ``token`` [1, 1] at ``position``; the target's next token, long [1, 1] on the device."""
    logits, _ = s.target.forward(token, s.positions[position:position + 1][None], capture=False)
    return _choose(logits[0, -1], s.sampling, s.generator).view(1, 1)


def _plain_step(s: Session) -> list[int]:
    """One plain token, x_{m+1}, from feeding x_m (``s.last``) at position m.

    On a fixed-shape target the step runs one token ahead: x_{m+1} is fed (at m+1) before the host
    reads it, so the device computes x_{m+2} while the host streams x_{m+1}. Output and sampling
    order are unchanged; a session that stops at x_{m+1} drops the entry fed ahead (truncate). (When
    sampling, that step's draw has been taken from the generator: a generator reused by the next
    request is one draw further on than without the look-ahead.)"""
    target, clock, m = s.target, s.clock, s.m
    if s.next_token is None:
        with clock("verify"):
            s.next_token = _plain_forward(s, s.last, m)  # x_m at position m -> x_{m+1}
    s.last, s.next_token = s.next_token, None
    with clock("bookkeeping"):
        s.readback.start(s.last.view(1))
    if getattr(target, "fixed_shapes", False) and m + 3 <= s.max_len:  # x_{m+1} at m+1 fits the sequence
        with clock("verify"):
            s.next_token = _plain_forward(s, s.last, m + 1)
    with clock("bookkeeping"):
        token = s.readback.wait()[0]  # the step's one read
        s.stats.rounds += 1
        kept = s._emit([token])
    if s.done and s.next_token is not None:
        s.next_token = None
        target.truncate(target.cache_len - 1)
    return [token][:kept]


def _run(s: Session) -> GenerationResult:
    while not s.done:
        step(s)
    return s.result()


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: Eagle3Drafter,
    input_ids: Sequence[int] | Tensor,
    *,
    tree: TreeSpec | TreePlan = TreeSpec.chain(5),
    sampling: SamplingParams = GREEDY,
    max_new_tokens: int = 256,
    eos_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    on_token: Callable[[int], None] | None = None,
    generator: torch.Generator | None = None,
    accept_rule: AcceptRule = rejection_rule,
    timing: str = "auto",
    observer: RoundObserver | None = None,
    sampled_drafts: str = "top-k",
) -> GenerationResult:
    """Generate from ``input_ids`` (a prompt of target token ids) with speculative decoding.

    Greedy (``sampling.temperature == 0``) output is token-identical to :func:`plain_generate`;
    sampled output has the target's distribution. The sequence never grows past
    ``target.max_length`` tokens (stop reason ``max_length``). ``on_token`` sees every new token as it
    is committed; ``decode`` (token ids -> text) is needed for ``stop_strings``. ``tree``: one tree,
    or a :class:`~eyas.engine.tree.TreePlan` (a tree for greedy requests and one for sampled ones).
    ``sampled_drafts``: how a sampled request drafts (:data:`~eyas.engine.sampling.SAMPLED_DRAFTS`):
    "top-k", the greedy tree verified by EAGLE's rule (``sampling.accept_top_k_drafts``), or "gumbel",
    children drawn from q and verified child by child with ``accept_rule`` (the per-child rule;
    tests inject broken ones). ``timing``: how the
    phases are timed (``auto``, ``off``, ``sync``, ``events``; see :class:`~eyas.engine.stats.Clock`).
    ``observer`` sees each round's features (:mod:`eyas.engine.observe`); None: nothing is called.
    """
    return _run(start(target, input_ids, drafter, tree=tree, sampling=sampling, max_new_tokens=max_new_tokens,
                      eos_token_ids=eos_token_ids, stop_strings=stop_strings, decode=decode, on_token=on_token,
                      generator=generator, accept_rule=accept_rule, timing=timing, observer=observer,
                      sampled_drafts=sampled_drafts))


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
    timing: str = "auto",
) -> GenerationResult:
    """The baseline: one target forward per token, no drafter, no feature capture."""
    return _run(start(target, input_ids, None, sampling=sampling, max_new_tokens=max_new_tokens,
                      eos_token_ids=eos_token_ids, stop_strings=stop_strings, decode=decode, on_token=on_token,
                      generator=generator, timing=timing))
