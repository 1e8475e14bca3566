"""``eyas serve``'s load options as one picklable value, in a module without torch: the engine
process receives it before the HTTP side has imported anything heavy
(:mod:`eyas.serve.engine_process`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from eyas.serve.startup import Served


@dataclass(frozen=True)
class LoadArgs:
    """:func:`load_served`'s arguments, which an engine process loads with (picklable)."""

    target: str
    draft: str | None
    tree: str = "5"
    tree_sampled: str | None = None
    force: bool = False
    device: str = "auto"
    target_impl: str = "auto"
    matvec: str = "auto"
    attention: str = "auto"
    model_name: str | None = None

    def load(self, log: Callable[[str], None] = lambda m: None) -> "Served":
        from eyas.serve.startup import load_served

        return load_served(self.target, self.draft, tree=self.tree, tree_sampled=self.tree_sampled, force=self.force,
                           device=self.device, target_impl=self.target_impl, matvec=self.matvec,
                           attention=self.attention, model_name=self.model_name, log=log)
