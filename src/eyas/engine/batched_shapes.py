"""The batched engine's compiled step shapes (:class:`~eyas.engine.batched.BatchedLlama` inherits
them): a decode step's shape is (K keys, mode, first n rows); on a GPU each shape is compiled and
captured as a CUDA graph at its first use (:meth:`StepShapes.decode_step`), or ahead of it without
running it (:meth:`StepShapes.prepare`: a server's quiet time), and a prepared shape with at least
the keys, rows and mode of another can stand in for it (:meth:`StepShapes.cover`; masked keys and
idle rows change no busy row's token, and a greedy row takes the argmax in a sampled step).

What it needs of the engine: ``state`` (the rows, :class:`~eyas.engine.batched_steps.Rows`), ``rows``,
``device``, ``capacity``, ``compile``, ``cuda_graphs``, ``implementation``, ``compile_s``,
``_graphs`` ((K, mode, n) -> CUDA graph), ``_compiled`` (the shapes run compiled without graphs),
``_pool``, ``buckets()``, ``ensure()`` and ``_decode(K, mode, n)``, the step itself.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Sequence

import torch

from eyas.engine.batched_steps import MODES
from eyas.engine.graphs import capture, snapshot


class StepShapes:
    """Compilation, capture, preparation and cover of the decode step's shapes (module docstring)."""

    state: Any
    rows: int
    device: torch.device
    capacity: int
    compile: bool
    cuda_graphs: bool
    implementation: str
    compile_s: float
    _graphs: dict
    _compiled: set
    _pool: Any

    def buckets(self) -> list[int]:
        raise NotImplementedError

    def ensure(self, capacity: int, max_new_tokens: int) -> None:
        raise NotImplementedError

    def _decode(self, K: int, mode: str, n: int | None = None) -> None:
        raise NotImplementedError

    def _shape(self, K: int, mode: str, n: int | None) -> tuple[int, str, int]:
        """A step's key in ``_graphs`` / ``_compiled``: (K, mode, rows), n None meaning all rows."""
        return int(K), mode, self.rows if n is None else int(n)

    @property
    def _done(self) -> dict | set:
        """The shapes that run without compiling first: captured (with graphs) or compiled."""
        return self._graphs if self.cuda_graphs else self._compiled

    def decode_step(self, K: int, mode: str, n: int | None = None) -> None:
        """One decode step of the first ``n`` rows (default all; rows past n keep their state): its
        graph replayed (captured at first use), else run (compiled at first use)."""
        key = self._shape(K, mode, n)
        if self.cuda_graphs:
            graph = self._graphs.get(key) or self._capture(*key)
            if graph is not None:
                graph.replay()
                return
        first = self.compile and key not in self._compiled
        t0 = time.perf_counter()
        self._decode(*key)
        if first:  # its compilation: timed apart
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._compiled.add(key)
            self.compile_s += time.perf_counter() - t0

    def prepared(self, K: int, mode: str, n: int | None = None) -> bool:
        """Whether the step of (K, ``mode``, first ``n`` rows) runs without compiling first (compiled
        and captured already, or nothing is compiled)."""
        return not (self.compile or self.cuda_graphs) or self._shape(K, mode, n) in self._done

    def cover(self, K: int, mode: str, n: int) -> tuple[int, str, int] | None:
        """The cheapest prepared step that can stand in for (K, ``mode``, ``n``): at least as many
        keys (the extra ones are masked) and rows (the extra ones are idle), and a mode that serves
        these rows (greedy rows take the argmax in a sampled step; top-p's step serves rows without
        it): fewest rows, then keys, then the narrowest mode. None: no prepared step covers it."""
        found = [(rows, k, MODES.index(m)) for k, m, rows in self._done
                 if k >= K and rows >= n and MODES.index(m) >= MODES.index(mode)]
        if not found:
            return None
        rows, k, m = min(found)
        return k, MODES[m], rows

    @property
    def compile_per_shape_s(self) -> float | None:
        """The mean seconds a step shape has cost to compile and capture so far (None: none yet)."""
        return self.compile_s / len(self._done) if self._done else None

    @torch.no_grad()
    def prepare(self, K: int, mode: str, n: int | None = None) -> bool:
        """Compile (and on a GPU capture) the step of (K, ``mode``, first ``n`` rows) now, leaving
        the rows' state as it was (a server's idle time: the step's first use then replays it);
        False where there is nothing to do (prepared already, or nothing compiled)."""
        key = self._shape(K, mode, n)
        if self.prepared(*key):
            return False
        if self.cuda_graphs:
            return self._capture(*key) is not None
        t0 = time.perf_counter()
        restore = self._snapshot()
        self._decode(*key)
        restore()
        self._compiled.add(key)
        self.compile_s += time.perf_counter() - t0
        return True

    def _snapshot(self) -> Callable[[], None]:
        """A copy of the rows' state a step changes; calling what it returns puts it back (a step
        also writes each row's cache entry at its own position, which the next real step writes again)."""
        st = self.state
        assert st is not None
        return snapshot(st.ids, st.pos, st.active, st.n_gen, st.out)

    def _capture(self, K: int, mode: str, n: int | None = None) -> torch.cuda.CUDAGraph | None:
        """Compile (in the warm-ups) and capture the step of bucket K in ``mode``. The warm-ups run
        real steps: the state is restored from a snapshot before each of them and after the capture,
        so the step then replayed is the one the caller asked for."""
        t0 = time.perf_counter()
        restore = self._snapshot()

        def warm() -> None:
            restore()
            self._decode(K, mode, n)

        try:
            graph, _ = capture(lambda: self._decode(K, mode, n), self._pool, warm=warm)
        except RuntimeError as e:  # an op a graph cannot hold: the same steps, eagerly
            warnings.warn(f"fast engine: CUDA graph capture failed, decoding without graphs: {e}", stacklevel=3)
            self.cuda_graphs = False
            self.implementation = "+".join(["fast"] + ["compile"] * self.compile)
            restore()
            return None
        restore()
        torch.cuda.synchronize(self.device)
        self._graphs[self._shape(K, mode, n)] = graph
        self.compile_s += time.perf_counter() - t0
        return graph

    @torch.no_grad()
    def warmup(self, max_prompt_tokens: int, max_new_tokens: int, modes: Sequence[str] = ("greedy",)) -> float:
        """Compile and capture every key bucket the calls will use (for prompts up to
        ``max_prompt_tokens`` and answers up to ``max_new_tokens``) in ``modes`` now, so that timings
        can leave compilation out. All rows idle; returns the seconds it took."""
        self.ensure(max_prompt_tokens + max_new_tokens, max_new_tokens)
        st = self.state
        assert st is not None
        st.active.zero_()
        st.pos.zero_()
        t0 = time.perf_counter()
        for mode in modes:
            for K in self.buckets():
                if K <= self.capacity:
                    self.decode_step(K, mode)
        return time.perf_counter() - t0
