"""A stand-in engine for ``eyas serve``: RowBatch's interface with a step that only waits, so that
what clients receive short of every row its tokens at every wait is the serving layer's own work
(``serve_overhead_cpu.py``). A module of its own so that an engine process can import it by name.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

TEXT = ("The committee met on Tuesday to review the proposal. After a long discussion about costs, "
        "schedules and the risks of delay, the members agreed to fund a smaller first phase and to "
        "report back in the spring with measured results from the pilot sites. ")


class WaitBatch:
    """RowBatch's interface as BatchWorker uses it, with a step that only waits (module docstring)."""

    def __init__(self, rows: int, text_ids: list[int], step_s: float, speculative: bool) -> None:
        self.rows, self.text, self.step_s = rows, text_ids, step_s
        self.spec = object() if speculative else None  # BatchSpeculation turns on where there is a drafter
        self.engine = SimpleNamespace(compile_s=0.0)
        self.compile_s = 0.0  # nothing compiles: every step and round is ready
        self.limit: list[int | None] = [None] * rows  # None: free
        self.generated = [0] * rows

    def round_ready(self, shape: tuple) -> bool:
        return True

    def round_shape(self, draft: Any) -> tuple:
        return (len(self.busy), draft, "greedy", 0)

    def charge(self, shape: tuple, seconds: float) -> None:
        pass

    @property
    def free(self) -> list[int]:
        return [r for r, lim in enumerate(self.limit) if lim is None]

    @property
    def busy(self) -> list[int]:
        return [r for r, lim in enumerate(self.limit) if lim is not None]

    def mode(self) -> str:
        return "greedy"

    def _tokens(self, row: int, n: int):  # noqa: ANN202 - RowTokens
        from eyas.engine.continuous import RowTokens

        n = min(n, self.limit[row] - self.generated[row])
        start = self.generated[row]
        self.generated[row] += n
        toks = [self.text[(start + i) % len(self.text)] for i in range(n)]
        return RowTokens(row, toks, self.generated[row] >= self.limit[row], drafted=n - 1, accepted=n - 1)

    def admit(self, requests: list) -> list:
        time.sleep(self.step_s)  # a prefill: about a step
        out = []
        for q, row in zip(requests, self.free):
            self.limit[row], self.generated[row] = q.max_new_tokens, q.generated if q.resumed else 0
            if not q.resumed:
                out.append(self._tokens(row, 1))
        return out

    def step(self) -> list:
        time.sleep(self.step_s)
        return [self._tokens(r, 1) for r in self.busy]

    def speculate(self, draft: Any, shape: tuple | None = None) -> list:  # a TreeSpec (a chain: top_k 1)
        depth = draft.depth
        time.sleep(self.step_s * (1 + 0.25 * depth))  # a round: the verification plus the drafts
        return [self._tokens(r, depth + 1) for r in self.busy]

    def release(self, row: int) -> None:
        self.limit[row] = None


def stand_in_worker(served: Any, max_rows: int | None, *, step_s: float, speculative: bool, **kw: Any) -> Any:
    """make_worker's signature: a BatchWorker of ``max_rows`` rows around a :class:`WaitBatch`
    whose step waits ``step_s``; a lone request takes a row (the real engine never runs)."""
    from eyas.serve.batching import BatchWorker
    from eyas.serve.policy import SpeculationPolicy

    text_ids = served.tokenizer(TEXT * 4, add_special_tokens=False)["input_ids"]
    kw.pop("lone_sessions", None)  # lone requests take a row here: no lanes
    worker = BatchWorker(served, WaitBatch(int(max_rows or 8), text_ids, step_s, speculative), **kw)
    worker.policy = SpeculationPolicy("off")
    return worker
