"""`--tree auto` (eyas.tune): the tau model against hand-computed values, the choice
under synthetic cost models (flat verification -> a big tree, steep -> a chain), the search space
(depths 1 to 8 whatever the profile measured), the shortlist of real rounds, a plan per temperature,
the calibration against the drafting engine it models (greedy, and sampled at a temperature: text the
target sampled predicts the engine's sampled rounds), the shipped calibration prompts, measurements
that leave the target usable, and the CLI.

CPU, float32, tiny models (tests/support/tiny.py, tests/support/toy.py), one torch thread.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli.main import app
from eyas.drafter.ttt import accept_length
from eyas.engine import HFTarget, SamplingParams, TreeSpec, plain_generate, speculative_generate
from eyas.engine.sampling import GREEDY
from eyas.engine.draft_state import DraftState
from eyas.errors import EyasError
from eyas.tune import (
    CALIBRATION_POSITIONS, AcceptanceProfile, CostModel, TreeAutoError, TreePlanChoice, acceptance_from_metrics,
    calibration_conversations, calibration_sets, candidate_trees, check_prediction, choose_tree, expected_tau,
    measure_acceptance, measure_cost, predict_tau, shortlist, simulate_rounds, teacher_forced_ranks, time_rounds,
    tune_tree, tune_trees,
)
from tests.support.tiny import SPEC4, random_prompts

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# The model: predicted tau and the choice
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_predicted_tau_matches_hand_computed_values():
    # depth 1: top-1 0.8, top-2 0.9 -> q_1 = (0.8, 0.1); depth 2: 0.5, 0.75 -> q_2 = (0.5, 0.25)
    acc = AcceptanceProfile([[0.8, 0.9], [0.5, 0.75]])
    assert predict_tau(acc, TreeSpec.chain(1)) == pytest.approx(1.8)
    assert predict_tau(acc, TreeSpec.chain(2)) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert predict_tau(acc, TreeSpec.chain(2)) == pytest.approx(accept_length([0.8, 0.5]))  # training's number
    # nodes: 0.8, 0.1 | 0.4, 0.2, 0.05, 0.025; 3 kept -> 0.8 + 0.4 + 0.2
    assert predict_tau(acc, TreeSpec(2, 2, 3)) == pytest.approx(2.4)
    assert predict_tau(acc, TreeSpec(2, 2, 2)) == pytest.approx(2.2)  # the 2 tokens go to the chain, not 0.1
    assert predict_tau(acc, TreeSpec(2, 2, None)) == pytest.approx(1 + 0.8 + 0.1 + 0.4 + 0.2 + 0.05 + 0.025)
    assert predict_tau(acc, TreeSpec(1, 3, 3)) == pytest.approx(1.9)  # rank 3 is past the profile: q = 0
    # EAGLE-2 expands only top_k nodes per depth: q = (0.5, 0.5) everywhere, K = 2, depth 3:
    # depth 1: 0.5 + 0.5; depth 2: 4 x 0.25 (2 expanded); depth 3: 4 x 0.125 -> 1 + 1 + 1 + 0.5
    flat = AcceptanceProfile([[0.5, 1.0]] * 3)
    assert predict_tau(flat, TreeSpec(3, 2, None)) == pytest.approx(3.5)
    assert expected_tau(flat, TreeSpec(3, 2, None)) == predict_tau(flat, TreeSpec(3, 2, None))  # no replay data


@pytest.mark.unit
def test_replay_by_hand():
    """With calibration sequences, tau is the replay: rounds start where the previous one stopped."""
    ranks = [[0, 1], [0, 0], [1, 0], [0, 5], [0, 0], [3, 0], [0, 0]]  # rank of the target's token, depth 1, 2
    valid = [[True, True]] * 5 + [[True, False]] * 2  # the last two positions have no depth-2 token
    acc = AcceptanceProfile([[0.8, 0.9], [0.5, 0.75]], sequences=[(ranks, valid)])
    # chain(2) keeps paths (0), (0,0): t=0 accepts 1 -> emits 2, t=2 rank 1 -> 1, t=3 -> 2, t=5 too short
    assert simulate_rounds(acc, TreeSpec.chain(2)) == [[2, 1, 2]]
    assert predict_tau(acc, TreeSpec.chain(2)) == pytest.approx(5 / 3)
    # (2,2,3) keeps (0), (0,0), (0,1): t=0 accepts both -> 3, t=3 -> 2
    assert simulate_rounds(acc, TreeSpec(2, 2, 3)) == [[3, 2]]
    assert predict_tau(acc, TreeSpec(2, 2, 3)) == pytest.approx(2.5)


SYNTHETIC = AcceptanceProfile([[1 - 0.3 * 0.7 ** (k - 1) for k in range(1, 11)] for _ in range(8)], "synthetic")
PARTS = dict(plain_s=10e-3, draft_base_s={1: 5e-5, 10: 5e-5}, draft_step_s_by_topk={1: 2e-4, 10: 3e-4},
             extend_s_by_tokens={1: 3e-4, 8: 3e-4}, bookkeeping_s_by_tokens={1: 1e-4})


@pytest.mark.unit
def test_flat_verification_cost_picks_a_wide_deep_tree():
    cost = CostModel({1: 10e-3, 64: 10e-3}, **PARTS)  # 64 tokens cost what 1 does
    choice = choose_tree(cost, SYNTHETIC)
    assert (choice.spec.depth, choice.spec.top_k, choice.spec.total_tokens) == (6, 8, 63)
    assert choice.predicted_speedup > 3
    assert choice.reason.startswith("chose 6,8,63 because") and "best chain" in choice.reason
    best_chain = next(c for c in choice.candidates if c.spec.top_k == 1)
    assert best_chain.spec == TreeSpec.chain(8) and best_chain.speedup < choice.predicted_speedup


@pytest.mark.unit
def test_steep_verification_cost_picks_a_chain():
    cost = CostModel({n: 10e-3 * n for n in (1, 2, 4, 8, 16, 32, 64)}, **PARTS)  # linear in tokens
    choice = choose_tree(cost, SYNTHETIC)
    assert choice.spec == TreeSpec.chain(1)
    assert choice.predicted_tau == pytest.approx(1.7)
    assert choice.round_s == pytest.approx(5e-5 + 20e-3 + 3e-4 + 1e-4)
    assert choice.predicted_speedup == pytest.approx(1.7 * 10e-3 / choice.round_s)
    assert "no candidate is predicted to beat plain decoding" in choice.reason


@pytest.mark.unit
def test_moderate_verification_cost_picks_a_middle_tree():
    cost = CostModel({1: 10e-3, 16: 10.5e-3, 32: 12e-3, 64: 18e-3}, **PARTS)  # a GPU-like knee
    choice = choose_tree(cost, SYNTHETIC)
    assert (choice.spec.depth, choice.spec.top_k, choice.spec.total_tokens) == (6, 4, 24)
    d = choice.to_dict()
    assert d["verify_ms_by_tokens"] == {1: 10.0, 16: 10.5, 32: 12.0, 64: 18.0}
    assert d["candidates"][0]["predicted_speedup"] == d["predicted_speedup"]


@pytest.mark.unit
def test_cost_model_interpolates_and_keeps_verification_monotone():
    cost = CostModel({1: 1.0, 4: 4.0, 8: 3.0}, plain_s=1.0)  # 8 measured cheaper than 4: noise
    assert cost.verify_s(2) == pytest.approx(2.0)
    assert cost.verify_s(8) == pytest.approx(4.0) and cost.verify_s(6) == pytest.approx(4.0)
    assert cost.verify_s(16) == pytest.approx(4.0)  # flat last segment: flat extrapolation
    assert CostModel({1: 1.0, 2: 2.0}, plain_s=1.0).verify_s(10) == pytest.approx(10.0)


@pytest.mark.unit
def test_candidates_include_chains_and_cut_oversized_totals():
    specs = candidate_trees(depths=(1, 3), topks=(1, 2), totals=(2, 8, 16))
    assert TreeSpec.chain(1) in specs and TreeSpec.chain(3) in specs
    # depth 3, top-k 2: at most 2 + 2 * 4 = 10 nodes, so 16 is cut to 10; totals below the depth go
    assert [s.total_tokens for s in specs if s.depth == 3 and s.top_k == 2] == [8, 10]
    assert [s.total_tokens for s in specs if s.depth == 1 and s.top_k == 2] == [2]


@pytest.mark.unit
def test_tree_size_has_one_name_total_tokens():
    """TreeSpec.total_tokens is the size a round verifies: None or a request past what the expansion
    can produce (K + (D-1) K^2) is stored as that number, so every report prints the same size."""
    assert TreeSpec(2, 8, 100).total_tokens == 8 + 8**2 and TreeSpec(5, 3, None).total_tokens == 3 + 4 * 9
    assert TreeSpec.parse("6,4,100") == TreeSpec(6, 4, 84) and TreeSpec.chain(4).total_tokens == 4
    assert not hasattr(TreeSpec(3, 2, 6), "budget")
    with pytest.raises(EyasError, match="--tree: expected DEPTH,TOPK,TOTAL"):
        TreeSpec.parse("6,x")


@pytest.mark.unit
def test_acceptance_from_contract_metrics():
    from eyas.contract import ValidationMetrics

    acc = acceptance_from_metrics(ValidationMetrics(step=9, conditional_accuracy_per_position=[0.8, 0.6]), max_topk=3)
    assert acc.hit[0][0] == 0.8 and acc.hit[1][2] == pytest.approx(1 - 0.4 * 0.8**2)
    assert predict_tau(acc, TreeSpec.chain(2)) == pytest.approx(accept_length([0.8, 0.6]))
    assert "training metrics" in acc.source
    assert acceptance_from_metrics(None) is None and acceptance_from_metrics(ValidationMetrics(step=1)) is None


@pytest.mark.unit
def test_tune_tree_falls_back_to_training_metrics_and_refuses_without_acceptance(monkeypatch):
    """The glue behind `--tree auto`: no calibration prompts -> the contract's training metrics; no
    metrics either -> an EyasError that names the missing field and the way out."""
    import eyas.tune.auto as auto

    cost = CostModel({1: 10e-3, 64: 10e-3}, **PARTS)
    monkeypatch.setattr(auto, "measure_cost", lambda target, drafter: cost)  # the model's numbers, not this CPU's
    monkeypatch.setattr(auto, "time_rounds", lambda target, drafter, specs, **kw: {})  # none timed: the model decides
    from eyas.contract import ValidationMetrics

    metrics = ValidationMetrics(step=9, conditional_accuracy_per_position=[0.8, 0.6])
    choice = tune_tree(None, None, [], SimpleNamespace(metrics=metrics), temperature=0.7)
    assert choice.spec == choose_tree(cost, acceptance_from_metrics(metrics)).spec
    assert "acceptance from the drafter's training metrics (step 9" in choice.reason
    assert choice.reason.endswith("; acceptance was measured greedily, sampling at temperature 0.7 usually "
                                  "accepts less")
    assert choice.to_dict()["acceptance"]["tau_from"] == "expectation"
    with pytest.raises(TreeAutoError, match=r"conditional_accuracy_per_position.*pass --tree DEPTH,TOPK,TOTAL"):
        tune_tree(None, None, [], SimpleNamespace(metrics=None))
    with pytest.raises(EyasError):
        tune_tree(None, None, [], None)


@pytest.mark.unit
def test_tune_tree_times_a_shortlist_end_to_end_and_chooses_on_those_rounds(monkeypatch):
    """The model shortlists the best tree of every depth, its best trees and chains; their rounds,
    timed end to end, decide, with a second batch timed once the model is scaled to them: here a
    chain's real round is 50x cheaper than the trees', so the chain wins and the choice reports the
    timed round, not the model's."""
    import eyas.tune.auto as auto
    from eyas.contract import ValidationMetrics

    cost = CostModel({1: 10e-3, 64: 10e-3}, **PARTS)
    batches: list[list[TreeSpec]] = []

    def fake_rounds(target, drafter, specs, **kw):
        batches.append(list(specs))
        return {s: 1e-3 if s.top_k == 1 else 50e-3 for s in specs}

    monkeypatch.setattr(auto, "measure_cost", lambda target, drafter: cost)
    monkeypatch.setattr(auto, "time_rounds", fake_rounds)
    metrics = ValidationMetrics(step=9, conditional_accuracy_per_position=[0.8, 0.6, 0.5])
    choice = tune_tree(None, None, [], SimpleNamespace(metrics=metrics))
    first, second = batches
    assert len(first) == auto.SHORTLIST and sum(s.top_k == 1 for s in first) == 2
    assert {s.depth for s in first if s.top_k > 1} == set(range(1, 9))  # every depth's best tree is timed
    assert len(second) == auto.REFINE_TREES and not set(second) & set(first)
    timed = set(first) | set(second)
    assert {c.spec for c in choice.candidates} == timed  # the choice is among the timed rounds
    assert choice.searched == len(candidate_trees()) > 250  # ...the model ranked the whole space first
    assert choice.spec.top_k == 1 and choice.round_s == 1e-3
    assert {"depth": choice.spec.depth, "top_k": 1, "total_tokens": choice.spec.total_tokens,
            "round_ms": 1.0} in choice.to_dict()["cost"]["round_ms_by_tree"]
    # the model was put on the timed rounds' scale before the second batch was picked
    assert choice.cost.round_scale != 1.0 and cost.round_s_by_tree == {}  # the shared measurement is untouched


