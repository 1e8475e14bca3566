"""Start-up of ``eyas serve``: load the pair, check it, and refuse a mismatch before a port opens.

Order (each step only when the previous passed, or with ``--force``):

1. load the target (``eyas.targets.load_target``: float32 on a CPU, bf16 on a GPU);
2. the doctor's static stage on the pair (:func:`eyas.doctor.run.static_check`, engine ``eyas``):
   the directory as eyas reads it against training (boundaries, the training fingerprint's
   boundaries, norm flags, shapes, vocabularies) and the contract against the live target (weights
   fingerprint, shape, chat template, special tokens);
3. the contract check of the loader (``eyas.interop.load_drafter``), which raises on a mismatch;
4. the engine's target (``eyas.engine.build_target``) and, on a GPU, its warm-up and the
   drafter's and the acceptance's for the served trees (``--tree`` for greedy requests,
   ``--tree-sampled`` for the others; short generations, greedy and sampled: :func:`warm_rounds`).
   On a warm compile cache only what a short request runs is compiled before the server is ready
   (over the key bucket of ``START_CONTEXT`` tokens, the token buckets the trees verify in and the
   largest: :func:`start_buckets`; what greedy and temperature rounds run); the rest (the other
   token buckets, longer key buckets, top-p's acceptance) is ``Served.deferred``, which the decode
   worker runs one unit at a time after a quiet while (meanwhile a step pads to a larger ready
   bucket, or compiles at its first use).

Compiled artifacts (inductor's FX graph and kernel caches, Triton's kernels) are kept in eyas' cache
directory (:func:`compile_cache`: ``$EYAS_CACHE/compile``, unless ``TORCHINDUCTOR_CACHE_DIR`` is
set), so a second start on the same machine compiles from a warm cache; :class:`Startup` records
how long each stage took and whether the cache was warm (``/health`` reports it).

A failed check refuses to start: :class:`Preflight` lists every failed field with the expected and
found value and the fix (a config edit, or the words of one), and the CLI exits 1. With ``--force``
the server starts anyway; ``forced`` and the failures stay visible in ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from eyas.contract import ContractError
from eyas.doctor.common import FAIL, WARN, edits_text
from eyas.doctor.run import static_check
from eyas.engine import SamplingParams, TreePlan, TreeSpec, build_target
from eyas.interop import load_drafter, read_contract, resolve_draft
from eyas.targets import LoadedTarget, load_target
from eyas.targets.loading import cache_root
from eyas.watch.verdict import Prediction, prediction_from_metrics


@dataclass(frozen=True)
class Problem:
    """One failed (or warned) check, as /health and the refusal print it."""

    level: str  # fail | warn
    code: str
    message: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "code": self.code, "message": self.message, "fix": self.fix}

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}" + (f"\n    fix: {self.fix}" if self.fix else "")


@dataclass
class Preflight:
    """What the start-up checks found, and whether the server was forced past failures."""

    problems: list[Problem] = field(default_factory=list)
    forced: bool = False

    @property
    def failures(self) -> list[Problem]:
        return [p for p in self.problems if p.level == FAIL]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.level == WARN]

    @property
    def ok(self) -> bool:
        return not self.failures

    def refusal(self, target: str, draft: str) -> str:
        lines = [f"eyas serve: refusing to serve {draft} with {target}: {len(self.failures)} mismatch(es) between "
                 f"the drafter and the target, which would serve it hidden states other than it was trained on:"]
        lines += [f"  {p}" for p in self.failures]
        lines.append(f"Diagnose: eyas doctor --target {target} --draft {draft}. Start anyway with --force "
                     f"(/health and /metrics then say so).")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "forced": self.forced, "failures": [p.to_dict() for p in self.failures],
                "warnings": [p.to_dict() for p in self.warnings]}


class RefusedError(Exception):
    """The pair failed the start-up checks and ``force`` was not given; ``str`` is the refusal."""

    def __init__(self, preflight: Preflight, text: str) -> None:
        super().__init__(text)
        self.preflight = preflight

    def __reduce__(self) -> tuple[Any, ...]:  # from the engine process to the HTTP side
        return (RefusedError, (self.preflight, str(self)))


@dataclass
class Startup:
    """How the start-up went: seconds per stage, and the compile cache it used."""

    seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds (load, check, compile, ...)
    compile_cache: str | None = None  # the directory of inductor's and Triton's caches
    warm_cache: bool = False  # the cache held compiled artifacts before this start
    deferred: int = 0  # compilations left to the worker's idle time (Served.deferred)

    @property
    def total_s(self) -> float:
        return round(sum(self.seconds.values()), 2)

    def to_dict(self) -> dict[str, Any]:
        return {"total_s": self.total_s, "seconds": {k: round(v, 2) for k, v in self.seconds.items()},
                "compile_cache": self.compile_cache, "warm_cache": self.warm_cache, "deferred": self.deferred}


def compile_cache() -> tuple[str, bool]:
    """Point inductor's and Triton's caches into eyas' cache directory (unless the user set them);
    returns the directory and whether it already held compiled artifacts (a warm start)."""
    root = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_root() / "compile")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    warm = root.is_dir() and any(root.iterdir())
    return str(root), warm


@dataclass
class Served:
    """Everything the server serves with, loaded and checked."""

    loaded: LoadedTarget
    drafter: Any  # Eagle3Drafter
    target: Any  # the engine's Target
    tree: TreePlan  # the tree of greedy requests and the tree of sampled ones
    draft_path: Path
    target_name: str
    model_name: str
    preflight: Preflight
    prediction: Prediction | None
    startup: Startup = field(default_factory=Startup)
    # Start-up work left for the decode worker's idle time (compilations no short request needs:
    # other token buckets, longer key buckets, top-p's acceptance), run one at a time when quiet
    deferred: list[Callable[[], object]] = field(default_factory=list)

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def max_length(self) -> int:
        return int(self.target.max_length)

    def info(self) -> "ServedInfo":
        return ServedInfo(self.loaded.tokenizer, self.loaded.vocab_size, self.max_length, self.model_name,
                          self.target_name, self.draft_path, self.tree, self.preflight, self.prediction, self.startup,
                          self.target.implementation)


@dataclass
class ServedInfo:
    """What the HTTP side serves with (the routes, /health, /metrics, the watchdog): no weights, no
    engine, so that it pickles from an engine process (:mod:`eyas.serve.engine_process`)."""

    tokenizer: Any
    vocab_size: int  # V: valid token ids of a completion prompt are 0..V-1
    max_length: int  # the context: prompt and answer
    model_name: str
    target_name: str
    draft_path: Path
    tree: TreePlan
    preflight: Preflight
    prediction: Prediction | None
    startup: Startup
    implementation: str  # the engine's target (fast, generic, ...)


def check_pair(loaded: LoadedTarget, draft_path: Path, log: Callable[[str], None] | None = None) -> Preflight:
    """The doctor's static stage on the pair (every failure and warning, with its fix)."""
    stage = static_check(loaded, draft_path, log=log)
    pf = Preflight()
    for f in stage.findings:
        if f.level not in (FAIL, WARN):
            continue
        fix = f.fix or (edits_text(f.edits, str(draft_path)) if f.edits else None)
        pf.problems.append(Problem(f.level, f.code, f.message, fix))
    return pf


