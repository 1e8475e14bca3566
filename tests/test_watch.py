"""`eyas watch` and the verdict it shares with `eyas serve`'s watchdog: the engines' metric texts
(tests/data/metrics, their SOURCE.md names the format's origin) parsed to exact counts, the verdict
on a healthy and a broken head, the CLI's text, JSON and exit codes, and counter differences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import eyas
from eyas.cli.main import app
from eyas.watch import (
    BROKEN, INSUFFICIENT, LOW, NO_PREDICTION, OK, MetricsError, Observation, Prediction, Watcher, difference, judge,
    parse_metrics, prediction_from_metrics,
)
from tests.support import DATA

METRICS = DATA / "metrics"
# The shipped SmolLM2 drafter's training prediction at the first position (its eyas.json): read, not
# copied, so that shipping a retrained drafter keeps the test honest.
SHIPPED_P0 = json.loads((Path(eyas.__file__).parent / "interop" / "embedded" / "smollm2-135m-instruct" / "eyas.json")
                        .read_text())["contract"]["metrics"]["conditional_accuracy_per_position"][0]

# The classic exposition (older prometheus_client: "# TYPE <name> counter" without _total), by hand.
CLASSIC_VLLM = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 50.0
# HELP vllm:spec_decode_num_accepted_tokens Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 60.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 25.0
"""


def watch(*args: str):
    return CliRunner().invoke(app, ["watch", *args])


@pytest.mark.unit
def test_vllm_texts_parse_to_their_exact_counts():
    healthy = parse_metrics((METRICS / "vllm_healthy.txt").read_text())
    assert healthy.engine == "vllm" and healthy.drafts == 12000 and healthy.draft_tokens == 36000
    assert healthy.accepted_per_position == [7680, 5040, 3600] and healthy.accepted_tokens == 16320
    broken = parse_metrics((METRICS / "vllm_broken.txt").read_text())
    assert broken.accepted_per_position == [290, 25, 2] and broken.accepted_tokens == 317
    obs = broken.observation()
    assert obs.rounds == 12000 and obs.depth == 3 and obs.acceptance[0] == pytest.approx(290 / 12000)


@pytest.mark.unit
def test_the_classic_exposition_and_several_engines_are_summed():
    c = parse_metrics(CLASSIC_VLLM)
    assert c.drafts == 150 and c.accepted_tokens == 180 and c.accepted_per_position == [105, 75]


@pytest.mark.unit
def test_sglang_gauge_and_no_metrics_at_all():
    s = parse_metrics((METRICS / "sglang_broken.txt").read_text())
    assert s.engine == "sglang" and s.accept_length == pytest.approx(1.03) and s.accept_rate == pytest.approx(0.01)
    assert s.observation().rounds is None
    with pytest.raises(MetricsError, match="vllm:spec_decode_num_drafts_total"):
        parse_metrics('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 1.0\n')
    with pytest.raises(MetricsError, match="not Prometheus"):
        parse_metrics("this is { not metrics\n")


@pytest.mark.unit
def test_difference_of_two_scrapes_is_what_happened_between():
    before = parse_metrics(CLASSIC_VLLM)
    after = parse_metrics(CLASSIC_VLLM.replace("100.0", "300.0").replace(' 70.0', ' 90.0'))
    d = difference(after, before)
    assert d.drafts == 200 and d.accepted_per_position == [20, 0]
    restarted = difference(before, after)  # counters went down: the later totals
    assert restarted.drafts == before.drafts


@pytest.mark.unit
def test_judge_thresholds_on_the_first_position_and_on_the_accept_length():
    pred = Prediction([0.6, 0.4, 0.3])
    judged = lambda a0, rounds=100: judge(Observation(rounds, [int(a0 * rounds), 0, 0]), pred, doctor="eyas doctor x")
    assert judged(0.62).status == OK
    assert judged(0.40).status == LOW  # ratio 0.67
    v = judged(0.20)  # ratio 0.33 < 0.5
    assert v.status == BROKEN and v.alert and v.basis == "first_position" and v.ratio == pytest.approx(1 / 3)
    assert "eyas doctor x" in v.message and "layer ids" in v.message
    assert judged(0.2, rounds=10).status == INSUFFICIENT
    assert judge(Observation(100, [20]), None, doctor="d").status == NO_PREDICTION
    # accept length only (SGLang): S / E over the served depth, alert below 0.25
    assert judge(Observation(None, [], accept_length=1.5, depth=3), pred, doctor="d").status == LOW  # 0.5/1.3
    assert judge(Observation(None, [], accept_length=1.2, depth=3), pred, doctor="d").status == BROKEN  # 0.15


