"""What the two resumable data runs, :func:`eyas.data.regenerate.regenerate` and
:func:`eyas.data.shards.capture_shards`, share.

- :class:`RunOptions`: the base of their option objects. Flat and typed like
  :class:`eyas.training.config.TrainConfig`; an unknown name is refused; a value that does not
  validate raises the run's own error class (an :class:`eyas.errors.EyasError`, so the CLI prints
  it as one line) naming the field, the value expected and the value found.
- :class:`Throughput`: the ``tokens_per_s`` and ``to_dict`` of their typed summaries.
- :func:`eval_mode`: the target in eval mode for the run, its own mode restored afterwards.
- :func:`changed_params`: what a resume compares, said field by field.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ClassVar, Iterable, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

from eyas.errors import EyasError


def _describe(options: type[BaseModel], error: ValidationError) -> str:
    """One clause per invalid field: ``<field>: expected <what>, found <value>``."""
    clauses = []
    for e in error.errors():
        field = ".".join(str(x) for x in e["loc"]) or "(options)"
        if e["type"] == "missing":
            clauses.append(f"{field}: expected a value, found none")
            continue
        if e["type"] == "extra_forbidden":
            expected = f"one of {', '.join(options.model_fields)} (no option {field})"
        else:
            # Our validators say "expected ..." (pydantic prefixes "Value error, "); pydantic's own
            # checks say "Input should be ...".
            expected = e["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
            expected = expected.removeprefix("expected ")
        clauses.append(f"{field}: expected {expected}, found {e.get('input')!r}")
    return f"{options.__name__}: " + "; ".join(clauses)


class RunOptions(BaseModel):
    """Base of a data run's options; subclasses set ``error``, the EyasError their run raises.

    Invariant: an instance exists only with valid values (construction validates); an invalid value
    raises ``error`` naming the field, expected and found, never a bare pydantic ValidationError
    (which the CLI would show as a traceback)."""

    model_config = ConfigDict(extra="forbid")
    error: ClassVar[type[EyasError]] = EyasError

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise type(self).error(_describe(type(self), e)) from None


class Throughput:
    """Mixin for a run's summary dataclass: ``wall_s`` and a count of tokens this run produced
    (``rated_tokens``) give ``tokens_per_s``; ``to_dict`` is the summary's JSON for the CLI, its
    fields in declaration order and then ``tokens_per_s``."""

    wall_s: float

    @property
    def rated_tokens(self) -> int:
        raise NotImplementedError

    @property
    def tokens_per_s(self) -> float:
        return self.rated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        return d


@contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """``model`` in eval mode inside the block (no dropout: what is captured or generated is what
    serving computes); the mode it had is restored on the way out, also after an error."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def changed_params(recorded: Mapping[str, Any], now: Mapping[str, Any], names: Iterable[str],
                   recorded_as: str) -> list[str]:
    """``<name>: <recorded_as> <old>, now <new>`` for each of ``names`` whose value differs between
    the earlier run's record and this run (an empty list: the run may resume)."""
    return [f"{k}: {recorded_as} {recorded.get(k)!r}, now {now[k]!r}" for k in names if recorded.get(k) != now[k]]