def load_served(target: str, draft: str | None, *, tree: str = "5", tree_sampled: str | None = None,
                force: bool = False, device: str = "auto", target_impl: str = "auto", matvec: str = "auto",
                attention: str = "auto", model_name: str | None = None,
                log: Callable[[str], None] = lambda m: None) -> Served:
    """Load and check the pair (see the module docstring); raises :class:`RefusedError` on a mismatch
    without ``force``, and eyas' own errors (a missing directory, a bad ``--tree``) as they are.
    ``tree``: every request's tree, or 'auto'; ``tree_sampled``: the tree of requests at a temperature
    above 0 (default: ``tree``'s). ``target_impl``, ``matvec`` and ``attention``: the engine's target
    (:func:`eyas.engine.build_target`)."""
    auto = tree.strip().lower() == "auto"
    plan = None if auto else TreePlan.parse(tree, tree_sampled)
    draft_path = resolve_draft(draft, target)
    if not draft_path.is_dir():
        raise FileNotFoundError(f"--draft {draft_path}: no such directory")
    startup = Startup()
    startup.compile_cache, startup.warm_cache = compile_cache()
    clock = [time.perf_counter()]

    def done(stage: str) -> None:
        now = time.perf_counter()
        startup.seconds[stage] = startup.seconds.get(stage, 0.0) + now - clock[0]
        clock[0] = now

    log(f"loading the target {target}")
    loaded = load_target(target, dtype="auto", device=device)
    done("load")
    log(f"checking {draft_path} against it (the doctor's static stage)")
    pf = check_pair(loaded, draft_path, log)
    if not pf.ok and not force:
        raise RefusedError(pf, pf.refusal(target, str(draft_path)))
    try:
        drafter, contract = load_drafter(draft_path, target=loaded, tokenizer=loaded.tokenizer, force=force)
    except ContractError as e:  # a mismatch the static stage did not name
        pf.problems.append(Problem(FAIL, "contract", str(e), "serve the drafter with the target it was trained for"))
        raise RefusedError(pf, pf.refusal(target, str(draft_path))) from e
    pf.forced = force and not pf.ok
    drafter = drafter.to(loaded.device, dtype=loaded.dtype).eval()
    from eyas.convention import CaptureSpec

    engine_target = build_target(loaded.model, CaptureSpec(tuple(contract.capture.boundaries), loaded.num_blocks),
                                 target_impl, matvec=matvec, attention=attention)
    done("check")
    graphs = getattr(engine_target, "cuda_graphs", False)
    deferred: list[Callable[[], object]] = []
    if graphs:
        # Cold: every token and key bucket up to the capacity now (a long request should not wait
        # for a compilation from scratch). Warm: over a short request's keys, the token buckets
        # of the plan's verification and the largest (a prompt's chunks) now; the others in the
        # background (loaded from the cache, a fraction of a second each), a step meanwhile padded
        # to a larger bucket that is ready (LlamaTarget.prefer_ready; with --tree auto only once
        # its timings and the warm rounds have compiled the buckets they use).
        log("compiling the fast target's steps and capturing CUDA graphs")
        if startup.warm_cache:
            engine_target.warmup(buckets=start_buckets(engine_target.buckets, plan), context=START_CONTEXT)
            engine_target.prefer_ready = plan is not None
        else:
            engine_target.warmup(context=engine_target.max_length)
    if plan is None:  # --tree auto: timed on this hardware, calibrated at temperatures 0 and 1
        plan = auto_trees(engine_target, drafter, loaded, contract, log)
        if tree_sampled:
            plan = TreePlan(plan.greedy, TreeSpec.parse(tree_sampled))
    if graphs:
        prompt = loaded.tokenizer.encode("Hello")
        now, later = (WARM_SAMPLING[:1], WARM_SAMPLING[1:]) if startup.warm_cache else (WARM_SAMPLING, ())
        warm_rounds(engine_target, drafter, plan, prompt, log, sampled=now)
        deferred += [functools.partial(warm_round, engine_target, drafter, plan.sampled, prompt, sampling)
                     for sampling in later]
        if startup.warm_cache:
            engine_target.prefer_ready = True
            deferred += [functools.partial(engine_target.warmup, buckets=[B], keys=[K])
                         for B, K in engine_target.unwarmed()]
    startup.deferred = len(deferred)
    if deferred:
        log(f"{len(deferred)} more compilations (other buckets, longer contexts, top-p) run while the server is idle")
    done("compile")
    recorded = read_contract(draft_path)
    prediction = prediction_from_metrics(recorded.metrics if recorded is not None else None,
                                         f"{draft_path}/eyas.json contract.metrics")
    name = model_name or (target if not Path(target).exists() else Path(target).name)
    return Served(loaded, drafter, engine_target, plan, draft_path, target, name, pf, prediction, startup, deferred)