@pytest.mark.unit
def test_prediction_is_the_running_product_of_conditional_accuracies():
    from eyas.contract import ValidationMetrics

    p = prediction_from_metrics(ValidationMetrics(accuracy_per_position=[0.5, 0.3],
                                                  conditional_accuracy_per_position=[0.5, 0.6]))
    assert p.acceptance == pytest.approx([0.5, 0.3]) and p.accept_length(2) == pytest.approx(1.8)
    assert prediction_from_metrics(ValidationMetrics(accuracy_per_position=[0.7, 0.5])).acceptance == [0.7]
    assert prediction_from_metrics(ValidationMetrics(step=3)) is None


@pytest.mark.integration
def test_watch_on_the_recorded_vllm_texts_gives_the_right_verdicts():
    ok = watch("--metrics", str(METRICS / "vllm_healthy.txt"), "--draft", "default", "--target", "smollm2")
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith("OK vllm (lifetime)") and "first-position acceptance 0.640" in ok.output
    bad = watch("--metrics", f"file://{METRICS / 'vllm_broken.txt'}", "--draft", "default", "--target", "smollm2")
    assert bad.exit_code == 1, bad.output
    assert bad.output.startswith("BROKEN vllm") and f"of the predicted {SHIPPED_P0:.3f}" in bad.output
    assert "run: eyas doctor --target smollm2 --draft" in bad.output and "--engine vllm" in bad.output
    js = watch("--metrics", str(METRICS / "vllm_broken.txt"), "--draft", "default", "--json")
    assert js.exit_code == 1
    d = json.loads(js.stdout)
    assert d["status"] == "broken" and d["alert"] is True and d["engine"] == "vllm" and d["rounds"] == 12000
    assert d["ratio"] == pytest.approx(290 / 12000 / SHIPPED_P0, abs=1e-4) and d["ratio_basis"] == "first_position"
    assert d["counters"]["accepted_per_position"] == [290, 25, 2] and len(d["likely_causes"]) == 4
    good = json.loads(watch("--metrics", str(METRICS / "vllm_healthy.txt"), "--draft", "default", "--json").stdout)
    assert good["status"] == "ok" and good["alert"] is False and good["served_acceptance_per_position"][0] == 0.64


@pytest.mark.integration
def test_watch_on_sglang_texts_and_unusable_input():
    ok = watch("--metrics", str(METRICS / "sglang_healthy.txt"), "--draft", "default", "--depth", "3", "--json")
    bad = watch("--metrics", str(METRICS / "sglang_broken.txt"), "--draft", "default", "--depth", "3", "--json")
    assert (ok.exit_code, json.loads(ok.stdout)["status"]) == (0, "ok")
    d = json.loads(bad.stdout)
    assert bad.exit_code == 1 and d["status"] == "broken" and d["ratio_basis"] == "accept_length"
    assert d["doctor_command"].endswith("--engine sglang")
    missing = watch("--metrics", "/nonexistent/metrics.txt", "--draft", "default")
    assert missing.exit_code == 2 and "no file" in missing.output


@pytest.mark.unit
def test_every_n_seconds_judges_the_difference_between_scrapes(tmp_path):
    texts = iter([(METRICS / "vllm_healthy.txt").read_text(),
                  # the head broke after the first scrape: 4000 more drafts, almost nothing accepted
                  (METRICS / "vllm_healthy.txt").read_text().replace("} 12000.0", "} 16000.0")
                  .replace('position="0"} 7680.0', 'position="0"} 7700.0')])
    w = Watcher("scrape", "default", target="smollm2", read=lambda s: next(texts))
    first, second = list(w.checks(0.1, 2))
    assert first.verdict.status == OK and first.window == "lifetime"
    assert second.window == "since the previous scrape" and second.counters.drafts == 4000
    assert second.verdict.status == BROKEN and second.verdict.served_acceptance[0] == pytest.approx(20 / 4000)
