"""`--tree auto` (eyas.tune): the tau model against hand-computed values, the choice
under synthetic cost models (flat verification -> a big tree, steep -> a chain), the calibration
against the drafting engine it models, measurements that leave the target usable, and the CLI.

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
from eyas.engine import HFTarget, TreeSpec, plain_generate, speculative_generate
from eyas.engine.sampling import GREEDY
from eyas.engine.tree import DraftState
from eyas.errors import EyasError
from eyas.tune import (
    AcceptanceProfile, CostModel, TreeAutoError, acceptance_from_metrics, candidate_trees, choose_tree, expected_tau,
    measure_acceptance, measure_cost, predict_tau, simulate_rounds, teacher_forced_ranks, time_rounds, tune_tree,
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
    monkeypatch.setattr(auto, "time_rounds", lambda target, drafter, specs: {})  # no round timed: the model decides
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
    """The model shortlists its best trees and chains; their rounds, timed end to end, decide:
    here a chain's real round is 50x cheaper than the trees', so the chain wins and the choice
    reports the timed round, not the model's."""
    import eyas.tune.auto as auto
    from eyas.contract import ValidationMetrics

    cost = CostModel({1: 10e-3, 64: 10e-3}, **PARTS)
    timed: list[TreeSpec] = []

    def fake_rounds(target, drafter, specs):
        timed.extend(specs)
        return {s: 1e-3 if s.top_k == 1 else 50e-3 for s in specs}

    monkeypatch.setattr(auto, "measure_cost", lambda target, drafter: cost)
    monkeypatch.setattr(auto, "time_rounds", fake_rounds)
    metrics = ValidationMetrics(step=9, conditional_accuracy_per_position=[0.8, 0.6, 0.5])
    choice = tune_tree(None, None, [], SimpleNamespace(metrics=metrics))
    assert len(timed) == auto.SHORTLIST and sum(s.top_k == 1 for s in timed) == 2
    assert {c.spec for c in choice.candidates} == set(timed)  # the choice is among the timed rounds
    assert choice.spec.top_k == 1 and choice.round_s == 1e-3
    assert {"depth": choice.spec.depth, "top_k": 1, "total_tokens": choice.spec.total_tokens,
            "round_ms": 1.0} in choice.to_dict()["cost"]["round_ms_by_tree"]


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
                            "--png", str(tmp_path / "b.png"), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    report = json.loads(r.stdout)  # the candidates table and the reason went to stderr
    auto = report["tree_auto"]
    assert report["tree"] == [auto["depth"], auto["top_k"], auto["total_tokens"]]
    assert auto["reason"].startswith(f"chose {auto['depth']},{auto['top_k']},{auto['total_tokens']} because")
    assert auto["predicted_tau"] >= 1 and auto["predicted_speedup"] > 0
    assert set(auto["verify_ms_by_tokens"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert auto["acceptance"]["source"].startswith("greedy calibration on 2 prompt(s)")
    assert auto["candidates"][0]["depth"] == auto["depth"]
    assert len(auto["cost"]["round_ms_by_tree"]) == 8  # the shortlist, timed end to end
    assert auto["measured_round_ms"] == pytest.approx(report["sets"][0]["round_ms"], rel=1e-3)
    assert auto["round_prediction_error"] == pytest.approx(auto["round_ms"] / auto["measured_round_ms"] - 1, abs=1e-3)
    assert report["sets"][0]["identical_to_plain"] is True
    assert "chose" in r.stderr and "--tree auto" in r.stderr


@pytest.mark.integration
def test_bad_tree_text_is_a_clean_cli_error(toy_drafter):
    target, draft = toy_drafter
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hello",
                            "--max-new-tokens", "2", "--tree", "6,4", "--device", "cpu"])
    assert r.exit_code == 2 and "--tree: expected DEPTH,TOPK,TOTAL" in r.stderr and "'6,4'" in r.stderr


@pytest.mark.integration
def test_generate_tree_auto(toy_drafter):
    target, draft = toy_drafter
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hello",
                            "--max-new-tokens", "6", "--tree", "auto", "--device", "cpu", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    out = json.loads(r.stdout)
    auto = out["tree_auto"]
    assert out["tree"] == [auto["depth"], auto["top_k"], auto["total_tokens"]]
    assert "calibration on 1 prompt(s)" in auto["acceptance"]["source"]