def start_buckets(buckets: Sequence[int], plan: TreePlan | None) -> list[int]:
    """The token buckets a warm start compiles before it is ready: the one each tree of ``plan``
    verifies in (its drafts and the root; none known yet with --tree auto) and the largest, which
    every shorter step can pad to (a prompt's chunks, a plain step)."""
    need = {max(buckets)}
    for spec in (plan.greedy, plan.sampled) if plan is not None else ():
        need.add(next((b for b in sorted(buckets) if b >= spec.total_tokens + 1), max(buckets)))
    return sorted(need)


# The context whose key buckets a warm start compiles before it is ready (a short request's: 512
# keys with the default ladder); the longer ones follow in the background (Served.deferred).
START_CONTEXT = 512

# What the start-up's warm rounds sample with: each filter combination a request may bring (the server
# takes temperature and top_p) has its own compiled acceptance; the temperature is the graph's input,
# so one warm-up at any temperature serves them all.
WARM_SAMPLING = (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9))


def warm_rounds(target: Any, drafter: Any, plan: TreePlan, prompt: list[int], log: Callable[[str], None],
                sampled: tuple[SamplingParams, ...] = WARM_SAMPLING) -> None:
    """Compile and capture, now, what requests' rounds run (each is compiled or captured at its first
    use, seconds that no request should pay): the drafter's steps for each tree of the plan, and the
    acceptance of greedy and of sampled rounds (``sampled``: default :data:`WARM_SAMPLING`)."""
    for spec, samplings in ((plan.greedy, (SamplingParams(),)), (plan.sampled, sampled)):
        log(f"compiling the drafter's steps and the acceptance for tree {spec.label} "
            f"({'greedy' if samplings[0].greedy else 'sampled'} requests)")
        for sampling in samplings:
            warm_round(target, drafter, spec, prompt, sampling)