@pytest.mark.unit
def test_the_space_reaches_depth_8_whatever_the_profile_measured():
    """choose_tree searches depths 1 to 8, top-k up to 10, totals up to 63, even from a profile of
    two depths (a depth past the profile reuses its last depth's rates)."""
    cost = CostModel({1: 10e-3, 64: 10e-3}, **PARTS)
    choice = choose_tree(cost, AcceptanceProfile([[0.9, 0.95, 0.97], [0.9, 0.95, 0.97]]))
    specs = {c.spec for c in choice.candidates}
    assert {s.depth for s in specs} == set(range(1, 9))
    assert max(s.top_k for s in specs) == 10 and max(s.total_tokens for s in specs) == 63
    assert TreeSpec(8, 10, 63) in specs and TreeSpec.chain(8) in specs
    assert choice.spec.depth == 8  # flat verification and a good drafter: the deepest tree


@pytest.mark.unit
def test_shortlist_takes_every_depths_best_tree_then_the_best_overall():
    cost = CostModel({1: 10e-3, 16: 10.5e-3, 32: 12e-3, 64: 18e-3}, **PARTS)
    ranked = choose_tree(cost, SYNTHETIC).candidates
    specs = shortlist(ranked, trees=10, chains=2)
    trees = [s for s in specs if s.top_k > 1]
    assert len(trees) == 10 and len(specs) == 12 and len(set(specs)) == 12
    assert {s.depth for s in trees} == set(range(1, 9))
    assert ranked[0].spec in specs  # the model's best is always timed
    assert [s for s in specs if s.top_k == 1] == [c.spec for c in ranked if c.spec.top_k == 1][:2]
    assert specs == sorted(specs, key=[c.spec for c in ranked].index)  # in rank order


