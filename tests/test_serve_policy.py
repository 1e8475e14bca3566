"""eyas.serve.policy: a lone request takes the path measured faster (speculative or a plain row),
per greedy and sampled requests; the other path is measured again now and then; on and off obey."""

from __future__ import annotations

import pytest

from eyas.engine import SamplingParams
from eyas.serve.policy import SpeculationPolicy

pytestmark = pytest.mark.unit


def test_the_policy_takes_the_faster_path_explores_the_other_and_obeys_on_and_off():
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0)
    p = SpeculationPolicy(explore_every=4)
    assert p.speculate(greedy)  # 1: nothing measured: speculation first
    p.measured(greedy, "speculative", 30, 1.0)
    assert not p.speculate(greedy)  # 2: the plain path is tried
    p.measured(greedy, "plain", 20, 1.0)
    assert p.speculate(greedy)  # 3: 30 > 20 x 1.02
    assert not p.speculate(greedy)  # 4: every 4th lone request explores the other path
    assert p.speculate(hot)  # kinds are apart: sampled has nothing measured
    p.measured(hot, "speculative", 10, 1.0)
    p.measured(hot, "plain", 20, 1.0)
    assert not p.speculate(hot)
    for _ in range(50):  # the speculative rate drifts down: recent samples weigh more
        p.measured(greedy, "speculative", 10, 1.0)
    assert not p.speculate(greedy)
    assert SpeculationPolicy("on").speculate(hot) and not SpeculationPolicy("off").speculate(greedy)
    with pytest.raises(ValueError, match=r"speculation: expected one of \['auto', 'on', 'off'\], found 'yes'"):
        SpeculationPolicy("yes")
