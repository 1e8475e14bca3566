"""The token sequences the doctor evaluates on, and what was stored with them.

``--data`` is a shard directory (the drafter's own training samples, with their stored hidden
states) or a conversations file (rendered with the target's chat template, answered by the target
where a conversation has no assistant turn). Without ``--data`` the run's ``train_config.json``
names the training data when it is still there; otherwise the target answers a few built-in
prompts (no replay is possible then: there are no stored samples).

When the drafter directory carries ``train_config.json`` whose data is the data given here, the
samples are the run's held-out split (exactly the samples behind ``contract.metrics``); otherwise
an evenly spaced subset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from pydantic import ValidationError
from torch import Tensor

from eyas.contract.contract import Contract
from eyas.data.shard_format import is_shard_dir
from eyas.data.render import NO_SYSTEM_PROMPT, TEMPLATE_DEFAULT, TemplateAlignmentError, render, render_prompt
from eyas.interop.directory import TRAIN_CONFIG, DrafterDir

BUILTIN_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when it is a bad choice.",
    "A train leaves at 3pm travelling 60 km/h; another leaves at 4pm at 90 km/h. When does the second catch up?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Summarise the causes of the French Revolution in five bullet points.",
    "What are the health benefits of regular exercise?",
    "Translate 'The weather is lovely today, shall we go for a walk?' into French and explain the grammar.",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "What is the difference between TCP and UDP?",
    "Write a haiku about autumn leaves.",
    "How do vaccines train the immune system?",
    "Compose a polite email declining a meeting invitation.",
    "Explain recursion to a beginner programmer with an example.",
    "List the planets of the solar system with one fact about each.",
    "What should I consider when adopting a dog?",
    "Describe the water cycle.",
)
MAX_RENDER_FOR_SPLIT = 20000  # reproducing a held-out split renders every conversation; above this, don't


@dataclass
class Sample:
    id: str
    input_ids: Tensor  # [T] long
    loss_mask: Tensor  # [T] long, 1 = assistant token (not shifted)
    features: Tensor | None = None  # [T, S * H] stored slots, concatenated in slot order (shards)
    last_hidden: Tensor | None = None  # [T, H] stored boundary L (shards)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class SampleSet:
    samples: list[Sample]
    source: str  # shards | conversations | generated
    path: str | None
    selection: str
    held_out: bool = False
    # The run's train_config.json names other training data than these samples: accuracy here is
    # measured on another distribution, so the accuracy recorded at training is no reference for it.
    other_data: bool = False
    manifest_contract: Contract | None = None  # shards: the manifest's contract
    stored_boundaries: list[int] | None = None
    stored_dtype: str | None = None
    last_hidden_normed: bool = False  # shards imported from SpecForge: last_hidden is the final norm's output
    notes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "path": self.path, "samples": len(self.samples), "tokens": self.num_tokens,
                "selection": self.selection, "held_out": self.held_out, "other_data": self.other_data,
                "stored_boundaries": self.stored_boundaries,
                "stored_dtype": self.stored_dtype, "notes": self.notes}


def evenly(indices: Sequence[int], n: int) -> list[int]:
    """At most ``n`` of ``indices``, evenly spaced (shards store samples longest first: a prefix
    would be biased)."""
    idx = list(indices)
    if len(idx) <= n:
        return idx
    return [idx[round(i * (len(idx) - 1) / (n - 1))] for i in range(n)] if n > 1 else idx[:1]


def _other_data(train_config: Any, path: str) -> bool:
    """The training run's config names its data, and it is not ``path``."""
    return train_config is not None and bool(train_config.data) and not _same_path(train_config.data, path)


def _same_path(a: str | Path | None, b: str | Path | None) -> bool:
    if not a or not b:
        return False
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def system_prompt_mode(contract: Contract | None) -> tuple[str, str | None]:
    """The system prompt argument for rendering, from the contract; and a note when it cannot be honoured."""
    mode = contract.tokenisation.system_prompt if contract is not None and contract.tokenisation else TEMPLATE_DEFAULT
    if mode in (TEMPLATE_DEFAULT, NO_SYSTEM_PROMPT):
        return mode, None
    return TEMPLATE_DEFAULT, ("the drafter was trained with a custom system prompt whose text the contract does "
                              "not record; conversations are rendered with the template's default")


