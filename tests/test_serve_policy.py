"""eyas.serve.policy: a lone request takes the path measured faster (speculative or a row of the batch),
per greedy and sampled requests; the other path is measured again now and then; on and off obey."""

from __future__ import annotations

import pytest

from eyas.engine import SamplingParams
from eyas.engine.tree import TreeSpec
from eyas.serve.policy import SpeculationPolicy, batch_mode

pytestmark = pytest.mark.unit


def test_the_policy_takes_the_faster_path_explores_the_other_and_obeys_on_and_off():
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0)
    p = SpeculationPolicy(explore_every=4)
    assert p.speculate(greedy)  # 1: nothing measured: speculation first
    p.measured(greedy, "speculative", 30, 1.0)
    assert not p.speculate(greedy)  # 2: the row path is tried
    p.measured(greedy, "row", 20, 1.0)
    assert p.speculate(greedy)  # 3: 30 > 20 x 1.02
    assert not p.speculate(greedy)  # 4: every 4th lone request explores the other path
    assert p.speculate(hot)  # kinds are apart: sampled has nothing measured
    p.measured(hot, "speculative", 10, 1.0)
    p.measured(hot, "row", 20, 1.0)
    assert not p.speculate(hot)
    for _ in range(50):  # the speculative rate drifts down: recent samples weigh more
        p.measured(greedy, "speculative", 10, 1.0)
    assert not p.speculate(greedy)
    assert SpeculationPolicy("on").speculate(hot) and not SpeculationPolicy("off").speculate(greedy)
    with pytest.raises(ValueError, match=r"speculation: expected one of \['auto', 'on', 'off'\], found 'yes'"):
        SpeculationPolicy("yes")


def test_with_several_requests_in_flight_the_policy_weighs_the_lanes_against_the_batch_per_bucket():
    """k > 1 requests in flight (eyas.serve.lanes): the lanes untried first, then the batch, then the
    faster by the aggregate rates of that bucket of k, the other explored; a request alone keeps its
    own rates, and /health shows the buckets' rates."""
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0)
    p = SpeculationPolicy(explore_every=4)
    assert p.speculate(greedy, 3)  # 1: lanes untried
    p.measured_in_flight("greedy", "speculative", 300, 1.0, 3)
    assert not p.speculate(greedy, 2)  # 2: the batch at 2-3 in flight untried (2 and 3 share a bucket)
    p.measured_in_flight("greedy", "row", 200, 1.0, 3)
    assert p.speculate(greedy, 3)  # 3: 300 > 200 x 1.02
    assert not p.speculate(greedy, 3)  # 4: explores the batch
    assert p.speculate(greedy, 4)  # another bucket (4-7): nothing measured there
    p.measured_in_flight("sampled", "speculative", 100, 1.0, 2)
    p.measured_in_flight("sampled", "row", 200, 1.0, 2)
    assert not p.speculate(hot, 2)  # the batch is faster for sampled requests
    p.measured_in_flight("greedy", "row", 999, 1.0, 1)  # one request: not a bucket of several
    assert p.speculate(greedy)  # alone: its own rates, nothing measured yet
    rates = p.to_dict()["in_flight_tokens_per_s"]
    assert rates == {"2+/greedy/row": 200.0, "2+/greedy/speculative": 300.0, "2+/sampled/row": 200.0,
                     "2+/sampled/speculative": 100.0}
    assert SpeculationPolicy("off").speculate(greedy, 3) is False and SpeculationPolicy("on").speculate(hot, 3)


@pytest.mark.unit
def test_batch_speculation_tries_each_depth_then_takes_the_fastest_per_batch_size_and_explores_the_others():
    from eyas.serve.policy import BatchSpeculation, arm_label

    p = BatchSpeculation("auto", depths=(1, 2, 3), trees=(), explore_every=4)

    def choose(rows: int, kind: str = "greedy") -> str:  # the arm's label: '0' plain, a chain's depth
        return arm_label(p.choose(rows, kind))

    speed = {"0": 100.0, "1": 150.0, "2": 180.0, "3": 120.0}  # tokens/s of each depth at 2-3 rows
    tried = []
    for _ in range(8):  # every arm twice: a middle depth first, then plain, then the rest
        d = p.choose(2, "greedy")
        tried.append(arm_label(d))
        p.measured(2, "greedy", d, speed[arm_label(d)], 1.0)
    assert tried == ["2", "2", "0", "0", "1", "1", "3", "3"]
    chosen = [choose(3) for _ in range(8)]  # 3 rows: the same bucket as 2
    assert chosen == ["2", "2", "2", "0", "2", "2", "2", "1"]  # the 4th and 8th steps explore the others in turn, plain first
    # depth 2 was still the best at the 16th step's exploration: the interval doubles, the next is the 24th
    assert [choose(2) for _ in range(8)] == ["2"] * 7 + ["3"]
    assert p.to_dict()["tokens_per_s"]["2+/greedy/2"] == 180.0 and p.last == TreeSpec.chain(3)
    assert choose(16) == "2" and choose(2, "sampled") == "2"  # other buckets and kinds: their own
    # where plain is fastest (a large batch), speculation turns off; "off" never speculates, "on" always
    for _ in range(8):
        d = p.choose(64, "greedy")
        p.measured(64, "greedy", d, {"0": 900.0, "1": 700.0, "2": 500.0, "3": 400.0}[arm_label(d)], 1.0)
    assert p.choose(64, "greedy") is None
    assert BatchSpeculation("off").choose(2, "greedy") is None
    assert BatchSpeculation("on", depths=(1, 2), trees=()).arms() == [TreeSpec.chain(1), TreeSpec.chain(2)]
    # above max_rows: plain steps, nothing tried or measured there (each round shape is a compilation)
    capped = BatchSpeculation("on", depths=(3,), trees=(), max_rows=16)
    assert [arm_label(capped.choose(n, "greedy")) for n in (1, 4, 16, 17, 256)] == ["3", "3", "3", "0", "0"]
    with pytest.raises(ValueError, match="speculation: expected one of"):
        BatchSpeculation("sometimes")


