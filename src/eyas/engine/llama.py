"""Our own forward for Llama-family targets (Llama, Mistral, Qwen2, Qwen3; SmolLM2 is a Llama): a
static KV cache written by index, attention under the tree mask, and boundary capture inside the
forward, with no hooks.

Every step runs through one function, ``_step``: B new tokens write their keys/values at cache
slots cache_len .. cache_len+B-1 by index and attend the first ``keys`` cache entries under a bool
mask. Exact shapes (the default) use B = T and keys = cache_len + T. Fixed shapes pad B to a bucket
(1, 8, 16, 32, 64) and attend the whole capacity, so the step's shapes never depend on cache_len;
on a GPU each bucket's step is then captured once as a CUDA graph and replayed (forward hooks would
not survive a replay: the captured boundaries are an output of the step). The weights are the
Hugging Face model's own modules, called as they are (projections, norms, MLP, rotary embedding):
only the attention over the cache and the walk over the blocks are ours.

Shapes (batch 1): L blocks, H hidden, Hq query heads, Hkv key/value heads, D head dim, C the cache's
capacity (``max_length`` positions).

    keys, values   [L, C, Hkv, D]    entry i = the token at position i (the cache is kept compact)
    forward(T)     writes entries cache_len .. cache_len+B-1, attends [keys] entries with the mask
                   [B, keys] = (every committed entry) ++ (tree_mask, or causal) ++ (pads: themselves)
    keep(idx)      moves the kept entries of the last block to cache_len_before .. (+k) on the device

Boundary capture follows the contract's convention (docs/conventions.md): boundary 0 is the input of
block 0 (the embeddings), boundary b the output of block b-1 (``hidden + residual``), boundary L the
last block's output before the final norm. ``tests/test_engine_llama.py`` holds the logits and the
features equal to :class:`~eyas.engine.target.HFTarget` (which captures with
:class:`~eyas.capture.hooks.BoundaryCapture`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.convention.boundaries import CaptureSpec
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.targets.structure import find_decoder_blocks, text_config

# model_type values whose decoder layer is the Llama layer (pre-norm, rotary, optional q/k bias,
# optional per-head q/k norm) with full attention everywhere.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedTarget(EyasError, ValueError):
    """The model is not a full-attention Llama-family model this forward implements."""


def supports(model: nn.Module) -> str | None:
    """None when :class:`LlamaTarget` can run ``model``; else why not (for ``--target-impl auto``)."""
    cfg = text_config(model)
    kind = getattr(cfg, "model_type", None)
    if kind not in LLAMA_FAMILY:
        return f"model_type {kind!r} is not one of {list(LLAMA_FAMILY)}"
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or (kind == "mistral" and getattr(cfg, "sliding_window", None)):
        return f"layer types {sorted(layer_types)}: sliding-window attention is not implemented"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "rotary_emb") or not hasattr(base, "embed_tokens"):
        return f"{type(model).__name__}: expected .model.embed_tokens and .model.rotary_emb"
    return None


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaTarget(Target):
    """A Llama-family Hugging Face model served with a static KV cache and in-forward capture.

    Holds references to the model's modules (no copy of the weights). ``max_length`` is the cache's
    capacity; it defaults to the model's context, capped at ``default_capacity`` to keep the
    preallocated cache small (2 x L x C x Hkv x D values)."""

    def __init__(self, model: nn.Module, spec: CaptureSpec, max_length: int | None = None,
                 default_capacity: int = 4096, fixed_shapes: bool = False, cuda_graphs: bool = False,
                 buckets: Sequence[int] = (1, 8, 16, 32, 64)) -> None:
        why_not = supports(model)
        if why_not is not None:
            raise UnsupportedTarget(f"LlamaTarget: {why_not}; use the Hugging Face target (HFTarget)")
        self.model = model.eval()
        cfg = text_config(model)
        self.blocks = find_decoder_blocks(model)
        L = len(self.blocks)
        if spec.num_blocks != L:
            raise UnsupportedTarget(f"capture spec: expected a spec for {L} blocks, found one for {spec.num_blocks}")
        self.spec = spec
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm
        self.lm_head = model.get_output_embeddings()
        attn = self.blocks[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.scaling = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = self.lm_head.weight.shape[0]
        cfg_len = int(getattr(cfg, "max_position_embeddings", 0) or default_capacity)
        self.max_length = int(max_length or min(cfg_len, default_capacity))
        shape = (L, self.max_length, self.num_kv_heads, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._slot_of = {b: i for i, b in enumerate(spec.boundaries)}
        # Fixed shapes: a step of T <= max(buckets) tokens runs padded to the smallest bucket >= T and
        # attends the cache's whole capacity under a mask, so its shapes never depend on cache_len;
        # with cuda_graphs (on a GPU) each bucket's step is captured once and replayed.
        self.fixed_shapes = bool(fixed_shapes or cuda_graphs)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.implementation = "fast+cuda-graphs" if self.cuda_graphs else "fast"
        self.reset()

    # -- cache --------------------------------------------------------------------------------

    def reset(self) -> None:
        # The buffers keep their stale values: entries past cache_len are never attended.
        self._len = self._committed = 0

    def keep(self, indices: Sequence[int] | Tensor) -> None:
        idx, P, k = self._kept(indices)
        # Advanced indexing reads a copy first, so overlapping source and destination are fine.
        self.keys[:, P:P + k] = self.keys[:, P + idx]
        self.values[:, P:P + k] = self.values[:, P + idx]

    # -- forward ------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: Tensor, position_ids: Tensor, tree_mask: Tensor | None = None,
                capture: bool = True) -> tuple[Tensor, Tensor | None]:
        T = input_ids.shape[1]
        if self._len + T > self.max_length or int(position_ids.max()) >= self.max_length:
            raise ValueError(f"position {max(self._len + T - 1, int(position_ids.max()))} is past the context "
                             f"({self.max_length} positions)")
        bucket = next((b for b in self.buckets if b >= T), None)
        if self.fixed_shapes and bucket is not None and self._len + bucket <= self.max_length:
            inputs = self._inputs(input_ids, position_ids, tree_mask, bucket, self.max_length)
            logits, features = self._fixed_step(inputs, T)
        else:  # exact shapes: B = T new tokens against the cache_len + T entries in use
            logits, features = self._step(*self._inputs(input_ids, position_ids, tree_mask, T, self._len + T))
        self._appended(T)
        return logits, (features if capture else None)

    def _inputs(self, input_ids: Tensor, position_ids: Tensor, tree_mask: Tensor | None, B: int,
                keys: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A step's inputs for B >= T tokens attending the first ``keys`` cache entries: ids [1, B],
        positions [1, B], the cache slots it writes [B] (cache_len .. cache_len+B-1) and the mask
        [B, keys]. Real token i attends every committed entry and its block's allowed tokens (the
        tree mask, or causal); a pad (i >= T) attends only itself (an all-blocked row gives NaN), and
        no real token attends a pad, so padding changes nothing the caller sees. Built from host
        ints: no device read."""
        T, P = input_ids.shape[1], self._len
        ids = torch.zeros(1, B, dtype=torch.long, device=self.device)
        ids[:, :T] = input_ids
        pos = torch.zeros(1, B, dtype=torch.long, device=self.device)
        pos[:, :T] = position_ids
        slots = torch.arange(P, P + B, device=self.device)
        block = (torch.ones(T, T, dtype=torch.bool, device=self.device).tril() if tree_mask is None
                 else tree_mask.to(self.device, torch.bool))
        mask = torch.zeros(B, keys, dtype=torch.bool, device=self.device)
        mask[:T, :P] = True
        mask[:T, P:P + T] = block
        pads = torch.arange(T, B, device=self.device)
        mask[pads, P + pads] = True
        return ids, pos, slots, mask

    def _step(self, ids: Tensor, pos: Tensor, slots: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """One forward of B = ids.shape[1] tokens attending the first mask.shape[1] cache entries;
        its shapes depend only on those two numbers. Returns logits [1, B, V] and the captured
        boundaries [1, B, S*H] in the spec's slot order (boundary b = the residual stream entering
        block b; boundary L = the last block's output, before the final norm)."""
        h = self.embed(ids)  # [1, B, H]: boundary 0
        cos, sin = self.rotary(h, pos)  # [1, B, D] each, rope scaling included
        captured: list[Tensor | None] = [None] * self.spec.num_slots
        if 0 in self._slot_of:
            captured[self._slot_of[0]] = h
        attn_mask = mask[None, None]  # [1, 1, B, keys]
        for i, block in enumerate(self.blocks):
            h = h + self._attention(i, block.self_attn, block.input_layernorm(h), cos, sin, slots, attn_mask)
            h = h + block.mlp(block.post_attention_layernorm(h))
            if i + 1 in self._slot_of:  # boundary i + 1 = output of block i
                captured[self._slot_of[i + 1]] = h
        return self.lm_head(self.norm(h)), torch.cat(captured, dim=-1)  # type: ignore[arg-type]

    def _attention(self, i: int, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor,
                   attn_mask: Tensor) -> Tensor:
        """Block i's attention for x [1, B, H]: its keys/values written at ``slots`` by index, then
        attention over the first attn_mask.shape[-1] cache entries."""
        B, n_keys = x.shape[1], attn_mask.shape[-1]
        q = attn.q_proj(x).view(1, B, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(1, B, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(1, B, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head, before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        c, s = cos[:, :, None], sin[:, :, None]  # [1, B, 1, D]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        self.keys[i].index_copy_(0, slots, k[0])
        self.values[i].index_copy_(0, slots, v[0])
        keys = self.keys[i, :n_keys].transpose(0, 1)[None]  # [1, Hkv, keys, D]
        values = self.values[i, :n_keys].transpose(0, 1)[None]
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=attn_mask, scale=self.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(1, B, self.num_heads * self.head_dim))

    # -- fixed shapes and CUDA graphs -------------------------------------------------------------

    def _fixed_step(self, inputs: tuple[Tensor, Tensor, Tensor, Tensor], T: int) -> tuple[Tensor, Tensor]:
        """The step padded to its bucket over the whole capacity: eager, or its CUDA graph replayed."""
        if not self.cuda_graphs:
            logits, features = self._step(*inputs)
            return logits[:, :T], features[:, :T]
        B = inputs[0].shape[1]
        if B not in self._graphs:
            self._graphs[B] = self._capture(inputs)
        graph, static_in, (logits, features) = self._graphs[B]
        for dst, src in zip(static_in, inputs):
            dst.copy_(src)
        graph.replay()
        # Cloned: the next replay overwrites the graph's outputs.
        return logits[:, :T].clone(), features[:, :T].clone()

    def _capture(self, inputs: tuple[Tensor, ...]) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, Tensor]]:
        """Capture the step for this bucket. The warm-up runs write keys/values only at the step's own
        slots (entries not yet committed), which the replay then overwrites."""
        static_in = tuple(t.clone() for t in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(*static_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step(*static_in)
        return graph, static_in, out


TARGET_IMPLEMENTATIONS = ("auto", "fast", "hf")


def build_target(model: nn.Module, spec: CaptureSpec, implementation: str = "auto") -> Target:
    """The target the engine serves ``model`` with (``--target-impl``).

    - ``fast``: :class:`LlamaTarget` (fixed shapes and CUDA graphs on a GPU; refused, with the
      reason, for an architecture it does not implement);
    - ``hf``: :class:`~eyas.engine.target.HFTarget`, any causal LM;
    - ``auto``: ``fast`` on a GPU where it applies (that is where graphs pay), else ``hf``.
    The returned target's ``implementation`` says which one runs.
    """
    from eyas.engine.target import HFTarget

    impl = str(implementation).lower()
    if impl not in TARGET_IMPLEMENTATIONS:
        raise UnsupportedTarget(f"--target-impl: expected one of {list(TARGET_IMPLEMENTATIONS)}, found {implementation!r}")
    on_gpu = next(model.parameters()).device.type == "cuda"
    if impl == "hf" or (impl == "auto" and (not on_gpu or supports(model) is not None)):
        return HFTarget(model, spec)
    return LlamaTarget(model, spec, cuda_graphs=on_gpu)