def _truncate(s: Sample, max_length: int) -> Sample:
    if s.length <= max_length:
        return s
    m = max_length
    return Sample(s.id, s.input_ids[:m], s.loss_mask[:m],
                  None if s.features is None else s.features[:m], None if s.last_hidden is None else s.last_hidden[:m])


def _from_shards(path: str, train_config: Any, n: int, max_length: int) -> SampleSet:
    from eyas.data.shard_dataset import ShardDataset

    ds = ShardDataset(path, features=True, verify="header")
    held_out = train_config is not None and _same_path(train_config.data, path)
    if held_out:
        from eyas.training.config import split_indices

        _, pool = split_indices(len(ds), train_config)
        selection = f"held-out split of the training run ({len(pool)} samples of {len(ds)})"
    else:
        pool = list(range(len(ds)))
        selection = f"evenly spaced samples of {len(ds)} (may include training samples)"
    picked = evenly(pool, n)
    if len(picked) < len(pool):
        selection += f", {len(picked)} of them"
    samples = []
    for i in picked:
        item = ds[i]
        samples.append(_truncate(Sample(str(item["id"]), item["input_ids"].long(), item["loss_mask"].long(),
                                        item["features"].float(), item["last_hidden"]), max_length))
    params = ds.manifest.get("params", {})
    return SampleSet(samples, "shards", str(path), selection, held_out, _other_data(train_config, path), ds.contract,
                     list(ds.contract.capture.boundaries), params.get("dtype", ds.contract.capture.dtype),
                     last_hidden_normed=ds.last_hidden_normed)


