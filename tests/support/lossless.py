"""The check that speculative sampling is lossless: a tiny target over 16 tokens whose distribution
of the first three new tokens is enumerated exactly, and Pearson's chi-square test of sampled counts
against it (shared by test_engine.py on the CPU and test_engine_cuda.py on a GPU)."""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from eyas.convention import CaptureSpec
from eyas.engine import SamplingParams
from eyas.engine.sampling import probabilities
from tests.support.tiny import sharpened, train_drafter

SPEC3 = CaptureSpec((1, 2, 3), 3)  # boundary 3 = the last block's output, before the final norm


def wilson_hilferty_critical(df: int, z: float) -> float:
    """Upper critical value of chi-square(df) at the normal quantile z (Wilson-Hilferty; within 1% of
    the exact value for df >= 3 in the upper tail used here)."""
    h = 2.0 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


Z_999 = 3.0902  # standard normal quantile 0.999: the test's false-alarm rate is 0.1%


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson statistic of observed counts against exact cell probabilities, cells with an
    expected count below ``min_expected`` pooled into one; returns (statistic, degrees of freedom)."""
    n = counts.sum()
    expected = probs.flatten().double() * n
    counts = counts.flatten().double()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < min_expected:  # pooled remainder too small: merge it into the smallest big cell
        i = int(exp[:-1].argmin())
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def make_small_vocab():
    """A tiny Llama over 16 tokens, and a drafter trained on its samples whose draft vocabulary
    lacks 4 of the 16 tokens."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                      initializer_range=0.2)
    # Structured, not flat: the joint of the first three tokens has ~4.5 nats of entropy (of 8.3 for
    # uniform), with ~1.5 nats left in x3 given x1, x2; ~36 cells hold 70% of the mass.
    model = sharpened(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), 2.0)
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, 16, (48, 4), generator=g)
    torch.manual_seed(3)
    with torch.no_grad():
        seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                              max_new_tokens=24, pad_token_id=0, eos_token_id=None)
    drafter = train_drafter(model, SPEC3, seqs, prompt_len=4, steps=60, draft_ids=torch.arange(12), lr=5e-3)
    return model, drafter


def exact_first_three(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) [16, 16, 16] under plain sampling, by enumeration."""
    V = 16
    with torch.no_grad():
        p1 = probabilities(model(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        two = torch.tensor([prompt + [a] for a in range(V)])
        p2 = probabilities(model(two).logits[:, -1], params)  # [V, V]
        three = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = probabilities(model(three).logits[:, -1], params).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3
