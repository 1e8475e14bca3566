"""A loaded target and the facts every command needs about it, computed once.

A :class:`LoadedTarget` holds the model (eval mode), its tokenizer and where it came from, plus what
each consumer used to recompute for itself: the text config, the number of decoder blocks L, the
hidden size H, the vocabulary V (the embedding's rows), the ids that end a turn, the device and the
dtype. Its :attr:`~LoadedTarget.identity` is what a contract records, and
:meth:`~LoadedTarget.misfits` says whether a drafter can read this target at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from eyas.targets.identity import TargetIdentity, target_identity
from eyas.targets.structure import eos_token_ids, find_decoder_blocks, find_embedding, text_config

if TYPE_CHECKING:  # loading.py builds LoadedTargets, so it imports this module
    from eyas.targets.loading import TargetSource


@dataclass(frozen=True, eq=False)
class LoadedTarget:
    """A target model ready to run, with its structure read once.

    Invariants: ``num_blocks`` = len(decoder blocks) = L, so boundaries are 0..L (eyas
    convention); ``hidden_size`` = the text config's H (the width of every boundary);
    ``vocab_size`` = the embedding's rows V (what a drafter's ``embed_tokens`` and ``t2d`` cover);
    ``device``/``dtype`` are those of the model's first parameter.
    """

    model: nn.Module  # an HF causal LM in eval mode
    tokenizer: Any  # None only for a model passed in without one
    source: TargetSource | None  # None for a model built in memory
    text_config: Any  # the text part of model.config
    num_blocks: int  # L
    hidden_size: int  # H
    vocab_size: int  # V: the embedding's rows
    eos_ids: tuple[int, ...]  # every id that ends a turn (tokenizer's and generation_config's), sorted
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Any = None, source: TargetSource | None = None) -> "LoadedTarget":
        """Wrap a model that is already loaded (tests, the doctor's ``model=`` argument); puts it in
        eval mode. Raises :class:`~eyas.targets.structure.ArchitectureError` when its decoder
        blocks or embedding cannot be located."""
        model.eval()
        param = next(model.parameters())
        cfg = text_config(model)
        return cls(
            model=model,
            tokenizer=tokenizer,
            source=source,
            text_config=cfg,
            num_blocks=len(find_decoder_blocks(model)),
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(find_embedding(model).weight.shape[0]),
            eos_ids=tuple(eos_token_ids(model, tokenizer)),
            device=param.device,
            dtype=param.dtype,
        )

    @classmethod
    def of(cls, target: "LoadedTarget | nn.Module", tokenizer: Any = None) -> "LoadedTarget":
        """``target`` itself when it is already a LoadedTarget (its cached identity kept), else
        :meth:`from_model` of it: what a function that accepts either works on."""
        return target if isinstance(target, LoadedTarget) else cls.from_model(target, tokenizer)

    @cached_property
    def identity(self) -> TargetIdentity:
        """What a contract records about this target (hashes the weights once, on first use)."""
        return target_identity(self.model, source=str(self.source) if self.source is not None else None)

    @property
    def name(self) -> str:
        """How reports name the target: its source, else its class."""
        return str(self.source) if self.source is not None else type(self.model).__name__

    def misfits(self, target_hidden_size: int, vocab_size: int, boundaries: Sequence[int] | None = None) -> list[str]:
        """Every reason a drafter cannot read this target at all, empty when it can.

        Plain values, so that packages below the drafter can ask: ``target_hidden_size`` is the width
        the drafter's ``fc`` expects per slot (must be H), ``vocab_size`` the target vocabulary its
        ``embed_tokens``/``t2d`` cover (must be V), ``boundaries`` the ones it would be served
        (each in 0..L). Each message names the field, what the drafter expects and what the target has.
        """
        out = []
        if boundaries is not None and list(boundaries) and not all(0 <= b <= self.num_blocks for b in boundaries):
            out.append(f"boundaries: {list(boundaries)} exceed the target's {self.num_blocks} blocks "
                       f"(expected each in 0..{self.num_blocks})")
        if target_hidden_size != self.hidden_size:
            out.append(f"target_hidden_size: the drafter reads {target_hidden_size}-wide target states, "
                       f"the target's are {self.hidden_size}")
        if vocab_size != self.vocab_size:
            out.append(f"vocab_size: the drafter's vocabulary has {vocab_size} ids, the target's {self.vocab_size}")
        return out
