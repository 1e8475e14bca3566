"""Capture hooks: boundary b is HF ``output_hidden_states[b]`` for b < L, boundary L is the last
block's output before the final norm (docs/conventions.md), on tiny random models in float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eyas.capture import BoundaryCapture
from eyas.convention import CaptureSpec
from eyas.targets.structure import (
    ArchitectureError,
    find_decoder_blocks,
    find_embedding,
    find_final_norm,
    num_blocks,
)
from tests.support.tiny import tiny_config, tiny_model

pytestmark = pytest.mark.unit

KINDS = ["llama", "qwen2", "qwen3", "deepseek_v3"]
L = 10
_MODELS: dict[str, nn.Module] = {}


def model_of(kind: str) -> nn.Module:
    if kind not in _MODELS:
        _MODELS[kind] = tiny_model(kind, L)
    return _MODELS[kind]


def ids_for(batch: int = 2, T: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, T), generator=g)


@torch.no_grad()
def hf_hidden_states(model: nn.Module, input_ids: torch.Tensor, **kw) -> tuple[torch.Tensor, ...]:
    hs = model(input_ids, output_hidden_states=True, **kw).hidden_states
    assert len(hs) == L + 1
    return hs


def hook_ids(model: nn.Module) -> set[tuple[str, str, int]]:
    """Every forward (pre-)hook registered anywhere in the model. HF installs its own persistent
    output-recording hooks on the first ``output_hidden_states=True`` call, so tests compare sets."""
    out = set()
    for name, mod in model.named_modules():
        out |= {(name, "fwd", k) for k in mod._forward_hooks}
        out |= {(name, "pre", k) for k in mod._forward_pre_hooks}
    return out


# ---------------------------------------------------------------------------------------------
# locating the parts of the model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_find_parts(kind):
    m = model_of(kind)
    assert find_decoder_blocks(m) is m.model.layers
    assert num_blocks(m) == L
    assert find_final_norm(m) is m.model.norm
    assert find_embedding(m) is m.model.embed_tokens
    # the bare decoder (no LM head) works too
    assert find_decoder_blocks(m.model) is m.model.layers
    assert find_final_norm(m.model) is m.model.norm


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])  # same length as the blocks


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = tiny_config("llama", 3)
        self.rotary = nn.ModuleList([nn.Identity() for _ in range(3)])  # no parameters: not blocks
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Block() for _ in range(3)])


def test_find_blocks_not_fooled_by_other_lists_of_same_length():
    # Parameterless lists are skipped; nested lists of the same length (per-layer experts) lose
    # to the shallowest one.
    m = _Nested()
    assert find_decoder_blocks(m) is m.model.layers


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = tiny_config("llama", 3)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])  # 2 != 3
        self.norm = nn.LayerNorm(4)


def test_find_decoder_blocks_error_names_what_was_found():
    with pytest.raises(ArchitectureError) as e:
        find_decoder_blocks(_NoBlocks())
    msg = str(e.value)
    assert "_NoBlocks" in msg and "no ModuleList of 3 decoder blocks" in msg
    assert "('layers', 2)" in msg


def test_find_decoder_blocks_error_without_config():
    with pytest.raises(ArchitectureError, match="Sequential: no config.num_hidden_layers"):
        find_decoder_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_find_final_norm_error():
    class NoNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = tiny_config("llama", 2)

    with pytest.raises(ArchitectureError, match="NoNorm: no final norm found"):
        find_final_norm(NoNorm())


def test_spec_for_wrong_block_count():
    m = model_of("llama")
    with pytest.raises(ArchitectureError) as e:
        BoundaryCapture(m, CaptureSpec((2, 6, 9), 12))
    msg = str(e.value)
    assert "12 decoder blocks" in msg and "has 10" in msg and "LlamaForCausalLM" in msg


# ---------------------------------------------------------------------------------------------
# the values: exactly HF's hidden states
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_boundary_equals_hf_hidden_states(kind):
    m = model_of(kind)
    ids = ids_for()
    hs = hf_hidden_states(m, ids)
    # all boundaries at once ...
    spec = CaptureSpec(tuple(range(L + 1)), L)
    with torch.no_grad(), BoundaryCapture(m, spec) as cap:
        m(ids)
    for b in range(L):
        assert torch.equal(cap.boundary(b), hs[b]), f"{kind}: boundary {b} != output_hidden_states[{b}]"
    # ... and one boundary per capture (each hook alone)
    for b in range(L):
        with torch.no_grad(), BoundaryCapture(m, CaptureSpec((b,), L)) as one:
            m(ids)
        assert torch.equal(one.features(), hs[b]), f"{kind}: boundary {b} captured alone"


@pytest.mark.parametrize("kind", KINDS)
def test_last_boundary_is_pre_norm(kind):
    m = model_of(kind)
    ids = ids_for()
    hs = hf_hidden_states(m, ids)
    with torch.no_grad(), BoundaryCapture(m, CaptureSpec((2, 5, 7), L), include_last=True) as cap:
        m(ids)
    last = cap.last_hidden()
    assert torch.equal(last, cap.boundary(L))
    # The same norm module on the same tensor: HF's last entry is exactly norm(boundary L).
    assert torch.equal(find_final_norm(m)(last), hs[L])
    # ... and boundary L itself is not HF's post-norm last entry.
    assert not torch.allclose(last, hs[L], atol=1e-3)
    # boundary L can also be a slot
    with torch.no_grad(), BoundaryCapture(m, CaptureSpec((L, 0), L)) as cap2:
        m(ids)
    assert torch.equal(cap2.slots()[0], last)
    assert torch.equal(cap2.slots()[1], hs[0])


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_features_keep_spec_order(kind):
    m = model_of(kind)
    ids = ids_for()
    hs = hf_hidden_states(m, ids)
    spec = CaptureSpec((5, 0, 9), L)
    with torch.no_grad(), BoundaryCapture(m, spec) as cap:
        m(ids)
    slots = cap.slots()
    assert len(slots) == 3
    for s, b in zip(slots, (5, 0, 9)):
        assert torch.equal(s, hs[b])
    feats = cap.features()
    H = m.config.hidden_size
    assert feats.shape == (2, 9, 3 * H)
    assert torch.equal(feats, torch.cat([hs[5], hs[0], hs[9]], dim=-1))
    assert not torch.equal(feats, torch.cat([hs[0], hs[5], hs[9]], dim=-1))


def test_default_spec_features():
    m = model_of("qwen3")
    ids = ids_for()
    hs = hf_hidden_states(m, ids)
    spec = CaptureSpec.default(L)  # [2, 5, 7]
    with torch.no_grad(), BoundaryCapture(m, spec) as cap:
        m(ids)
    assert torch.equal(cap.features(), torch.cat([hs[2], hs[5], hs[7]], dim=-1))


def test_uncaptured_boundary_raises():
    m = model_of("llama")
    with torch.no_grad(), BoundaryCapture(m, CaptureSpec((2, 5, 7), L)) as cap:
        m(ids_for())
    with pytest.raises(KeyError, match=r"boundary 3 was not captured \(captured: \[2, 5, 7\]\)"):
        cap.boundary(3)
    with pytest.raises(KeyError, match="boundary 10"):
        cap.last_hidden()  # include_last was not set
    cap.clear()
    with pytest.raises(KeyError):
        cap.features()


# ---------------------------------------------------------------------------------------------
# hook lifetime
# ---------------------------------------------------------------------------------------------


def test_hooks_removed_after_with_block():
    m = model_of("llama")
    hf_hidden_states(m, ids_for())  # let HF install its own persistent hooks first
    before = hook_ids(m)
    spec = CaptureSpec((0, 3, 10), L)
    with torch.no_grad(), BoundaryCapture(m, spec, include_last=True) as cap:
        inside = hook_ids(m)
        assert len(inside - before) == 3  # one pre-hook on block 0, forward hooks on blocks 2 and 9
        m(ids_for(seed=1))
    assert hook_ids(m) == before
    stored = {b: cap.boundary(b).clone() for b in (0, 3, 10)}
    with torch.no_grad():
        m(ids_for(seed=2))  # a different input after the block
    for b, t in stored.items():
        assert torch.equal(cap.boundary(b), t)


def test_hooks_removed_on_exception():
    m = model_of("qwen2")
    before = hook_ids(m)
    with pytest.raises(RuntimeError, match="boom"):
        with BoundaryCapture(m, CaptureSpec((0, 4), L)):
            raise RuntimeError("boom")
    assert hook_ids(m) == before


def test_capture_object_is_reusable():
    m = model_of("llama")
    ids1, ids2 = ids_for(seed=3), ids_for(seed=4)
    hs2 = hf_hidden_states(m, ids2)
    cap = BoundaryCapture(m, CaptureSpec((1, 4), L))
    with torch.no_grad(), cap:
        m(ids1)
    with torch.no_grad(), cap:
        m(ids2)
    assert torch.equal(cap.features(), torch.cat([hs2[1], hs2[4]], dim=-1))


def test_detach_flag():
    m = model_of("llama")
    spec = CaptureSpec((0, 4), L)
    with BoundaryCapture(m, spec) as cap:
        m(ids_for())
    assert all(not t.requires_grad for t in cap.slots())
    with BoundaryCapture(m, spec, detach=False) as cap:
        out = m(ids_for())
    assert all(t.requires_grad for t in cap.slots())
    cap.boundary(4).sum().backward()  # the graph reaches the embedding
    assert m.model.embed_tokens.weight.grad is not None
    m.zero_grad(set_to_none=True)
    del out


# ---------------------------------------------------------------------------------------------
# batches, padding, embeddings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_batch_with_left_padding(kind):
    m = model_of(kind)
    g = torch.Generator().manual_seed(7)
    long_seq, short_seq = torch.randint(1, 128, (9,), generator=g), torch.randint(1, 128, (5,), generator=g)
    ids = torch.zeros(3, 9, dtype=torch.long)
    ids[0], ids[1, 4:], ids[2, 2:7] = long_seq, short_seq, long_seq[:5]
    mask = torch.zeros(3, 9, dtype=torch.long)
    mask[0], mask[1, 4:], mask[2, 2:7] = 1, 1, 1  # row 2: left AND right padding
    hs = hf_hidden_states(m, ids, attention_mask=mask)
    spec = CaptureSpec((0, 2, 5, L), L)
    with torch.no_grad(), BoundaryCapture(m, spec) as cap:
        m(ids, attention_mask=mask)
    for b in (0, 2, 5):
        assert cap.boundary(b).shape == (3, 9, m.config.hidden_size)
        assert torch.equal(cap.boundary(b), hs[b])
    assert torch.equal(find_final_norm(m)(cap.boundary(L)), hs[L])
    # Real tokens of a padded row equal the same sequence run alone. Not bit-exact: the padded
    # attention reduces over a different key length, which changes float32 summation order.
    for row, seq, sl in ((1, short_seq, slice(4, 9)), (2, long_seq[:5], slice(2, 7))):
        with torch.no_grad(), BoundaryCapture(m, spec) as alone:
            m(seq[None])
        for b in (0, 2, 5, L):
            torch.testing.assert_close(cap.boundary(b)[row, sl], alone.boundary(b)[0], atol=1e-5, rtol=1e-5)


def test_inputs_embeds_scaled_before_the_blocks():
    """A model that scales its embeddings in its forward (before block 0): boundary 0 is the
    scaled input of block 0, not the embedding module's output."""
    m = model_of("llama")
    ids = ids_for()
    embeds = m.model.embed_tokens(ids).detach() * 8.0
    with torch.no_grad():
        hs = m(inputs_embeds=embeds, output_hidden_states=True).hidden_states
    with torch.no_grad(), BoundaryCapture(m, CaptureSpec((0, 3), L)) as cap:
        m(inputs_embeds=embeds)
    assert torch.equal(cap.boundary(0), embeds)
    assert torch.equal(cap.boundary(0), hs[0])
    assert torch.equal(cap.boundary(3), hs[3])


GEMMAS = ["gemma", "gemma2", "gemma3_text"]


def _tiny_gemma(kind: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        kind, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=6, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", GEMMAS)
def test_gemma_scaled_embeddings(kind):
    """Gemma multiplies the embeddings by sqrt(hidden_size) before block 0; boundary 0 is HF's
    hidden_states[0], taken after that scaling."""
    m = _tiny_gemma(kind)
    n = 6
    ids = ids_for()
    with torch.no_grad():
        hs = m(ids, output_hidden_states=True).hidden_states
    with torch.no_grad(), BoundaryCapture(m, CaptureSpec(tuple(range(n + 1)), n)) as cap:
        m(ids)
    for b in range(n):
        assert torch.equal(cap.boundary(b), hs[b]), f"{kind}: boundary {b}"
    assert torch.equal(find_final_norm(m)(cap.boundary(n)), hs[n])
    raw = m.get_input_embeddings().weight[ids].detach()
    torch.testing.assert_close(cap.boundary(0), raw * 64**0.5)
    assert not torch.allclose(cap.boundary(0), raw)