def warm_round(target: Any, drafter: Any, spec: TreeSpec, prompt: list[int], sampling: SamplingParams) -> None:
    """A short generation with ``spec`` and ``sampling``: what its rounds run, compiled and captured."""
    from eyas.engine import speculative_generate

    speculative_generate(target, drafter, prompt, tree=spec, sampling=sampling, max_new_tokens=2 * spec.depth + 2,
                         generator=torch.Generator(device=target.device).manual_seed(0))


def auto_trees(target: Any, drafter: Any, loaded: LoadedTarget, contract: Any, log: Callable[[str], None]) -> TreePlan:
    """``--tree auto`` as ``eyas bench`` does it (:func:`eyas.tune.tune_trees`): the target's
    verification and the drafter's rounds timed on this hardware, acceptance calibrated on text the
    target decodes at temperature 0 and at 1 (the calibration prompts shipped with eyas, drawn from
    training sets); the greedy tree and the sampled one with the best predicted speedup."""
    from eyas.tune import tune_trees
    from eyas.tune.calibration import calibration_prompts

    log("--tree auto: timing the target's verification and the drafter's rounds, calibrating at temperatures 0 and 1")
    choice = tune_trees(target, drafter, calibration_prompts(loaded.tokenizer), contract, temperatures=(0.0, 1.0),
                        eos_token_ids=list(loaded.eos_ids))
    for c in choice.choices:
        log(c.reason)
    return choice.plan


def generator_for(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
