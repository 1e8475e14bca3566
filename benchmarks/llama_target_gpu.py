"""LlamaTarget (our own Llama forward, static KV cache, capture in the forward) against HFTarget on a GPU.

A SmolLM2-shaped Llama with random weights (30 blocks, hidden 576, 9 query / 3 key-value heads,
vocab 49152), bf16, boundaries [2, 15, 27], cache capacity 2048. No GGUF is needed: this measures
agreement and cost, not acceptance. Prints and writes JSON (``--out``):

- agreement through prefill (64 tokens), a 24-token tree, keep of a 4-token path, and a decode step:
  max |logit difference| relative to the logits' RMS, argmax agreement, and the same for features;
- greedy plain decoding (96 tokens, 4 prompts) on each: the fraction of outputs token-identical to
  HFTarget's and where they part (bf16 rounds differently in the different attention paths);
- cost (median of 30; the forward alone, its inputs already on the device, the rollback untimed)
  of one decode step and one 24-token tree verification, and plain greedy tokens/s, for four targets: HFTarget; LlamaTarget eager (exact shapes); LlamaTarget with fixed
  shapes + CUDA graphs, its functions eager inside the graph ("graphs"); the same with its
  functions compiled by inductor ("compiled", the default on a GPU). The compiled and graphed
  targets are warmed up first (the buckets this run uses, 1, 32 and 64, compiled and captured):
  ``warmup_s`` reports that time apart, and no timed figure includes it; ``compile_error`` says why
  compilation failed if it did (the target then ran eagerly inside its graphs).

    PYTHONPATH=src python benchmarks/llama_target_gpu.py --out llama_target_gpu.json

``--tiny`` runs an 8-block toy config with few repetitions (a smoke test; on the CPU unless
``--device cuda``, where the compiled and graphed targets are the eager fixed-shape step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from eyas.convention import CaptureSpec
from eyas.engine import HFTarget, LlamaTarget, plain_generate
from eyas.engine.stats import synchronize


def smollm2_shaped(device: torch.device, tiny: bool, seed: int = 0) -> torch.nn.Module:
    if tiny:
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()
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


def timed(fn, device: torch.device, reps: int = 30, warm: int = 5, after=None) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, the host clock on the CPU); ``after``
    runs after each timed call, outside the timing."""
    times = []
    for _ in range(reps + warm):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        if after is not None:
            after()
    return statistics.median(times[warm:])


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="llama_target_gpu.json")
    ap.add_argument("--tiny", action="store_true", help="a toy config and few repetitions (smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(1)  # toy shapes: a second thread only adds contention
    reps, new_tokens = (3, 8) if args.tiny else (30, 96)
    model = smollm2_shaped(dev, args.tiny)
    L, V = model.config.num_hidden_layers, model.config.vocab_size
    spec = CaptureSpec.create(L, None)
    report: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "model": f"{'toy' if args.tiny else 'SmolLM2-shaped'} Llama, random weights, "
                             f"{str(next(model.parameters()).dtype).removeprefix('torch.')}",
                    "boundaries": list(spec.boundaries), "capacity": 2048}
    targets: dict = {"hf_target": HFTarget(model, spec, max_length=2048),
                     "llama_target": LlamaTarget(model, spec, max_length=2048)}
    # The buckets this run uses: prefills of 64 and 24 tokens, the 24-token tree (32), decode steps (1).
    buckets = (1, 32, 64)
    report["warmup_s"], report["warmup_buckets"] = {}, list(buckets)
    for name, compile_ in (("llama_target_graphs", False), ("llama_target_compiled", True)):
        try:
            t = LlamaTarget(model, spec, max_length=2048, cuda_graphs=True, compile=compile_)
            seconds = t.warmup(buckets)  # compiled (compiled) and captured before any timing
            print(f"{name}: warmup {seconds:.1f} s ({t.implementation})", flush=True)
            targets[name] = t
            report["warmup_s"][name] = seconds
            if t.compile_error:
                report.setdefault("compile_error", {})[name] = t.compile_error
        except Exception:  # noqa: BLE001 (report it and go on with the other targets)
            report.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"{name} failed:\n{report['errors'][name]}", flush=True)
    report["implementation"] = {name: t.implementation for name, t in targets.items()}
    llama_names = [n for n in targets if n != "hf_target"]

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (1, 64), generator=g).to(dev)
    mask, depth = tree_mask(24, g)
    tree_ids = torch.randint(0, V, (1, 24), generator=g).to(dev)
    one = torch.randint(0, V, (1, 1), generator=g).to(dev)
    path = [0] + [i for i in range(1, 24) if bool(mask[i, 0])][:3]

    def walk(t):
        out = {"prefill_64": t.prefill(prompt), "tree_24": t.forward(tree_ids, (64 + depth)[None].to(dev), mask)}
        t.keep(path)
        out["decode_after_keep"] = t.forward(one, torch.tensor([[64 + len(path)]], device=dev))
        return out

    ref = walk(targets["hf_target"])
    report["agreement_with_hf"] = {
        name: {step: {"logits": agreement(a[0], ref[step][0]), "features": agreement(a[1], ref[step][1])}
               for step, a in walk(targets[name]).items()}
        for name in llama_names}
    print("agreement done", flush=True)

    prompts = [torch.randint(0, V, (24,), generator=torch.Generator().manual_seed(100 + s)).tolist()
               for s in range(4)]
    outputs = {name: [plain_generate(t, p, max_new_tokens=new_tokens) for p in prompts] for name, t in targets.items()}
    report["greedy_plain_identical_to_hf"] = {}
    for name in llama_names:
        pairs = [(a.tokens, b.tokens) for a, b in zip(outputs[name], outputs["hf_target"])]
        report["greedy_plain_identical_to_hf"][name] = {
            "fraction": sum(x == y for x, y in pairs) / len(pairs),
            "first_difference_at": [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in pairs]}
    # Second pass timed (the first ran every path once more after the warm-up).
    report["plain_tokens_per_s"] = {}
    for name, t in targets.items():
        synchronize(dev)
        t0 = time.perf_counter()
        n = sum(len(plain_generate(t, p, max_new_tokens=new_tokens).tokens) for p in prompts)
        synchronize(dev)
        report["plain_tokens_per_s"][name] = n / (time.perf_counter() - t0)
    print("plain decoding done", flush=True)

    costs = {}
    tree_pos, one_pos, mask_dev = (64 + depth)[None].to(dev), torch.tensor([[64]], device=dev), mask.to(dev)
    for name, t in targets.items():
        t.prefill(prompt)

        def rollback(t=t):
            t.keep([])  # the cache stays at the prompt

        def decode_step(t=t):
            t.forward(one, one_pos)

        def verify_step(t=t):
            t.forward(tree_ids, tree_pos, mask_dev)

        costs[name] = {"decode_ms": timed(decode_step, dev, reps, after=rollback),
                       "verify_24_ms": timed(verify_step, dev, reps, after=rollback)}
    report["step_cost_ms"] = costs
    print(json.dumps(report, indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    width = max(len(n) for n in targets)
    print(f"\n{'target':<{width}}  {'decode ms':>9}  {'verify 24 ms':>12}  {'plain tok/s':>11}  implementation")
    for name, t in targets.items():
        c = costs[name]
        print(f"{name:<{width}}  {c['decode_ms']:9.3f}  {c['verify_24_ms']:12.3f}  "
              f"{report['plain_tokens_per_s'][name]:11.1f}  {t.implementation}")


if __name__ == "__main__":
    main()