@pytest.mark.unit
def test_batch_speculation_offers_trees_beside_chains_per_kind_and_takes_one_where_it_is_fastest():
    from eyas.serve.policy import BatchSpeculation

    small, large = TreeSpec(3, 4, 12), TreeSpec(4, 4, 16)
    c2, c3 = TreeSpec.chain(2), TreeSpec.chain(3)
    p = BatchSpeculation("auto", depths=(2, 3), trees=(large, small), explore_every=4)
    assert p.arms("greedy") == [None, c2, c3, small, large] and p.arms("sampled") == [None, c2, c3]  # by drafts verified
    assert p.drafts("greedy") == (c2, c3, large, small) and p.drafts("sampled") == (c2, c3)
    assert BatchSpeculation(sampled_trees=(small,)).arms("sampled") == [None, c2, c3, small]
    speed = {None: 100.0, c2: 110.0, c3: 115.0, small: 140.0, large: 130.0}
    tried = []
    for _ in range(10):
        d = p.choose(4, "greedy")
        tried.append(d)
        p.measured(4, "greedy", d, speed[d], 1.0)
    assert tried == [c3, c3, None, None, c2, c2, small, small, large, large]
    assert [p.choose(4, "greedy") for _ in range(3)] == [small, None, small]  # the 12th explores, plain first
    assert p.choose(4, "sampled") == c2 and p.last == c2  # sampled steps: chains (no sampled trees by default)
    report = p.to_dict()
    assert report["trees"] == {"greedy": ["4,4,16", "3,4,12"], "sampled": []}
    assert report["tokens_per_s"]["4+/greedy/3,4,12"] == 140.0
    with pytest.raises(ValueError, match=r"trees: expected top_k >= 2 \(a chain is a depth\), found \['3'\]"):
        BatchSpeculation(trees=(TreeSpec.chain(3),))


def test_a_batched_rounds_metrics_equal_its_rows_counted_one_at_a_time():
    """ServeMetrics.rounds (a batched step's rows at once) moves every counter and histogram as
    ServeMetrics.round per row does."""
    from eyas.serve.metrics import ServeMetrics

    accepted, emitted = [0, 3, 1, 3, 2], [1, 4, 2, 3, 3]  # row 3 cut by a stop: fewer kept than accepted + 1
    one, batch = ServeMetrics(4, None, False, 0), ServeMetrics(4, None, False, 0)
    for a, e in zip(accepted, emitted):
        one.round(3, a, e)
    batch.rounds(3, accepted, emitted)
    batch.rounds(3, [], [])  # a step without rows changes nothing
    def counts(m: ServeMetrics) -> list[bytes]:  # every sample but the series' creation times
        return [line for line in m.text().splitlines() if b"_created" not in line]

    assert counts(batch) == counts(one)
    assert b"eyas_spec_decode_num_accepted_tokens_per_pos_total{position=\"2\"} 2.0" in batch.text()


def test_a_batch_speculates_only_where_asked_and_never_with_speculation_off():
    assert batch_mode("auto") == "off" and batch_mode("off") == "off" and batch_mode("on") == "on"
    assert batch_mode("auto", "auto") == "auto" and batch_mode("on", "off") == "off"
    assert batch_mode("off", "on") == "off"  # off means no drafter at all
    with pytest.raises(ValueError, match=r"batch_speculation: expected one of \['auto', 'on', 'off'\], found 'yes'"):
        batch_mode("auto", "yes")


@pytest.mark.unit
def test_batch_speculation_explores_less_while_the_best_arm_stays_and_again_often_when_it_changes():
    from eyas.serve.policy import BatchSpeculation, arm_label

    p = BatchSpeculation("auto", depths=(2, 3), trees=(), explore_every=4, max_backoff=8)
    speed = {"0": 300.0, "2": 200.0, "3": 150.0}  # a large batch: plain is fastest
    taken = []  # the arm of each step of the bucket, from its first
    for step in range(1, 401):
        if step == 201:
            speed["2"] = 900.0  # the traffic changed: depth 2 now pays (the policy sees it when it explores depth 2)
        d = p.choose(64, "sampled")
        p.measured(64, "sampled", d, speed[arm_label(d)], 1.0)
        taken.append(arm_label(d))

    def other_than(arm: str, first: int, last: int) -> list[int]:
        return [n for n in range(first, last + 1) if taken[n - 1] != arm]

    # steps 1-6 try each arm twice; then explorations 4, then 8, 16, up to 32 steps apart
    assert other_than("0", 7, 200) == [8, 12, 16, 32, 64, 96, 128, 160, 192]
    assert other_than("0", 201, 256) == [224, 256]  # depth 3's turn, then depth 2's: now the fastest
    # the best arm changed: explorations 4 steps apart again, then backing off
    assert other_than("2", 257, 400) == [288, 292, 296, 304, 320, 352, 384]
