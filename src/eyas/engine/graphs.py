"""CUDA graphs for fixed-shape steps: capture a function once per input shape, then replay it.

A replay re-runs the captured kernels on the same memory, so a graph's inputs are static buffers
that each call copies into, and its outputs are buffers the next replay overwrites (callers that
keep them past the next call must clone). An input that is itself a captured graph's output (or a
view of one) needs no copy: that memory is fixed too, so :class:`StepGraphs` captures a graph that
reads it in place, keyed by its address (one graph per producer buffer, a bounded set). A round's
graphs then pass their results on without a copy between them: on the H200 a SmolLM2 round's
host-launched copies went from 23 to 13 (``benchmarks/results/2026-12-02-round-copies-h200.md``). Anything the function reads from outside its inputs (a
module's weights, a KV cache written by index) must stay at the same address: in-place writes
only. Python code inside the function runs once, at capture: no host reads, no data-dependent
branches.

Used for the drafter's steps (``draft_state.DraftState``): the expansion of the frontier at each depth
and the re-read of the accepted tokens, both at shapes fixed by the tree; the whole greedy draft; the
greedy acceptance. :func:`capture` (warm up on a side stream, then capture) also serves
``LlamaTarget``'s bucketed steps. A function whose capture fails (an op a graph cannot hold) warns and runs eagerly:
the same results, only slower.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

# The storages of captured graphs' outputs (data pointer -> a weak reference to the output): memory
# that stays where it is for as long as the output lives, so another graph may read it in place.
# A few entries per graph, never pruned: a dead one reads as "not an output".
_GRAPH_OUTPUTS: dict[int, weakref.ref] = {}


def _register_outputs(out: object) -> None:
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, Tensor) and t.is_cuda:
            _GRAPH_OUTPUTS[t.untyped_storage().data_ptr()] = weakref.ref(t)


def is_graph_output(t: Tensor) -> bool:
    """Whether ``t`` lies in a live captured graph's output (a buffer at a fixed address)."""
    ref = _GRAPH_OUTPUTS.get(t.untyped_storage().data_ptr()) if t.is_cuda else None
    return ref is not None and ref() is not None


class StepGraphs:
    """``fn(*inputs) -> tuple of tensors``, captured per distinct input shape on first use.

    ``__call__`` copies the inputs into the captured graph's static buffers, replays it and returns
    its output buffers (valid until the next call with the same shapes). An input that lies in
    another captured graph's output (:func:`is_graph_output`) is read in place instead: the graph
    is captured on that tensor itself, keyed by its address and strides, so a call passing that
    same buffer copies nothing and one passing another buffer gets a graph of its own. All graphs
    share one memory pool: they run one after another, never at once. ``fn`` must not write its
    inputs.

    in_place: the positions of the inputs that may be read in place (default: all). Graphs that
    feed each other in a cycle must copy somewhere on it: a graph captured on its producer's
    buffers has new outputs, and a producer that read those in place would be captured anew, and
    so on without end (a round's acceptance copies the drafted tree, the draft's output)."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], warmup: int = 2,
                 in_place: Sequence[int] | None = None) -> None:
        self.fn, self.warmup = fn, warmup
        self.in_place = None if in_place is None else frozenset(in_place)
        # per input shapes: the graph with its static inputs and outputs, or None where capture failed
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, ...]] | None] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        in_place = tuple((self.in_place is None or i in self.in_place) and is_graph_output(t)
                         for i, t in enumerate(inputs))
        key = tuple((tuple(t.shape), t.dtype) + ((t.data_ptr(), t.stride()) if fixed else ())
                    for t, fixed in zip(inputs, in_place))
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(inputs, in_place)
            except RuntimeError as e:  # an op the graph cannot hold: correct, only slower, eagerly
                warnings.warn(f"CUDA graph capture of {getattr(self.fn, '__qualname__', self.fn)} failed, running it "
                              f"eagerly: {e}", stacklevel=2)
                self.graphs[key] = None
        if self.graphs[key] is None:
            return self.fn(*inputs)
        graph, static_in, static_out = self.graphs[key]
        for dst, src, fixed in zip(static_in, inputs, in_place):
            if not fixed:  # (a fixed input is dst itself)
                dst.copy_(src)
        graph.replay()
        return static_out

    def _capture(self, inputs: tuple[Tensor, ...],
                 in_place: tuple[bool, ...]) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, ...]]:
        static_in = tuple(t if fixed else t.clone() for t, fixed in zip(inputs, in_place))
        graph, static_out = capture(lambda: self.fn(*static_in), self.pool, warmups=self.warmup)
        return graph, static_in, static_out


def snapshot(*tensors: torch.Tensor) -> Callable[[], None]:
    """Copies of ``tensors``; calling what it returns writes them back in place (a step or round run
    ahead of its use, then undone: its warm-ups, a shape prepared while a server is idle)."""
    saved = [t.clone() for t in tensors]

    def restore() -> None:
        for dst, src in zip(tensors, saved):
            dst.copy_(src)
    return restore


def capture(run: Callable[[], T], pool: object, warmups: int = 2,
            warm: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``run`` captured as a CUDA graph (in memory pool ``pool``), after ``warmups`` warm-up calls
    of ``warm`` (default: ``run``) on a side stream, as torch.cuda.graphs asks (lazy
    initialisations, the allocator, a compilation). The warm-ups run on the real inputs, so whatever
    they write in place is what the caller asked for. Returns the graph and ``run``'s outputs,
    which each replay overwrites (registered: other graphs may read them in place, :class:`StepGraphs`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            (warm or run)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    _register_outputs(out)
    return graph, out


def replay_us(graph: torch.cuda.CUDAGraph, reps: int, trials: int = 1) -> float:
    """Microseconds of one replay of a captured ``graph`` between two CUDA events: what its kernels
    and the gaps between them cost, without the host. The fastest of ``trials`` runs of ``reps``
    replays, after one replay that is not timed (benchmarks/matvec_gpu.py, decode_attention_gpu.py)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    best = float("inf")
    for _ in range(trials):
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps * 1e3)
    return best


