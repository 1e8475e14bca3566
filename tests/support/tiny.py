"""Tiny random Hugging Face causal LMs built from configs, for unit tests (no downloads), and
drafters trained on them for a few seconds."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3Config

from eyas.convention import CaptureSpec

SPEC4 = CaptureSpec((1, 2, 3), 4)  # boundaries of a 4-block tiny target (the EAGLE default needs >= 7 blocks)

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def tiny_config(kind: str = "llama", num_blocks: int = 10):
    if kind == "llama":
        return LlamaConfig(num_hidden_layers=num_blocks, **COMMON)
    if kind == "qwen2":
        return Qwen2Config(num_hidden_layers=num_blocks, **COMMON)
    if kind == "qwen3":
        return Qwen3Config(num_hidden_layers=num_blocks, head_dim=16, **COMMON)
    if kind == "deepseek_v3":
        # MLA attention + MoE blocks after the first dense one.
        return DeepseekV3Config(
            num_hidden_layers=num_blocks, vocab_size=128, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=1, max_position_embeddings=256, tie_word_embeddings=False,
        )
    raise ValueError(f"unknown tiny model kind {kind!r}")


def tiny_model(kind: str = "llama", num_blocks: int = 10, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, num_blocks), dtype=torch.float32)
    return model.eval()


def sharpened(model, factor: float):
    """Scale lm_head so the target's distributions are peaked like a trained LM's."""
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


def random_prompts(n: int, vocab: int, seed: int, lengths=(1, 30)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return out


def train_drafter(model, spec, sequences, prompt_len, steps: int, draft_ids: torch.Tensor | None = None,
                  lr: float = 3e-3, seed: int = 0, zero_embedding: bool = False):
    """A drafter trained with eyas's TTT step (3 steps deep) on ``sequences``: a [B, T] batch with
    one ``prompt_len``, or a list of [1, T_i] sequences with a list of prompt lengths (one optimizer
    step per sequence). The loss counts the tokens after the prompt. ``zero_embedding``: the
    drafter's token embedding is zeroed first (and stays zero: it is not trained), so it predicts
    from the target's features alone."""
    from eyas.capture import BoundaryCapture
    from eyas.drafter.build import new_drafter
    from eyas.drafter.ttt import TargetLabels, ttt_forward

    if isinstance(sequences, torch.Tensor):
        sequences, prompt_len = [sequences], [prompt_len]
    drafter, _ = new_drafter(model, boundaries=spec.boundaries, seed=seed,
                             draft_vocab_size=None if draft_ids is None else len(draft_ids))
    if draft_ids is not None:
        drafter.set_vocab_map(draft_ids)
    if zero_embedding:
        with torch.no_grad():
            drafter.embed_tokens.weight.zero_()
    vocab = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
    batches = []
    for seq, n in zip(sequences, prompt_len):
        with torch.no_grad(), BoundaryCapture(model, spec) as cap:
            logits = model(seq).logits
            features = cap.features()
        loss_mask = torch.ones_like(seq)
        loss_mask[:, :n] = 0
        batches.append((seq, features, TargetLabels.from_logits(logits, vocab), loss_mask))
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        for seq, features, labels, loss_mask in batches:
            loss = ttt_forward(drafter, seq, features, labels, loss_mask, steps=3).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    return drafter.eval()


def self_trained_drafter(model, spec, prompts: int = 32, new_tokens: int = 40, steps: int = 60, lr: float = 5e-3):
    """A partially right drafter: trained a few seconds on the target's own greedy continuations of
    ``prompts`` random 6-token prompts."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (prompts, 6), generator=g)
    with torch.no_grad():
        seqs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                              pad_token_id=0, eos_token_id=None)
    return train_drafter(model, spec, seqs, prompt_len=6, steps=steps, lr=lr)


def ttt_accepts(model, spec, drafter, prompt: list[int], result, depth: int, max_new_tokens: int) -> list[tuple[int, int]]:
    """(accepted, TTT-predicted) drafts of every greedy chain round of ``result`` (a
    speculative_generate result for ``prompt``), the last round left out (max_new_tokens may cut it).

    A round after x_m drafts x_{m+d} with the drafter's TTT step d-1 at index m-1 (step k at index
    t reads x_{t+1+k} and predicts x_{t+2+k}); conditional on the earlier drafts being accepted,
    serving and TTT compute the same thing, so a round should accept exactly the run of leading TTT
    steps that were right on the final sequence."""
    from eyas.capture import BoundaryCapture
    from eyas.drafter.ttt import TargetLabels, ttt_forward

    seq = torch.tensor([prompt + result.tokens])
    draft_ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
    with torch.no_grad():
        with BoundaryCapture(model, spec) as cap:
            logits = model(seq).logits
            features = cap.features()
        ttt = ttt_forward(drafter, seq, features, TargetLabels.from_logits(logits, draft_ids), torch.ones_like(seq),
                          steps=depth, keep_logits=True)
    predicted = [drafter.draft_to_target(lg.argmax(-1))[0].tolist() for lg in ttt.logits]  # per step [T]
    x = seq[0].tolist()
    max_len = len(prompt) + max_new_tokens
    m = len(prompt)  # after the prefill, x_n is committed and the first round drafts from it
    out = []
    for emitted in result.stats.accept_lengths[:-1]:
        gamma = min(depth, max_len - 2 - m)
        expected = 0
        while expected < gamma and predicted[expected][m - 1] == x[m + expected + 1]:
            expected += 1
        out.append((emitted - 1, expected))
        m += emitted
    return out