@pytest.mark.unit
def test_where_rounds_compile_the_shortlist_is_the_models_best_few():
    """A target whose trees each compile their round functions (the fast target on a GPU, ~30 s a
    tree on an H200) times the model's best 4 trees and best chain, not the best of every depth."""
    from types import SimpleNamespace

    from eyas.tune.rounds import COMPILED_SHORTLIST, Shortlist, shortlist_for

    assert shortlist_for(SimpleNamespace(cuda_graphs=True, compile=True)) == COMPILED_SHORTLIST
    assert shortlist_for(SimpleNamespace(cuda_graphs=False, compile=False)) == Shortlist()
    cost = CostModel({1: 10e-3, 16: 10.5e-3, 32: 12e-3, 64: 18e-3}, **PARTS)
    ranked = choose_tree(cost, SYNTHETIC).candidates
    sizes = COMPILED_SHORTLIST
    specs = shortlist(ranked, sizes.trees, sizes.chains, sizes.per_depth)
    trees = [c.spec for c in ranked if c.spec.top_k > 1][:4]
    assert specs == [c.spec for c in ranked if c.spec in set(trees) | {next(c.spec for c in ranked if c.spec.top_k == 1)}]


@pytest.mark.unit
def test_round_scale_puts_the_model_on_the_timed_rounds_scale():
    cost = CostModel({1: 1e-3, 64: 1e-3}, plain_s=1e-3)
    a, b, c = TreeSpec.chain(1), TreeSpec(2, 2, 4), TreeSpec(3, 2, 6)
    assert cost.round_s(c, 2.0) == pytest.approx(cost.model_round_s(c, 2.0))
    cost.round_s_by_tree = {a: 0.5 * cost.model_round_s(a, 1.5), b: 0.7 * cost.model_round_s(b, 2.0)}
    assert cost.fit_round_scale({a: 1.5, b: 2.0}) == pytest.approx(0.6)
    assert cost.round_s(c, 2.0) == pytest.approx(0.6 * cost.model_round_s(c, 2.0))  # not timed: scaled
    assert cost.round_s(a, 1.5) == cost.round_s_by_tree[a]  # timed: as timed
    assert cost.to_dict()["round_scale"] == 0.6


