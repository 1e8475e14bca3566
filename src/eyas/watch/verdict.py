"""The acceptance verdict: served speculative acceptance against what training predicted.

One module, used by ``eyas serve``'s watchdog (:mod:`eyas.serve.watchdog`) and by ``eyas watch``
(:mod:`eyas.watch.run`), so both say the same thing about the same numbers.

Definitions (a "round" is one drafting-verification step; vLLM calls it a draft):

    served acceptance at position d   a_d = rounds whose draft token at depth d+1 was accepted / rounds
                                      (vLLM: num_accepted_tokens_per_pos[d] / num_drafts)
    predicted acceptance at d         p_d = prod_{i<=d} cond_acc_i, from the held-out metrics training
                                      wrote into eyas.json (cond_acc_i: TTT step i right given steps
                                      0..i-1 right); a chain accepts depth d+1 exactly when the first
                                      d+1 drafts are right, so p_d is what a chain of that depth serves
    accepted drafts per round         S = sum_{d<k} a_d = accept length - 1 (k: the depth served)
    predicted drafts per round        E = sum_{d<k} p_d   (simulated accept length - 1 for depth k)
    ratio                             S / E

The verdict. With per-position counts (eyas, vLLM) the ratio is a_0 / p_0, the first position's:
it is the position that reads the target's captured features directly (deeper ones read the
drafter's own fed-back state, so every earlier shortfall compounds into them), and it has the most
data. With only an accept length (SGLang) it is S / E over the served depth.

    broken   first-position ratio < BROKEN_RATIO (0.5), or accept-length ratio < BROKEN_LENGTH_RATIO (0.25)
    low      first-position ratio < LOW_RATIO (0.8), or accept-length ratio < LOW_LENGTH_RATIO (0.5)
    ok       otherwise (a tree accepts more than the chain prediction: ratio > 1, still ok)
    insufficient_data  fewer than ``min_rounds`` rounds observed (a few rounds decide nothing)
    no_prediction      the drafter's eyas.json records no held-out metrics to compare with

Why these numbers. Served acceptance sits below the training figure even when nothing is wrong:
training counts every token position once, serving counts rounds, and a round that accepts much
covers many tokens, so rounds over-sample the hard places. Measured on this project's CPU (the shipped
SmolLM2 drafter, chain of 5, 8 MT-bench and GSM8K prompts, 64 tokens each): healthy, a_0 = 0.41
against p_0 = 0.63 (ratio 0.65) and accept length 1.73 against 2.74 (ratio 0.42); the same drafter with
its eyas.json boundaries shifted to [0, 2, 15] (the embeddings counted as a layer; 4 MT-bench prompts),
a_0 = 0.016 (ratio 0.026) and accept length 1.02 (ratio 0.009). In public reports a wrong capture looks the same:
vLLM PR #50170, a head that fell back to the default layers, went from accept length 2.77 to 1.04.
So a wrong capture takes the first position to a few percent of the prediction while a healthy
drafter out of its domain loses a third; one half (one quarter for the compounded accept length)
sits between the two with room on both sides, and below it speculation costs more than it saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

BROKEN_RATIO = 0.5  # first position
LOW_RATIO = 0.8
BROKEN_LENGTH_RATIO = 0.25  # accept length only (SGLang)
LOW_LENGTH_RATIO = 0.5
DEFAULT_MIN_ROUNDS = 64  # at p ~ 0.3 the binomial std of a_0 over 64 rounds is 0.057: a 0.6 -> 0.3 fall is 5 sigma

OK, LOW, BROKEN = "ok", "low", "broken"
INSUFFICIENT, NO_PREDICTION = "insufficient_data", "no_prediction"
ALERT_STATES = (BROKEN,)

LIKELY_CAUSES = (
    "the engine captures other layers than training did (layer ids read in another convention: "
    "off by one block, or the embeddings counted as a layer)",
    "a norm flag read differently from training (an absent norm_before_residual is true in vLLM, false "
    "in speculators)",
    "another target checkpoint or quantisation than the one the drafter was trained for",
    "a chat template or system prompt other than training's",
)


@dataclass(frozen=True)
class Prediction:
    """What training predicts the drafter accepts per position (a chain), from ``eyas.json``."""

    acceptance: list[float]  # p_d, d = 0 .. len-1
    simulated_accept_length: float | None = None
    source: str = ""

    def expected_drafts(self, depth: int | None = None) -> float:
        """E: predicted accepted drafts per round for a chain of ``depth`` (None: every recorded position)."""
        k = len(self.acceptance) if depth is None else min(depth, len(self.acceptance))
        return float(sum(self.acceptance[:k]))

    def accept_length(self, depth: int | None = None) -> float:
        return 1.0 + self.expected_drafts(depth)

    def to_dict(self) -> dict[str, Any]:
        return {"acceptance_per_position": [round(p, 5) for p in self.acceptance],
                "simulated_accept_length": self.simulated_accept_length, "source": self.source}


def prediction_from_metrics(metrics: Any, source: str = "") -> Prediction | None:
    """p_d from a :class:`~eyas.contract.ValidationMetrics` (or None when it records no accuracy):
    the running product of the conditional accuracies; without those, only position 0, whose
    unconditional and conditional accuracy are the same."""
    if metrics is None:
        return None
    cond = getattr(metrics, "conditional_accuracy_per_position", None)
    acc = getattr(metrics, "accuracy_per_position", None)
    if cond:
        out, prod = [], 1.0
        for c in cond:
            prod *= float(c)
            out.append(prod)
    elif acc:
        out = [float(acc[0])]
    else:
        return None
    return Prediction(out, getattr(metrics, "simulated_accept_length", None), source)


@dataclass(frozen=True)
class Observation:
    """Served counts over some span (a sliding window, or the difference of two metric scrapes).

    ``accepted_per_position[d]`` counts rounds whose draft at depth d+1 was accepted; when only
    the mean accept length is known (SGLang's gauge), ``accept_length`` carries it and the per
    position counts are empty."""

    rounds: int | None  # None: unknown (SGLang's gauge is a mean over an interval it does not state)
    accepted_per_position: list[int] = field(default_factory=list)
    accept_length: float | None = None  # mean tokens per round incl. the bonus; derived when absent
    depth: int | None = None  # the drafting depth served, when known
    source: str = ""

    @property
    def acceptance(self) -> list[float]:
        return [a / self.rounds for a in self.accepted_per_position] if self.rounds else []

    def enough(self, min_rounds: int) -> bool:
        """Whether there is enough to judge: ``min_rounds`` rounds, or (rounds unknown) an accept length
        of at least 1 (an engine that has served nothing reports 0)."""
        if self.rounds is None:
            return self.accept_length is not None and self.accept_length >= 1.0
        return self.rounds >= min_rounds and self.drafts_per_round is not None

    @property
    def drafts_per_round(self) -> float | None:
        """S = accept length - 1."""
        if self.accepted_per_position and self.rounds:
            return sum(self.accepted_per_position) / self.rounds
        return None if self.accept_length is None else self.accept_length - 1.0


@dataclass(frozen=True)
class Verdict:
    status: str  # ok | low | broken | insufficient_data | no_prediction
    ratio: float | None  # a_0 / p_0 (per-position counts), else S / E
    basis: str | None
    served_accept_length: float | None
    predicted_accept_length: float | None
    served_acceptance: list[float]
    predicted_acceptance: list[float]
    rounds: int | None
    depth: int | None
    message: str
    doctor_command: str
    causes: tuple[str, ...] = ()

    @property
    def alert(self) -> bool:
        return self.status in ALERT_STATES

    def to_dict(self) -> dict[str, Any]:
        r = (lambda x: None if x is None else round(x, 4))
        return {"status": self.status, "alert": self.alert, "ratio": r(self.ratio), "ratio_basis": self.basis,
                "served_accept_length": r(self.served_accept_length),
                "predicted_accept_length": r(self.predicted_accept_length),
                "served_acceptance_per_position": [round(x, 4) for x in self.served_acceptance],
                "predicted_acceptance_per_position": [round(x, 4) for x in self.predicted_acceptance],
                "rounds": self.rounds, "depth": self.depth, "message": self.message,
                "doctor_command": self.doctor_command, "likely_causes": list(self.causes),
                "thresholds": {"first_position": {"broken": BROKEN_RATIO, "low": LOW_RATIO},
                               "accept_length": {"broken": BROKEN_LENGTH_RATIO, "low": LOW_LENGTH_RATIO}}}


def doctor_command(target: str | None, draft: str, engine: str = "eyas") -> str:
    """The ``eyas doctor`` command that diagnoses this pair as ``engine`` serves it."""
    cmd = f"eyas doctor --target {target or '<target>'} --draft {draft}"
    return cmd + (f" --engine {engine}" if engine != "eyas" else "")


def judge(obs: Observation, pred: Prediction | None, *, doctor: str, min_rounds: int = DEFAULT_MIN_ROUNDS) -> Verdict:
    """The verdict on ``obs`` against ``pred`` (see the module docstring for the rule)."""
    depth = obs.depth or (len(obs.accepted_per_position) or None)
    served_s = obs.drafts_per_round
    served_len = None if served_s is None else 1.0 + served_s
    base = dict(served_accept_length=served_len, served_acceptance=obs.acceptance, rounds=obs.rounds, depth=depth,
                doctor_command=doctor)
    if pred is None or not pred.acceptance:
        return Verdict(NO_PREDICTION, None, None, predicted_accept_length=None, predicted_acceptance=[],
                       message="the drafter's eyas.json records no held-out acceptance to compare with: no verdict",
                       **base)
    k = depth if depth is not None else len(pred.acceptance)
    expected = pred.expected_drafts(k)
    predicted = pred.acceptance[:k]
    pbase = dict(base, predicted_accept_length=1.0 + expected, predicted_acceptance=predicted)
    if not obs.enough(min_rounds) or served_s is None:
        seen = "no accept length reported" if obs.rounds is None else f"{obs.rounds} speculative rounds observed"
        return Verdict(INSUFFICIENT, None, None, message=f"{seen}, {min_rounds} needed for a verdict", **pbase)
    if expected <= 0:
        return Verdict(NO_PREDICTION, None, None, message="training predicts no accepted drafts: nothing to compare",
                       **pbase)
    per_pos = ", ".join(f"{a:.2f} vs {p:.2f}" for a, p in zip(obs.acceptance, predicted))
    over = f"{obs.rounds} rounds" if obs.rounds is not None else "an interval the engine does not state"
    what = (f"served accept length {served_len:.2f} against {1 + expected:.2f} predicted by training for depth {k}"
            + (f"; acceptance per position served vs predicted: {per_pos}" if per_pos else "") + f"; over {over}")
    if obs.accepted_per_position and obs.rounds:
        ratio, basis = obs.acceptance[0] / pred.acceptance[0], "first_position"
        broken, low = BROKEN_RATIO, LOW_RATIO
        said = f"first-position acceptance {obs.acceptance[0]:.3f} is {ratio:.2f} of the predicted {pred.acceptance[0]:.3f}"
    else:
        ratio, basis = served_s / expected, "accept_length"
        broken, low = BROKEN_LENGTH_RATIO, LOW_LENGTH_RATIO
        said = f"accepted drafts per round {served_s:.2f} are {ratio:.2f} of the predicted {expected:.2f}"
    if ratio < broken:
        msg = (f"acceptance far below the training prediction: {said} (alert below {broken:.2f}); {what}. "
               f"Likely causes: " + "; ".join(LIKELY_CAUSES) + f". Run: {doctor}")
        return Verdict(BROKEN, ratio, basis, message=msg, causes=LIKELY_CAUSES, **pbase)
    if ratio < low:
        return Verdict(LOW, ratio, basis, message=f"acceptance below the training prediction: {said} (alert below "
                       f"{broken:.2f}); {what}. Prompts far from the training data or a sampling temperature lower "
                       f"it; if it persists, run: {doctor}", **pbase)
    return Verdict(OK, ratio, basis, message=f"acceptance as training predicted: {said}; {what}", **pbase)


def window_observation(rounds: Sequence[tuple[int, int]], source: str = "") -> Observation:
    """An observation from per-round records (tree depth reached, drafts accepted), e.g. a sliding window."""
    n = len(rounds)
    depth = max((d for d, _ in rounds), default=0)
    per_pos = [0] * depth
    for _, a in rounds:
        for i in range(min(a, depth)):
            per_pos[i] += 1
    return Observation(n, per_pos, depth=depth or None, source=source)
