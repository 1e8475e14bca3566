"""A toy target for end-to-end tests: a tiny random Llama with the SmolLM2 tokenizer (offline),
saved as a local HF directory, plus conversations whose answers the toy target wrote itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.support import DATA

GSM8K_TRAIN = DATA / "gsm8k" / "train.jsonl"  # the first 96 GSM8K training problems (tests/data/SOURCE.md)


def gsm8k_questions(n: int) -> list[str]:
    """The first ``n`` questions of the shipped GSM8K excerpt (the toy target's training prompts)."""
    with GSM8K_TRAIN.open() as f:
        questions = [json.loads(line)["question"] for line in f]
    if n > len(questions):
        raise ValueError(f"{GSM8K_TRAIN}: asked for {n} questions, the excerpt holds {len(questions)}; "
                         "cut a longer one with tests/data/make_excerpts.py")
    return questions[:n]


def make_toy_target(root: Path, num_blocks: int = 10, hidden: int = 64, seed: int = 0,
                    initializer_range: float = 0.06, sharpen: float = 10.0) -> Path:
    """Save a tiny Llama (vocab of SmolLM2's tokenizer) with that tokenizer into ``root``."""
    from eyas.targets import load_tokenizer

    tok = load_tokenizer("smollm2")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=num_blocks, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False, initializer_range=initializer_range,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Sharpen the output distribution (logit std ~0.5 -> ~5) like a trained LM's: the argmax,
        # and so greedy text, is unchanged, but the soft labels of TTT become informative.
        model.lm_head.weight.mul_(sharpen)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


@torch.no_grad()
def make_toy_conversations(target_dir: Path, out: Path, n: int = 48, answer_tokens: int = 24,
                           temperature: float = 0.0, seed: int = 0) -> Path:
    """Conversations whose assistant turns the toy target wrote itself (batched; greedy unless a
    temperature is given), as `eyas regenerate` would write them for a real target."""
    from eyas.targets import load_target

    loaded = load_target(str(target_dir))
    model, tok = loaded.model, loaded.tokenizer
    torch.manual_seed(seed)
    tok.padding_side = "left"
    rows = []
    questions = gsm8k_questions(n)
    for i in range(0, n, 16):
        batch = [[{"role": "user", "content": q}] for q in questions[i : i + 16]]
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
        gen = model.generate(**enc, max_new_tokens=answer_tokens, **sampling, pad_token_id=tok.pad_token_id)
        for m, g in zip(batch, gen[:, enc.input_ids.shape[1]:]):
            answer = tok.decode(g, skip_special_tokens=True)
            rows.append({"messages": m + [{"role": "assistant", "content": answer}]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def toy_train_config(toy: tuple[Path, Path], out: Path, **kw):
    """A short CPU training run on ``toy`` (target directory, conversations): the defaults the
    training tests share, then ``kw`` (which may replace any of them, ``data`` included)."""
    from eyas.training.config import TrainConfig

    target, data = toy
    base = dict(target=str(target), data=str(data), out=str(out), draft_vocab_size=1024, lr=3e-3, ttt_steps=3,
                val_fraction=0.2, eval_every=1000, save_every=1000, device="cpu")
    return TrainConfig(**(base | kw))


def reference_capture(root: Path, boundaries: list[int], num_blocks: int, hidden: int):
    """A toy target under ``root/t``, loaded, and eyas' own capture (float32 shards under
    ``root/ref``) of three short chat conversations at ``boundaries``: the reference that a
    converted dump of another engine must equal. Returns (target dir, LoadedTarget, ShardDataset)."""
    from eyas.data.conversation_files import read_conversations
    from eyas.data.shards import CaptureOptions, ShardDataset, capture_shards
    from eyas.targets import load_target

    target = make_toy_target(root / "t", num_blocks=num_blocks, hidden=hidden)
    loaded = load_target(str(target))
    convs = root / "c.jsonl"
    convs.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": a}]}) + "\n"
                             for q, a in [("What is 2+2?", "It is 4."), ("Name a colour.", "Blue, like the sky"),
                                          ("Hi", "Hello there, how can I help?")]))
    capture_shards(loaded.model, loaded.tokenizer, read_conversations(convs).conversations,
                   CaptureOptions(out_dir=root / "ref", boundaries=boundaries, dtype="float32", progress=False),
                   source=loaded.name)
    return target, loaded, ShardDataset(root / "ref")