@pytest.mark.unit
def test_tune_trees_chooses_per_temperature_on_one_hardware_measurement(monkeypatch):
    """One call tunes every temperature: the parts are measured once, each temperature is calibrated
    at its own temperature and its rounds timed at it, and the plan holds the greedy tree and the
    sampled one."""
    import eyas.tune.auto as auto

    cost = CostModel({1: 10e-3, 16: 10.5e-3, 32: 12e-3, 64: 18e-3}, **PARTS)
    measured, calibrated, timed_at, drafts = [], [], [], set()
    monkeypatch.setattr(auto, "measure_cost", lambda target, drafter: measured.append(1) or cost)

    def fake_acceptance(target, drafter, prompts, *, temperature, **kw):
        calibrated.append((temperature, kw["positions"]))
        # sampling accepts less: a shallower profile
        good = 0.3 if temperature == 0 else 0.6
        return AcceptanceProfile([[1 - good * 0.7 ** (k - 1) for k in range(1, 11)] for _ in range(8)],
                                 f"at {temperature}", [100] * 8, temperature=temperature)

    def fake_rounds(target, drafter, specs, *, sampling, sampled_drafts, **kw):
        timed_at.append(sampling.temperature)
        drafts.add(sampled_drafts)
        return {s: cost.model_round_s(s, 2.0) for s in specs}

    monkeypatch.setattr(auto, "measure_acceptance", fake_acceptance)
    monkeypatch.setattr(auto, "time_rounds", fake_rounds)
    plan = tune_trees(None, None, [[1, 2, 3]], None, temperatures=(0.0, 1.0))
    assert isinstance(plan, TreePlanChoice) and measured == [1]
    assert calibrated == [(0.0, CALIBRATION_POSITIONS), (1.0, CALIBRATION_POSITIONS)]
    assert set(timed_at) == {0.0, 1.0}
    greedy, sampled = plan.choices
    assert (greedy.temperature, sampled.temperature) == (0.0, 1.0) == tuple(plan.temperatures)
    assert plan.plan.greedy == greedy.spec and plan.plan.sampled == sampled.spec
    assert sampled.predicted_tau < greedy.predicted_tau
    assert plan.for_temperature(0.8) is sampled and plan.for_temperature(0) is greedy
    assert "sampling at temperature" not in sampled.reason  # measured at its temperature: no caveat
    assert drafts == {"top-k"} and "replayed for top-k drafts" not in sampled.reason
    gumbel = tune_trees(None, None, [[1, 2, 3]], None, temperatures=(1.0,), sampled_drafts="gumbel").choices[0]
    assert drafts == {"top-k", "gumbel"}  # its rounds timed as the served requests draft
    assert "tau was replayed for top-k drafts, the served requests draw theirs (gumbel)" in gumbel.reason
    d = plan.to_dict()
    assert d["plan"] == plan.plan.to_dict() and [c["temperature"] for c in d["choices"]] == [0.0, 1.0]
    check = check_prediction(sampled, measured_tau=sampled.predicted_tau / 1.05, measured_round_ms=None,
                             measured_speedup=None)
    assert check.tau_error == pytest.approx(0.05, abs=1e-4) and check.round_error is None
    assert check.to_dict()["tree"] == sampled.spec.label


