"""The serving engines eyas knows, by name: ``SERVERS["sglang"]``, :func:`names`, :func:`get`.

Adding an engine is one module defining a :class:`~eyas.interop.servers.spec.ServerSpec` and one
:func:`register` call (here, or from the module that defines it). The CLI's ``--engine`` and
``--to`` choices, the all-engines view of ``eyas info`` and the doctor's comparison of every
engine all come from this registry.
"""

from __future__ import annotations

from eyas.interop.servers.eyas import EYAS
from eyas.interop.servers.sglang import SGLANG
from eyas.interop.servers.spec import ServerError, ServerSpec
from eyas.interop.servers.vllm import VLLM

SERVERS: dict[str, ServerSpec] = {}


def register(spec: ServerSpec) -> ServerSpec:
    """Add ``spec`` under its name (replacing one of the same name); returns it."""
    SERVERS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    SERVERS.pop(name, None)


for _spec in (EYAS, SGLANG, VLLM):
    register(_spec)


def names() -> list[str]:
    """Every engine name, in registry order (eyas first)."""
    return list(SERVERS)


def export_names() -> list[str]:
    """The names ``eyas export --to`` accepts (an engine may answer to several, e.g. vllm, speculators)."""
    return [n for spec in SERVERS.values() for n in spec.export_names]


def get(name: str) -> ServerSpec:
    spec = SERVERS.get(str(name).lower())
    if spec is None:
        raise ServerError(f"--engine: expected one of {names()}, found {name!r}")
    return spec


def for_export(name: str) -> ServerSpec | None:
    """The engine that ``eyas export --to NAME`` writes for (None when no engine answers to it)."""
    return next((s for s in SERVERS.values() if str(name).lower() in s.export_names), None)


def for_layout(layout: str) -> ServerSpec:
    """The engine whose native directory layout is ``layout`` ("sglang" | "speculators")."""
    spec = next((s for s in SERVERS.values() if s.layout == layout), None)
    if spec is None:
        raise ServerError(f"layout: expected one of {[s.layout for s in SERVERS.values() if s.layout]}, found {layout!r}")
    return spec


def readings() -> list[tuple[ServerSpec, str | None]]:
    """Every (engine, id rule) pair, in registry order: what "every engine" means in a view."""
    return [(spec, rule) for spec in SERVERS.values() for rule in (spec.rules or (None,))]
