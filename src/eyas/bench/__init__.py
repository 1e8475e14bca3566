"""Benchmarks: speculative vs plain vs Hugging Face `generate` on the EAGLE prompt sets."""

from eyas.bench.prompts import NAMED_SETS, load_prompts
from eyas.bench.report import bench_table, plot_accept_lengths
from eyas.bench.run import SetResult, bench_set

__all__ = ["NAMED_SETS", "SetResult", "bench_set", "bench_table", "load_prompts", "plot_accept_lengths"]
