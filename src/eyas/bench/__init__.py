"""Benchmarks: speculative vs plain vs Hugging Face `generate` on the EAGLE prompt sets.

    prompts.py  the six EAGLE evaluation sets shipped with eyas, or any prompt file
    run.py      one set: each tree's speculative runs, plain decoding and the HF baseline, per prompt
    sweep.py    every temperature on its own, every tree of it, --tree auto against the fixed trees
    hf.py       the HF baseline: generate with a static cache and torch.compile on a GPU, eager on the CPU
    report.py   the tables, the prediction line and the accept-length PNG
    validate.py the engine's accept length on a few validation prompts (training's TauProbe)
"""

from eyas.bench.prompts import NAMED_SETS, load_prompts
from eyas.bench.report import bench_table, plot_accept_lengths
from eyas.bench.run import SetResult, bench_set, bench_trees, merge

__all__ = ["NAMED_SETS", "SetResult", "bench_set", "bench_table", "bench_trees", "load_prompts", "merge",
           "plot_accept_lengths"]
