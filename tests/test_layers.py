"""The package layers: every package of eyas imports only packages on a lower floor.

The floors, from the ground up (a package may import any package on a lower floor, none on its own
floor or above):

    0  errors, io                   the error base, crash-safe file writes
    1  convention                   boundaries 0..L and the capture spec
    2  targets                      --target resolution and loading, the model's structure
    3  contract                     the contract and its checks
    4  capture                      the one capture code path, slot fingerprints
    5  drafter                      the EAGLE-3 drafter, its config, training-time test
    6  data, interop                conversations, shards, regeneration; checkpoint formats, engines
    7  training, engine             the training loop; the serving runtime
    8  tune                         --tree auto
    9  doctor, bench                diagnosis; benchmarks
    10 watch                        the acceptance verdict; reading SGLang's and vLLM's metrics
    11 serve                        the OpenAI-compatible server (engine, doctor's static stage, watch's verdict)
    12 cli                          the eyas command

The check reads the import statements of every module (lazy imports inside functions included), so
an upward arrow fails here before it becomes a cycle. It also refuses imports of another module's
private names (``from eyas.x import _y``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import eyas

pytestmark = pytest.mark.unit

FLOORS: dict[str, int] = {
    "errors": 0, "io": 0,
    "convention": 1,
    "targets": 2,
    "contract": 3,
    "capture": 4,
    "drafter": 5,
    "data": 6, "interop": 6,
    "training": 7, "engine": 7,
    "tune": 8,
    "doctor": 9, "bench": 9,
    "watch": 10,
    "serve": 11,
    "cli": 12,
}
SRC = Path(eyas.__file__).resolve().parent


def _package_of(path: Path, root: Path) -> str | None:
    """The top-level package (or module) of ``root`` that ``path`` belongs to; None for the root's
    own ``__init__.py`` (which only holds the version)."""
    rel = path.relative_to(root)
    if len(rel.parts) == 1:
        return None if rel.stem == "__init__" else rel.stem
    return rel.parts[0]


def import_violations(root: Path, floors: dict[str, int]) -> list[str]:
    """Every import in the package at ``root`` that points to a package on the same or a higher
    floor, imports a private name, or comes from a package missing from ``floors``."""
    name = root.name
    problems = []
    for path in sorted(root.rglob("*.py")):
        src = _package_of(path, root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            parts = node.module.split(".")
            if parts[0] != name:
                continue
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            private += [p for p in parts[1:] if p.startswith("_") and not p.startswith("__")]
            if private:
                problems.append(f"{where}: imports private {private} from {node.module}")
            dst = parts[1] if len(parts) > 1 else None
            if src is None or dst is None or dst == src:
                continue
            for pkg in (src, dst):
                if pkg not in floors:
                    problems.append(f"{where}: package {pkg!r} has no floor in the layer table")
            if src in floors and dst in floors and floors[dst] >= floors[src]:
                problems.append(f"{where}: {src} (floor {floors[src]}) imports {node.module} "
                                f"({dst}, floor {floors[dst]}): only lower floors may be imported")
    return problems


def test_every_package_imports_only_lower_floors():
    problems = import_violations(SRC, FLOORS)
    assert not problems, "upward or sideways imports:\n" + "\n".join(problems)


def test_every_package_has_a_floor():
    packages = {_package_of(p, SRC) for p in SRC.rglob("*.py")} - {None}
    assert packages == set(FLOORS), f"packages without a floor: {packages - set(FLOORS)}; stale: {set(FLOORS) - packages}"


def _write(root: Path, rel: str, text: str) -> None:
    f = root / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)


def test_the_check_catches_an_upward_a_sideways_and_a_private_import(tmp_path):
    root = tmp_path / "eyas"
    _write(root, "__init__.py", "")
    _write(root, "convention/__init__.py", "")
    _write(root, "convention/boundaries.py", "def f():\n    from eyas.engine.speculative import g\n")  # upward, lazy
    _write(root, "engine/speculative.py", "from eyas.training.loop import Tally\n")  # sideways
    _write(root, "training/loop.py", "from eyas.convention.boundaries import _hidden\n")  # private
    _write(root, "doctor/run.py", "from eyas.convention import boundaries\n")  # fine
    problems = import_violations(root, FLOORS)
    assert len(problems) == 3, problems
    assert "eyas/convention/boundaries.py:2: convention (floor 1) imports eyas.engine.speculative" in problems[0]
    assert "engine (floor 7) imports eyas.training.loop (training, floor 7)" in problems[1]
    assert "imports private ['_hidden']" in problems[2]