@pytest.mark.unit
def test_plan_of_several_sampled_temperatures_takes_their_best_shared_tree():
    cost = CostModel({1: 10e-3, 16: 10.5e-3, 32: 12e-3, 64: 18e-3}, **PARTS)
    specs = [TreeSpec.chain(2), TreeSpec(3, 4, 12), TreeSpec(6, 8, 48)]
    prof = lambda good, t: AcceptanceProfile([[1 - good * 0.7 ** (k - 1) for k in range(1, 11)]] * 8,  # noqa: E731
                                             temperature=t)
    choices = [choose_tree(cost, prof(g, t), specs=specs) for g, t in ((0.5, 0.7), (0.9, 1.0))]
    plan = TreePlanChoice(choices, cost).plan
    mean = {s: sum({c.spec: c.speedup for c in ch.candidates}[s] for ch in choices) / 2 for s in specs}
    assert plan.sampled == max(specs, key=mean.get) and plan.greedy == plan.sampled  # no greedy tuned
    with pytest.raises(ValueError, match="at least one temperature"):
        TreePlanChoice([], cost)


@pytest.mark.unit
def test_shipped_calibration_prompts_come_from_five_training_sets_and_no_evaluation_set():
    import re

    from eyas.bench import NAMED_SETS
    from eyas.bench.prompts import set_path
    from eyas.data.conversation_files import read_conversations

    convs = calibration_conversations()
    sets = calibration_sets(convs)
    assert len(convs) == 50 and len(sets) == 5 and "gsm8k_train" in sets
    assert calibration_sets(calibration_conversations(limit=5)) == sets  # interleaved: any 5 cover every set
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in convs)

    def runs(text: str, n: int = 8) -> set[tuple[str, ...]]:
        w = re.findall(r"\w+", text.lower())
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}

    evaluation = set().union(*(runs(m["content"]) for name in NAMED_SETS
                               for c in read_conversations(set_path(name)).conversations for m in c.messages))
    assert not any(runs(c.messages[0]["content"]) & evaluation for c in convs)


# ---------------------------------------------------------------------------------------------
# Measurement on a real (tiny) target and drafter
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_teacher_forced_ranks_are_what_the_engine_drafts(llama, trained_drafter):
    """Every round position: the chain the engine drafts equals the calibration's top-1 tokens as
    long as the drafted prefix was the target's, and the root's rank of the target's token is the
    calibration's depth-1 rank."""
    target = HFTarget(llama, SPEC4)
    D = 4
    draft_ids = trained_drafter.draft_to_target(torch.arange(trained_drafter.config.draft_vocab_size))
    checked = deep = 0
    for prompt in random_prompts(3, 128, seed=21, lengths=(4, 8)):
        seq = prompt + plain_generate(target, prompt, max_new_tokens=32).tokens
        ranks, top1, valid = teacher_forced_ranks(target, trained_drafter, seq, len(prompt), D)
        assert target.cache_len == 0
        n, T = len(prompt), len(seq)
        with torch.no_grad():
            _, f = target.prefill(torch.tensor([seq]))
        target.reset()
        state = DraftState(trained_drafter, T + D)
        state.extend(seq[1 : n + 1], f[0, :n])
        assert not valid[: n - 1].any()  # rounds start at the first generated token
        for m in range(n, T - 1):
            t = m - 1
            assert bool(valid[t, 0])
            # depth 1: rank of the target's token x_{m+1} among the root's logits
            did = int((draft_ids == seq[m + 1]).nonzero()[0, 0])
            assert int((state.root_logits > state.root_logits[did]).sum()) == int(ranks[t, 0])
            drafted = state.draft(TreeSpec.chain(D), D, GREEDY, None, 128).tokens[1:].tolist()
            for d in range(1, D + 1):
                if not bool(valid[t, d - 1]):
                    break
                assert drafted[d - 1] == int(top1[t, d - 1]), (m, d)
                checked += 1
                deep += d > 1
                if int(ranks[t, d - 1]) != 0:  # the engine's path leaves the target's here
                    break
            state.extend([seq[m + 1]], f[0, m : m + 1])
    assert checked > 20 and deep > 5


