"""`eyas bench` over temperatures and trees: each temperature run and reported on its own, every tree
of it on the same prompts, ``--tree auto`` held against the fixed trees and against its prediction.

    for each temperature T (in the order given):
        the trees of T: the primary tree (``--tree`` at 0, ``--tree-sampled`` above it; ``auto``: the
        tree ``--tree auto`` chose for T), then every other ``--tree`` given, each spec run once
        (a fixed tree that auto also chose is one run under both names)
        warm-up:     the first prompt through every tree and method at T, untimed (a tree or a
                     temperature new to the process compiles and captures in its first request)
        for each set: bench_trees(set, the trees of T, T)       (eyas.bench.run: per prompt, each tree,
                                                                 then plain, then the HF baseline)
        overall:     the sets pooled (eyas.bench.run.merge)
        prediction:  auto's predicted tau, round and speedup against the overall measured ones
                     (eyas.tune.PredictionCheck)
        comparison:  auto's tokens/s (mean of per-prompt rates, all sets pooled) over the best fixed
                     tree's, and the bars: within 3% of the best fixed tree, tau within 10%

The JSON of a temperature keeps the keys a one-temperature bench always had (``tree``, ``sets``,
``tree_auto``) and adds ``trees`` (every tree's sets and overall), ``overall`` and ``comparison``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from eyas.bench.run import SetResult, bench_trees, merge
from eyas.data.conversations import Conversation
from eyas.drafter.model import Eagle3Drafter
from eyas.engine import SamplingParams, Target, TreeSpec
from eyas.targets import LoadedTarget

if TYPE_CHECKING:
    from eyas.bench.hf import HFGenerate
    from eyas.tune import PredictionCheck, TreeChoice

AUTO = "auto"
AUTO_BAR = 0.97  # --tree auto's tokens/s at least this fraction of the best fixed tree's
TAU_BAR = 0.10  # --tree auto's predicted tau within this relative error of the measured one


@dataclass
class TreeOption:
    """A tree benchmarked at one temperature: its spec, the texts that asked for it (``auto`` and/or
    a fixed ``DEPTH,TOPK,TOTAL``), in the order given."""

    spec: TreeSpec
    asked_as: list[str] = field(default_factory=list)

    @property
    def auto(self) -> bool:
        return AUTO in self.asked_as

    @property
    def fixed(self) -> bool:
        return any(a != AUTO for a in self.asked_as)


def tree_options(trees: Sequence[tuple[str, TreeSpec]]) -> list[TreeOption]:
    """(asked as, spec) pairs -> one option per distinct spec, in first-seen order, with every name it
    was asked by."""
    out: dict[TreeSpec, TreeOption] = {}
    for asked, spec in trees:
        out.setdefault(spec, TreeOption(spec)).asked_as.append(asked)
    return list(out.values())


@dataclass
class TreeRun:
    """One tree at one temperature: its result per set (in order)."""

    option: TreeOption
    sets: list[SetResult]

    @property
    def overall(self) -> SetResult:
        return merge(self.sets)

    def to_dict(self) -> dict[str, Any]:
        s = self.option.spec
        return {"tree": s.label, "depth": s.depth, "top_k": s.top_k, "total_tokens": s.total_tokens,
                "asked_as": self.option.asked_as, "auto": self.option.auto,
                "sets": [r.summary() for r in self.sets], "overall": self.overall.summary()}


@dataclass
class TemperatureRun:
    """Every tree of one temperature (the primary first), and ``--tree auto``'s choice there, if any."""

    temperature: float
    runs: list[TreeRun]
    choice: TreeChoice | None = None

    @property
    def primary(self) -> TreeRun:
        return self.runs[0]

    def check(self) -> PredictionCheck | None:
        """Auto's prediction against the auto tree's overall measurements (None without auto)."""
        if self.choice is None:
            return None
        from eyas.tune import check_prediction

        run = next(r for r in self.runs if r.option.spec == self.choice.spec)
        o = run.overall.summary()
        return check_prediction(self.choice, o["tau"], o["round_ms"], o["speedup_vs_plain"])

    def comparison(self) -> dict[str, Any] | None:
        """Auto against the best fixed tree (tokens/s, mean of per-prompt rates, all sets pooled);
        None unless both ran."""
        auto = next((r for r in self.runs if r.option.auto), None)
        fixed = [r for r in self.runs if r.option.fixed]
        if auto is None or not fixed:
            return None
        rate = {id(r): r.overall.summary()["tokens_per_s"]["speculative"] for r in self.runs}
        best = max(fixed, key=lambda r: rate[id(r)])
        ratio = rate[id(auto)] / rate[id(best)] if rate[id(best)] else None
        check = self.check()
        return {
            "auto": auto.option.spec.label, "best_fixed": best.option.spec.label,
            "auto_tokens_per_s": rate[id(auto)], "best_fixed_tokens_per_s": rate[id(best)],
            "auto_vs_best_fixed": None if ratio is None else round(ratio, 4),
            "auto_within_3pct_of_best_fixed": None if ratio is None else ratio >= AUTO_BAR,
            "tau_error": check.tau_error if check else None,
            "tau_within_10pct": (abs(check.tau_error) <= TAU_BAR) if check and check.tau_error is not None else None,
            "fixed": [{"tree": r.option.spec.label, "tokens_per_s": rate[id(r)],
                       "tau": r.overall.summary()["tau"]} for r in fixed],
        }

    def to_dict(self) -> dict[str, Any]:
        p = self.primary
        s = p.option.spec
        out: dict[str, Any] = {
            "temperature": self.temperature, "tree": [s.depth, s.top_k, s.total_tokens], "tree_label": s.label,
            "tree_asked_as": p.option.asked_as, "sets": [r.summary() for r in p.sets],
            "overall": p.overall.summary(), "trees": [r.to_dict() for r in self.runs],
        }
        if self.choice is not None:
            out["tree_auto"] = {**self.choice.to_dict(), **self.check().to_dict()}  # type: ignore[union-attr]
        comparison = self.comparison()
        if comparison is not None:
            out["comparison"] = comparison
        return out


def bench_temperature(temperature: float, options: Sequence[TreeOption],
                      sets: Sequence[tuple[str, Sequence[Conversation]]], loaded: LoadedTarget, target: Target,
                      drafter: Eagle3Drafter, max_new_tokens: int, *,
                      seed: int = 0, progress: bool = True, hf: HFGenerate | None = None,
                      sampled_drafts: str = "top-k", choice: TreeChoice | None = None) -> TemperatureRun:
    """Every set at ``temperature`` with every tree of ``options`` (the primary first), plain decoding
    and ``hf`` on the same prompts (module docstring); ``choice``: ``--tree auto``'s at this
    temperature, whose tree must be one of ``options``."""
    if choice is not None and all(o.spec != choice.spec for o in options):
        raise ValueError(f"bench_temperature: --tree auto chose {choice.spec.label}, which is not among the trees run")
    sampling = SamplingParams(temperature)
    per_tree: list[list[SetResult]] = [[] for _ in options]
    for k, (name, convs) in enumerate(sets):
        results = bench_trees(name, convs, loaded, target, drafter, [o.spec for o in options], sampling,
                              max_new_tokens, seed=seed, progress=progress, hf=hf, sampled_drafts=sampled_drafts,
                              warm=k == 0)  # every tree and method once at this temperature, untimed
        for acc, r in zip(per_tree, results):
            acc.append(r)
    return TemperatureRun(float(temperature), [TreeRun(o, r) for o, r in zip(options, per_tree)], choice)