@torch.no_grad()
def answer(model: Any, tokenizer: Any, prompts: list[Tensor], max_new_tokens: int, batch_size: int = 16) -> list[Tensor]:
    """Greedy answers of the target (left-padded batches of ``batch_size``: on a CPU the decode
    steps, not the batch, set the time); each ends at (and keeps) its EOS."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    device = next(model.parameters()).device
    out: list[Tensor] = []
    for b0 in range(0, len(prompts), batch_size):
        batch = prompts[b0:b0 + batch_size]
        T = max(p.shape[0] for p in batch)
        ids = torch.full((len(batch), T), pad, dtype=torch.long)
        attn = torch.zeros(len(batch), T, dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, T - p.shape[0]:] = p
            attn[r, T - p.shape[0]:] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=eos)
        for g in gen[:, T:].cpu():
            stop = (g == eos).nonzero()
            out.append(g[: int(stop[0]) + 1] if len(stop) else g)
    return out


def _answered(model: Any, tokenizer: Any, prompts: list[tuple[str, Tensor]], max_new_tokens: int) -> list[Sample]:
    answers = answer(model, tokenizer, [p for _, p in prompts], max_new_tokens)
    return [Sample(i, torch.cat([p, a]), torch.cat([torch.zeros_like(p), torch.ones_like(a)]))
            for (i, p), a in zip(prompts, answers) if a.numel() > 0]


def _from_conversations(path: str, model: Any, tokenizer: Any, train_config: Any, n: int, max_length: int,
                        mode: str, max_new_tokens: int) -> SampleSet:
    from eyas.data.conversations import Conversation
    from eyas.data.conversation_files import read_conversations

    result = read_conversations(path, on_error="skip")
    convs = result.conversations
    notes = [f"{path}: {len(result.problems)} unreadable records skipped"] if result.problems else []
    held_out = (train_config is not None and _same_path(train_config.data, path) and len(convs) <= MAX_RENDER_FOR_SPLIT)
    samples: list[Sample] = []
    if held_out:
        # Exactly the training run's filtering (eyas.training.loop.load_samples), then its split.
        from eyas.training.config import split_indices

        kept = []
        for k, conv in enumerate(convs):
            try:
                r = render(conv, tokenizer, max_length=train_config.max_length, system_prompt=train_config.system_prompt)
            except TemplateAlignmentError:
                continue
            if r.num_assistant_tokens > 0:
                kept.append((k, r))
        _, pool = split_indices(len(kept), train_config)
        picked = evenly(pool, n)
        samples = [_truncate(Sample(f"#{kept[j][0]}", kept[j][1].input_ids.long(), kept[j][1].loss_mask.long()), max_length)
                   for j in picked]
        selection = f"held-out split of the training run ({len(pool)} of {len(kept)} conversations)"
        if len(picked) < len(pool):
            selection += f", {len(picked)} of them"
        return SampleSet(samples, "conversations", str(path), selection, True, notes=notes)
    picked = evenly(range(len(convs)), n)
    to_answer: list[tuple[str, Tensor]] = []
    for k in picked:
        conv = convs[k]
        try:
            r = render(conv, tokenizer, max_length=max_length, system_prompt=mode)
        except TemplateAlignmentError as e:
            notes.append(f"conversation #{k} skipped: {e}")
            continue
        if r.num_assistant_tokens > 0:
            samples.append(Sample(f"#{k}", r.input_ids.long(), r.loss_mask.long()))
        else:  # a prompt file: the target answers its first user turn
            first_user = next(m for m in conv.messages if m["role"] == "user")
            to_answer.append((f"#{k}", render_prompt(Conversation([first_user]), tokenizer, system_prompt=mode)))
    if to_answer:
        samples += [_truncate(s, max_length) for s in _answered(model, tokenizer, to_answer, max_new_tokens)]
        notes.append(f"{len(to_answer)} conversations without an assistant turn were answered by the target (greedy)")
    selection = f"evenly spaced conversations of {len(convs)}" + (f", {len(picked)} of them" if len(picked) < len(convs) else "")
    return SampleSet(samples, "conversations", str(path), selection, False, _other_data(train_config, path), notes=notes)


def _generated(model: Any, tokenizer: Any, n: int, mode: str, max_new_tokens: int) -> SampleSet:
    from eyas.data.conversations import Conversation

    prompts = [(f"builtin-{i}", render_prompt(Conversation([{"role": "user", "content": p}]), tokenizer, system_prompt=mode))
               for i, p in enumerate(BUILTIN_PROMPTS[: max(1, min(n, len(BUILTIN_PROMPTS)))])]
    samples = _answered(model, tokenizer, prompts, max_new_tokens)
    return SampleSet(samples, "generated", None,
                     f"{len(samples)} built-in prompts answered by the target (greedy, {max_new_tokens} new tokens)",
                     notes=["no --data and no training data on record: the target answers built-in prompts; replay "
                            "runs the trained protocol on them (there are no stored training samples) and, on other "
                            "text than training's, is not held against the accuracy recorded at training"])


def training_config(dd: DrafterDir) -> Any | None:
    """The drafter run's ``train_config.json`` as a TrainConfig (None when there is none); one that
    does not validate is a problem of the directory, reported by the static stage."""
    if dd.train_config_json is None:
        return None
    from eyas.training.config import TrainConfig

    try:
        return TrainConfig.model_validate(dd.train_config_json)
    except ValidationError:
        dd.problems.append(f"{dd.path / TRAIN_CONFIG}: unreadable; the held-out split of the training run cannot "
                           f"be reproduced")
        return None


def load_samples(data: str | None, model: Any, tokenizer: Any, contract: Contract | None, train_config: Any,
                 n: int = 32, max_length: int = 512, max_new_tokens: int = 64) -> SampleSet:
    mode, note = system_prompt_mode(contract)
    notes = [note] if note else []
    if data is None and train_config is not None and train_config.data and Path(train_config.data).exists():
        data = train_config.data
        notes.append(f"no --data: using the training data named in train_config.json ({data})")
    if data is None:
        out = _generated(model, tokenizer, n, mode, max_new_tokens)
    elif is_shard_dir(data):
        out = _from_shards(data, train_config, n, max_length)
    elif Path(data).is_file():
        out = _from_conversations(data, model, tokenizer, train_config, n, max_length, mode, max_new_tokens)
    else:
        raise FileNotFoundError(f"--data {data}: expected a shard directory (with manifest.json) or a conversations file")
    out.notes = notes + out.notes
    if not out.samples:
        raise ValueError(f"--data {data}: no usable samples (no assistant tokens after rendering)")
    return out