@pytest.mark.integration
def test_calibration_replay_is_the_engines_chain_and_predicts_trees(llama, trained_drafter):
    target = HFTarget(llama, SPEC4)
    prompts = random_prompts(3, 128, seed=5, lengths=(4, 10))
    acc = measure_acceptance(target, trained_drafter, prompts, max_depth=6, max_topk=4, new_tokens=40)
    assert target.cache_len == 0
    assert len(acc.hit) == 6 and len(acc.hit[0]) == 4 and acc.counts[0] > 60
    assert "3 prompt(s)" in acc.source and len(acc.sequences) == 3
    for spec in (TreeSpec.chain(1), TreeSpec.chain(3), TreeSpec.chain(6)):
        # a chain's replay is exactly the engine's rounds on the calibration text (the engine runs
        # longer here: the replay stops where the full depth no longer fits in the 40 tokens)
        replay = simulate_rounds(acc, spec)
        for p, rounds in zip(prompts, replay):
            engine = speculative_generate(target, trained_drafter, p, tree=spec, max_new_tokens=60).stats.accept_lengths
            assert len(rounds) > 3 and engine[: len(rounds)] == rounds, spec
    # no tree is replayed exactly (EAGLE-2 ranks by the trained_drafter's confidence), but closely
    for spec in (TreeSpec(2, 4, 8), TreeSpec(3, 4, 12), TreeSpec(6, 10, 60)):
        stats = [speculative_generate(target, trained_drafter, p, tree=spec, max_new_tokens=40).stats for p in prompts]
        actual = sum(sum(s.accept_lengths) for s in stats) / sum(len(s.accept_lengths) for s in stats)
        assert predict_tau(acc, spec) == pytest.approx(actual, abs=0.25), spec
    # the expectation over all positions ignores where rounds start: it over-predicts the deep chain
    assert expected_tau(acc, TreeSpec.chain(6)) > predict_tau(acc, TreeSpec.chain(6)) + 0.3


@pytest.mark.integration
def test_sampled_calibration_samples_reproducibly_and_stops_at_its_positions(llama, trained_drafter):
    """At a temperature the calibration text is the target's own sample (not its greedy text), the
    same for the same seed; ``positions`` stops it after the prompt that reaches them."""
    target = HFTarget(llama, SPEC4)
    prompts = random_prompts(6, 128, seed=8, lengths=(4, 8))
    kw = dict(max_depth=3, max_topk=3, new_tokens=24)
    greedy = measure_acceptance(target, trained_drafter, prompts, **kw)
    hot = measure_acceptance(target, trained_drafter, prompts, temperature=1.0, seed=3, **kw)
    again = measure_acceptance(target, trained_drafter, prompts, temperature=1.0, seed=3, **kw)
    other = measure_acceptance(target, trained_drafter, prompts, temperature=1.0, seed=4, **kw)
    assert hot.sequences == again.sequences and hot.hit == again.hit  # reproducible from the seed
    assert hot.sequences != other.sequences and hot.sequences != greedy.sequences
    assert hot.temperature == 1.0 and hot.source.startswith("sampled (temperature 1) calibration on 6 prompt(s)")
    assert greedy.source.startswith("greedy calibration") and greedy.to_dict()["temperature"] == 0.0
    assert hot.hit[0][0] < greedy.hit[0][0]  # the drafter learned greedy text: samples hit its top-1 less
    part = measure_acceptance(target, trained_drafter, prompts, positions=30, **kw)
    assert part.positions >= 30 and len(part.sequences) < len(prompts)
    assert part.sequences == greedy.sequences[: len(part.sequences)]
    assert target.cache_len == 0


@pytest.mark.integration
def test_sampled_replay_predicts_the_engines_sampled_rounds(llama, trained_drafter):
    """A sampled request drafts the greedy tree and accepts a path exactly when the target's own sample
    follows it, so the replay over text the target sampled at T predicts the engine's top-k sampled
    rounds at T (different draws: a statistical match, over enough prompts), trees and chains."""
    target = HFTarget(llama, SPEC4)
    prompts = random_prompts(16, 128, seed=5, lengths=(4, 10))
    T = 0.7
    acc = measure_acceptance(target, trained_drafter, prompts, max_depth=4, max_topk=4, new_tokens=48, temperature=T,
                             seed=100)
    for spec in (TreeSpec.chain(2), TreeSpec(3, 4, 12)):
        rounds = tokens = 0
        for i, p in enumerate(prompts):
            g = torch.Generator().manual_seed(1000 + i)
            st = speculative_generate(target, trained_drafter, p, tree=spec, sampling=SamplingParams(T),
                                      max_new_tokens=48, generator=g).stats
            rounds, tokens = rounds + len(st.accept_lengths), tokens + sum(st.accept_lengths)
        assert predict_tau(acc, spec) == pytest.approx(tokens / rounds, abs=0.06), spec
    # the same replay on greedy text over-predicts these sampled rounds
    greedy = measure_acceptance(target, trained_drafter, prompts, max_depth=4, max_topk=4, new_tokens=48)
    assert predict_tau(greedy, TreeSpec(3, 4, 12)) > predict_tau(acc, TreeSpec(3, 4, 12)) + 0.2


