"""LlamaTarget (our own Llama forward, static KV cache, capture in the forward) against HFTarget on a GPU.

A SmolLM2-shaped Llama with random weights (30 blocks, hidden 576, 9 query / 3 key-value heads,
vocab 49152), bf16, boundaries [2, 15, 27]. No GGUF is needed: this measures agreement and cost, not
acceptance. Prints and writes JSON (``--out``):

- agreement through prefill (64 tokens), a 24-token tree, keep of a 4-token path, and a decode step:
  max |logit difference| relative to the logits' RMS, argmax agreement, and the same for features;
- greedy plain decoding (96 tokens, 4 prompts) on both: the fraction of outputs token-identical and
  where they part (bf16 rounds differently in the two attention paths);
- cost (CUDA events, median of 30) of one decode step and one 24-token tree verification, and plain
  greedy tokens/s, for HFTarget, LlamaTarget eager, and LlamaTarget with fixed shapes + CUDA graphs.

    PYTHONPATH=src python benchmarks/llama_target_gpu.py --out llama_target_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from eyas.convention import CaptureSpec
from eyas.engine import HFTarget, LlamaTarget, plain_generate


def smollm2_shaped(seed: int = 0) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)  # peaked distributions, like a trained LM's
    return model


def tree_mask(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of n nodes (node i's parent < i, -1 = the root): ancestor mask and depth."""
    parent = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parent):
        while p >= 0:
            mask[i, p], p = True, parent[p]
    return mask, mask.sum(1) - 1


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.float(), b.float()
    rms = b.pow(2).mean().sqrt().item()
    return {"max_abs_diff_over_rms": (a - b).abs().max().item() / rms,
            "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def timed(fn, reps: int = 30) -> float:
    times = []
    for _ in range(reps + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[5:])


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="llama_target_gpu.json")
    args = ap.parse_args()
    model = smollm2_shaped()
    spec = CaptureSpec.create(30, None)
    fast, hf = LlamaTarget(model, spec, max_length=2048), HFTarget(model, spec, max_length=2048)
    graphs = LlamaTarget(model, spec, max_length=2048, cuda_graphs=True)
    g = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "model": "SmolLM2-shaped Llama, random weights, bf16", "boundaries": list(spec.boundaries)}

    prompt = torch.randint(0, 49152, (1, 64), generator=g).to(dev)
    mask, depth = tree_mask(24, g)
    tree_ids = torch.randint(0, 49152, (1, 24), generator=g).to(dev)
    one = torch.randint(0, 49152, (1, 1), generator=g).to(dev)
    path = [0] + [i for i in range(1, 24) if bool(mask[i, 0])][:3]

    def walk(t):
        out = {"prefill_64": t.prefill(prompt), "tree_24": t.forward(tree_ids, (64 + depth)[None].to(dev), mask)}
        t.keep(path)
        out["decode_after_keep"] = t.forward(one, torch.tensor([[64 + len(path)]], device=dev))
        return out

    ref = walk(hf)
    report["agreement_with_hf"] = {
        name: {step: {"logits": agreement(a[0], ref[step][0]), "features": agreement(a[1], ref[step][1])}
               for step, a in walk(t).items()}
        for name, t in (("llama_target", fast), ("llama_target_graphs", graphs))}

    prompts = [torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(100 + s)).tolist()
               for s in range(4)]
    outputs = {name: [plain_generate(t, p, max_new_tokens=96) for p in prompts]
               for name, t in (("hf_target", hf), ("llama_target", fast), ("llama_target_graphs", graphs))}
    report["greedy_plain_identical_to_hf"] = {}
    for name in ("llama_target", "llama_target_graphs"):
        pairs = [(a.tokens, b.tokens) for a, b in zip(outputs[name], outputs["hf_target"])]
        report["greedy_plain_identical_to_hf"][name] = {
            "fraction": sum(x == y for x, y in pairs) / len(pairs),
            "first_difference_at": [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in pairs]}
    # Second pass timed (the first captured the graphs).
    report["plain_tokens_per_s"] = {}
    for name, t in (("hf_target", hf), ("llama_target", fast), ("llama_target_graphs", graphs)):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        n = sum(len(plain_generate(t, p, max_new_tokens=96).tokens) for p in prompts)
        end.record()
        torch.cuda.synchronize()
        report["plain_tokens_per_s"][name] = n / (start.elapsed_time(end) / 1000)

    costs = {}
    tree_pos = (64 + depth)[None].to(dev)
    for name, t in (("hf_target", hf), ("llama_target", fast), ("llama_target_graphs", graphs)):
        t.prefill(prompt)

        def decode_step():
            t.forward(one, torch.tensor([[64]], device=dev))
            t.keep([])  # roll the step back: the cache stays at the prompt

        def verify_step():
            t.forward(tree_ids, tree_pos, mask)
            t.keep([])

        costs[name] = {"decode_ms": timed(decode_step), "verify_24_ms": timed(verify_step)}
    report["step_cost_ms"] = costs
    print(json.dumps(report, indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
