"""The walk the fast target's tests take through every cache operation the decoding loop uses
(prefill, a tree, keep of a path, decode), comparing a target with the Hugging Face model at each
step: tests/test_engine_llama.py and tests/test_decode_attention.py."""

from __future__ import annotations

import torch

from eyas.convention import CaptureSpec

L = 4
SPEC = CaptureSpec((0, 2, L), L)  # the embeddings, a middle boundary and the last block's output
ATOL = 2e-5
KEYS = (16, 32)  # key buckets for a 64-entry cache: 16, 32, 64 (the default ladder starts at 512)


def tree_of_five() -> tuple[torch.Tensor, torch.Tensor]:
    """A tree of 5 tokens: 0 is the root's child; 1, 2 children of 0; 3 of 1; 4 of 2. Returns the
    ancestor mask [5, 5] and each node's depth [5]."""
    parent = [-1, 0, 0, 1, 2]
    mask = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parent):
        while p >= 0:
            mask[i, p], p = True, parent[p]
    return mask, mask.sum(1) - 1


def walk(fast, hf, g: torch.Generator, device="cpu") -> None:
    """Prefill 9, a 5-token tree, keep a path of it, decode 2 then 1 then 1: equal at every step."""
    prompt = torch.randint(0, 128, (1, 9), generator=g).to(device)
    same(fast.prefill(prompt), hf.prefill(prompt))
    mask, depth = tree_of_five()
    ids = torch.randint(0, 128, (1, 5), generator=g).to(device)
    positions = (9 + depth)[None].to(device)
    same(fast.forward(ids, positions, mask), hf.forward(ids, positions, mask))
    for t in (fast, hf):  # accept the path 0 -> 2 -> 4 (not contiguous in the block)
        t.keep([0, 2, 4])
    assert fast.cache_len == hf.cache_len == 12
    ids = torch.randint(0, 128, (1, 2), generator=g).to(device)
    positions = torch.tensor([[12, 13]], device=device)
    same(fast.forward(ids, positions), hf.forward(ids, positions))
    same(fast.forward(ids[:, :1], positions[:, :1] + 2), hf.forward(ids[:, :1], positions[:, :1] + 2))


def same(a: tuple, b: tuple) -> None:
    """Two (logits, features) pairs equal to float32 tolerance."""
    (la, fa), (lb, fb) = a, b
    torch.testing.assert_close(la, lb, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(fa, fb, atol=ATOL, rtol=1e-4)