@pytest.mark.integration
def test_measurement_leaves_the_target_usable(llama, trained_drafter):
    target = HFTarget(llama, SPEC4)
    prompt = random_prompts(1, 128, seed=9, lengths=(8, 8))[0]
    before = plain_generate(target, prompt, max_new_tokens=16).tokens
    cost = measure_cost(target, trained_drafter, sizes=(1, 4, 16), topks=(1, 3), max_depth=3, repeats=1, warmup=0,
                        context=64)
    assert target.cache_len == 0
    assert sorted(cost.verify_s_by_tokens) == [1, 4, 16] and cost.plain_s > 0 and cost.context == 64
    assert set(cost.draft_step_s_by_topk) == {1, 3} and all(v >= 0 for v in cost.draft_step_s_by_topk.values())
    assert set(cost.bookkeeping_s_by_tokens) == {2, 16, 64}
    assert all(v > 0 for v in cost.bookkeeping_s_by_tokens.values())
    assert set(cost.extend_s_by_tokens) == {1, 4, 8}
    rounds = time_rounds(target, trained_drafter, [TreeSpec.chain(3), TreeSpec(3, 3, 8)], rounds=2, warmup=1,
                         context=32)
    assert target.cache_len == 0 and set(rounds) == {TreeSpec.chain(3), TreeSpec(3, 3, 8)}
    assert all(t > 0 for t in rounds.values())
    acc = measure_acceptance(target, trained_drafter, [prompt], max_depth=3, max_topk=3, new_tokens=16)
    choice = choose_tree(cost, acc, topks=(1, 3), totals=(4, 8))
    assert target.cache_len == 0
    for spec in (choice.spec, TreeSpec(3, 3, 8)):
        assert speculative_generate(target, trained_drafter, prompt, tree=spec, max_new_tokens=16).tokens == before
    assert plain_generate(target, prompt, max_new_tokens=16).tokens == before


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_bench_tree_auto_reports_the_choice_and_stays_identical(toy_drafter, tmp_path):
    target, draft = toy_drafter
    r = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--prompts", "gsm8k",
                            "--limit", "2", "--max-new-tokens", "8", "--tree", "auto", "--device", "cpu",
                            "--calibration-positions", "40", "--calibration-prompts", "held-out",
                            "--png", str(tmp_path / "b.png"), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    report = json.loads(r.stdout)  # the candidates table and the reason went to stderr
    auto = report["tree_auto"]
    assert report["tree"] == [auto["depth"], auto["top_k"], auto["total_tokens"]]
    assert auto["reason"].startswith(f"chose {auto['tree']} because")
    assert auto["predicted_tau"] >= 1 and auto["predicted_speedup"] > 0
    assert set(auto["verify_ms_by_tokens"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert auto["acceptance"]["source"].startswith("greedy calibration on 1 prompt(s)")  # gsm8k's 3rd prompt
    assert report["calibration"]["prompts"].startswith("held-out")  # the sets' prompts past --limit, never timed
    assert auto["acceptance"]["positions"] >= 40 and auto["temperature"] == 0.0
    assert auto["candidates"][0]["depth"] == auto["depth"]
    assert len(auto["cost"]["round_ms_by_tree"]) == 14 + 4  # the shortlist, then the second batch, timed end to end
    assert auto["candidates_considered"] == 18 and auto["trees_searched"] == len(candidate_trees())  # depths 1..8
    assert auto["measured_round_ms"] == pytest.approx(report["sets"][0]["round_ms"], rel=1e-3)
    assert auto["round_prediction_error"] == pytest.approx(auto["round_ms"] / auto["measured_round_ms"] - 1, abs=1e-3)
    assert auto["measured_tau"] == report["sets"][0]["tau"]
    assert auto["tau_error"] == pytest.approx(auto["predicted_tau"] / auto["measured_tau"] - 1, abs=1e-3)
    assert auto["measured_speedup"] == report["sets"][0]["speedup_vs_plain"]
    assert report["sets"][0]["identical_to_plain"] is True
    assert "chose" in r.stderr and "--tree auto" in r.stderr


@pytest.mark.integration
def test_bench_tree_auto_at_two_temperatures_against_fixed_trees(toy_drafter, tmp_path):
    """The command a GPU run measures the bars with, on the toy: --tree auto tuned at each
    temperature, fixed trees on the same prompts, each temperature reported on its own with the
    prediction against the measurement and auto against the best fixed tree."""
    target, draft = toy_drafter
    prompts = tmp_path / "mine.jsonl"  # calibrate on prompts like the ones served
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Tell me about owls."}]}) + "\n")
    r = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--prompts", "gsm8k",
                            "--prompts", "mt_bench", "--limit", "1", "--max-new-tokens", "8", "--temperatures", "0,1",
                            "--tree", "auto", "--tree", "3,2,5", "--tree", "2", "--calibration-positions", "24",
                            "--calibration-prompts", str(prompts), "--device", "cpu", "--no-hf",
                            "--png", str(tmp_path / "b.png"), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    report = json.loads(r.stdout)
    assert report["calibration"] == {"prompts": str(prompts), "positions": 24}
    assert [t["temperature"] for t in report["temperatures"]] == [0.0, 1.0]
    assert report["tree_plan"]["greedy"] == report["temperatures"][0]["tree"]
    assert report["tree_plan"]["sampled"] == report["temperatures"][1]["tree"]
    for sec in report["temperatures"]:
        auto = sec["tree_auto"]
        assert auto["temperature"] == sec["temperature"] and auto["tree"] == sec["tree_label"]
        how = "greedy" if sec["temperature"] == 0 else "sampled (temperature 1)"
        assert auto["acceptance"]["source"].startswith(f"{how} calibration on 1 prompt(s)")
        assert auto["measured_tau"] == sec["overall"]["tau"] and "tau_error" in auto
        runs = {t["tree"]: t for t in sec["trees"]}
        assert {"3,2,5", "2"} <= set(runs) and sec["trees"][0]["auto"]
        assert all([s["set"] for s in t["sets"]] == ["gsm8k", "mt_bench"] for t in sec["trees"])
        c = sec["comparison"]
        best = max(c["fixed"], key=lambda f: f["tokens_per_s"])
        assert c["best_fixed"] == best["tree"] and c["auto"] == auto["tree"]
        assert c["auto_vs_best_fixed"] == pytest.approx(c["auto_tokens_per_s"] / best["tokens_per_s"], abs=1e-3)
        assert isinstance(c["auto_within_3pct_of_best_fixed"], bool) and isinstance(c["tau_within_10pct"], bool)
        ident = sec["sets"][0]["identical_to_plain"]
        assert ident is (True if sec["temperature"] == 0 else None)


@pytest.mark.integration
def test_bad_tree_text_is_a_clean_cli_error(toy_drafter):
    target, draft = toy_drafter
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hello",
                            "--max-new-tokens", "2", "--tree", "6,4", "--device", "cpu"])
    assert r.exit_code == 2 and "--tree: expected DEPTH,TOPK,TOTAL" in r.stderr and "'6,4'" in r.stderr
    for args, message in (
            (["--tree-sampled", "6,x"], "--tree-sampled: expected DEPTH,TOPK,TOTAL like '6,10,60', DEPTH for a chain, "
                                        "or auto; found '6,x'"),
            (["--tree-sampled", "0"], "--tree-sampled: expected DEPTH,TOPK,TOTAL"),
            (["--sampled-drafts", "beam"], "--sampled-drafts: expected one of top-k, gumbel, found 'beam'"),
            (["--tree", "auto", "--calibration-prompts", "nope.jsonl"],
             "--calibration-prompts: expected a prompt file, one of mt_bench"),
            (["--tree", "auto", "--calibration-prompts", "held-out"],
             "--calibration-prompts: expected a prompt file, one of mt_bench")):  # generate times no set
        r = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hello",
                                "--max-new-tokens", "2", "--device", "cpu", *args])
        assert r.exit_code == 2 and message in " ".join(r.stderr.split()), (args, r.stderr)


@pytest.mark.integration
def test_generate_tree_auto(toy_drafter):
    target, draft = toy_drafter
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hello",
                            "--max-new-tokens", "6", "--tree", "3,2,5", "--tree-sampled", "auto", "--temperature",
                            "0.8", "--calibration-positions", "16", "--device", "cpu", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    out = json.loads(r.stdout)
    auto = out["tree_auto"]  # a sampled request: its tree tuned at its temperature
    assert out["tree"] == [auto["depth"], auto["top_k"], auto["total_tokens"]] and auto["temperature"] == 0.8
    assert auto["acceptance"]["source"].startswith("sampled (temperature 0.8) calibration on 1 prompt(s)")
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hello",
                            "--max-new-tokens", "6", "--tree", "3,2,5", "--tree-sampled", "auto", "--device", "cpu",
                            "--json"])
    out = json.loads(r.stdout)  # a greedy request: --tree, nothing tuned
    assert r.exit_code == 0 and out["tree"] == [3, 2, 5] and "tree_auto" not in out