def raise_recompile_limits() -> None:
    """One code object compiled per shape (the fast target's functions x (token bucket, key bucket)
    pairs, the drafter's steps x trees): torch's default limit (8) would fall back to eager
    silently, so raise it. And every compiled functools.partial runs through one wrapper code
    object of torch's (``external_utils.inner``), so all the targets a process builds share its
    cache: at 128 the 16th compiled target of one test run on the H200 failed with
    ``FailOnRecompileLimitHit`` (2026-12-02); hence 1024.

    For every thread: since torch 2.12 a setting made in code is the setting of the thread that
    made it (a ContextVar), and a server compiles on its decode thread too (the shapes it prepares
    while idle, a shape at its first use), where the limit stayed 8 and the 9th shape of a
    function ran eagerly (torch 2.13, a CPU test). So the shared default is raised as well."""
    import torch._dynamo.config as dynamo_config

    entries = getattr(dynamo_config, "_config", {})
    for name, least in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                        ("accumulated_recompile_limit", 8192), ("accumulated_cache_size_limit", 8192)):
        if isinstance(getattr(dynamo_config, name, None), int):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), least))
            entry = entries.get(name) if isinstance(entries, dict) else None
            if entry is not None and isinstance(getattr(entry, "default", None), int):
                entry.default = max(entry.default, least)  # what threads without a setting of their own read


def brief_error(error: str, head: int = 300, tail: int = 900) -> str:
    """A compiler error cut for a warning: its start (the exception's type and first line) and its
    end, where a subprocess's traceback puts the cause (Triton's own message comes last)."""
    return error if len(error) <= head + tail else f"{error[:head]} [...] {error[-tail:]}"


class CompiledOrEager:
    """``fn`` compiled with ``torch.compile(backend=backend, fullgraph=True, dynamic=dynamic)``, one
    compilation per input shape at its first call (do that first call outside a CUDA-graph capture:
    :func:`capture`'s warm-ups do); ``dynamic=True`` compiles sizes as symbols, so one compilation
    serves many shapes (a batched round's rows, depths and key buckets: a few, not hundreds). Inductor fuses a drafter step's norms, rope, cache writes,
    softmax and SiLU into a few kernels, so a captured draft replays a third of the kernels.

    A compiler that fails (no C compiler for Triton, an inductor bug) is reported once, with a
    warning and ``error``, and ``fn`` runs eagerly from then on: the same results, only slower. An
    error of ``fn`` itself then raises again, eagerly. ``seconds`` is the time of the calls that
    compiled (first calls per shape)."""

    def __init__(self, fn: Callable[..., Any], backend: str | Callable[..., Any] = "inductor", name: str = "",
                 dynamic: bool = False) -> None:
        raise_recompile_limits()
        self.eager, self.name = fn, name or getattr(fn, "__qualname__", "step")
        self.compiled: Callable[..., Any] | None = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
        self.error: str | None = None
        self.seconds = 0.0
        self._seen: set[tuple] = set()

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args)
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        first = key not in self._seen
        t0 = time.perf_counter()
        try:
            out = self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager function
            self.error = f"{type(e).__name__}: {e}"
            warnings.warn(f"torch.compile of {self.name} failed ({brief_error(self.error)}); it runs eagerly", stacklevel=2)
            self.compiled = None
            return self.eager(*args)
        if first:
            self._seen.add(key)
            self.seconds += time.perf_counter() - t0
        return out
