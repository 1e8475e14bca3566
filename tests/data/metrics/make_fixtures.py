"""Write the metric-text fixtures of tests/test_watch.py (see SOURCE.md here).

vLLM: the four spec-decode counters registered exactly as vLLM's ``SpecDecodingProm`` registers
them (names, documentation strings, labels ``model_name``, ``engine`` and ``position``), plus two of
its ordinary metrics, exposed by prometheus_client as vLLM exposes them. SGLang: the two gauges of
``sglang/srt/metrics/collector.py`` with its label names. The counts are chosen, not scraped (no
GPU engine runs here): a healthy head of the shipped SmolLM2 drafter served as a chain of 3
(num_speculative_tokens=3) and the same head served with the embeddings counted as a layer.

    python tests/data/metrics/make_fixtures.py
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

HERE = Path(__file__).parent
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def vllm(drafts: int, per_pos: list[int], generation_tokens: int) -> str:
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    lv = [MODEL, "0"]
    Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
          registry=reg).labels(*lv).set(3)
    Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
            registry=reg).labels(*lv).inc(generation_tokens)
    Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, registry=reg).labels(*lv).inc(drafts)
    Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
            registry=reg).labels(*lv).inc(drafts * len(per_pos))
    Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
            registry=reg).labels(*lv).inc(sum(per_pos))
    pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                  labels + ["position"], registry=reg)
    for i, a in enumerate(per_pos):
        pos.labels(*lv, str(i)).inc(a)
    return generate_latest(reg).decode()


def sglang(accept_length: float, accept_rate: float) -> str:
    reg = CollectorRegistry()
    labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"]
    lv = [MODEL, "unified", "0", "0", "0"]
    Gauge("sglang:spec_accept_length", "The average acceptance length of speculative decoding.", labels,
          registry=reg).labels(*lv).set(accept_length)
    Gauge("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding.", labels,
          registry=reg).labels(*lv).set(accept_rate)
    Gauge("sglang:num_running_reqs", "The number of running requests.", labels, registry=reg).labels(*lv).set(2)
    return generate_latest(reg).decode()


if __name__ == "__main__":
    # healthy: 0.64, 0.42, 0.30 per position (training predicts 0.628, 0.413, 0.295 for the first three)
    (HERE / "vllm_healthy.txt").write_text(vllm(12000, [7680, 5040, 3600], 28320))
    # broken: the embeddings counted as a layer; per position 0.024, 0.002, 0.0002
    (HERE / "vllm_broken.txt").write_text(vllm(12000, [290, 25, 2], 12317))
    (HERE / "sglang_healthy.txt").write_text(sglang(2.31, 0.437))
    (HERE / "sglang_broken.txt").write_text(sglang(1.03, 0.01))
