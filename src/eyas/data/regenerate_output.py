"""The files of a regeneration and their resume (step 2 and 4 of
:func:`eyas.data.regenerate.regenerate`): crash-safe JSON Lines (:func:`read_resumable_jsonl` cuts
a torn last line off), the output and its ``.skipped.jsonl`` sidecar (:class:`OutputFiles`), and the
refusal to resume a file written with other generation parameters.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from eyas.data.regenerate_options import GenerationParams, RegenerateError
from eyas.data.runs import changed_params


# ---------------------------------------------------------------------------------------------
# Ids and resumable JSONL files
# ---------------------------------------------------------------------------------------------


def read_resumable_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file that a crash may have left with a torn last line.

    The torn tail (bytes after the last newline) is cut off the file itself, so the next append
    starts on a fresh line. A bad line anywhere else is real corruption: error naming file and line.
    Lines end at b"\n" only: the records are written with ensure_ascii=False, so an answer may hold
    U+2028, U+0085 or a form feed raw, which str.splitlines() would take for line ends (an H200
    regeneration of 43k answers was refused as corrupt at its line 11,664 that way).
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
    if cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
    records = []
    for n, raw in enumerate(data[:cut].split(b"\n"), start=1):
        line = raw.decode("utf-8")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise RegenerateError(f"{path}:{n}: not valid JSON ({e.msg}); the file is corrupt, "
                                  f"not just torn at the end: fix or remove it") from None
        if not isinstance(rec, dict) or "id" not in rec:
            raise RegenerateError(f"{path}:{n}: expected an object with an 'id', found {line[:80]!r}")
        records.append(rec)
    return records


def _append_lines(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append records as JSON lines in one write, then flush and fsync (crash-safe up to a torn
    last line, which :func:`read_resumable_jsonl` repairs)."""
    if not records:
        return
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# The output and its sidecar
# ---------------------------------------------------------------------------------------------


def _check_generation(output: Path, existing: list[dict[str, Any]], generations: dict[float, GenerationParams]) -> None:
    """Refuse an output written with other generation parameters (RegenerateError naming the file,
    each differing field, what the file has and what this run has).

    Every record is compared with this run's parameters *for its own temperature*; a record at a
    temperature this run does not use is refused too. A temperature with no record yet is fine (its
    answers are added). Records from before ``loops`` / ``sort_by_length`` existed are read as
    :attr:`GenerationParams.LEGACY`; a legacy file of sampled answers cannot be resumed at all (its
    sampled answers carry the plain conversation id and another seed rule)."""
    now = {t: g.model_dump() for t, g in generations.items()}
    temps = ", ".join(f"{t:g}" for t in now)
    seen: set[str] = set()
    for rec in existing:
        theirs = (rec.get("provenance") or {}).get("generation")
        if not isinstance(theirs, dict):
            continue
        key = json.dumps(theirs, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        legacy = [k for k in GenerationParams.LEGACY if k not in theirs]
        theirs = {**{k: GenerationParams.LEGACY[k] for k in legacy}, **theirs}
        t = theirs.get("temperature", 0.0)
        if legacy and theirs.get("do_sample"):
            raise RegenerateError(
                f"{output}: record {rec['id']!r} is a sampled answer written before eyas recorded "
                f"{' and '.join(legacy)} (expected a generation with them, found none): its id and seed "
                f"follow an older rule, so it cannot be resumed; write to a new file")
        if t not in now:
            raise RegenerateError(
                f"{output}: record {rec['id']!r} was answered at temperature {t:g}; expected one of this "
                f"run's temperatures ({temps}): resume with the same temperatures or write to a new file")
        changed = changed_params(theirs, now[t], now[t], "file has")
        if changed:
            hint = ""
            if legacy:
                hint = (f" (the file was written before eyas recorded {' and '.join(legacy)}: its answers were not "
                        f"cut at loops and its chunks are in input order; resume it with --loops keep "
                        f"--no-sort-by-length)")
            raise RegenerateError(
                f"{output}: written with other generation parameters at temperature {t:g} "
                f"({', '.join(changed)}){hint}; resume with the same parameters or write to a new file")


@dataclass
class OutputFiles:
    """The output JSONL and its ``.skipped.jsonl`` sidecar, and the ids each already holds.

    Invariant: an id is appended at most once to each file (resume never duplicates); a unit's
    sidecar lines are appended before its output lines, so a crash between the two leaves the
    unit incomplete in the output, and the rerun generates it again."""

    output: Path
    sidecar: Path
    written: set[str]  # ids in the output
    failed: set[str]  # ids in the sidecar

    @classmethod
    def resume(cls, output: Path, generations: dict[float, GenerationParams]) -> "OutputFiles":
        """Step 2, resume: read what an earlier run wrote (a torn last line is cut off); refuse an
        output written with other generation parameters (:func:`_check_generation`)."""
        existing = read_resumable_jsonl(output)
        _check_generation(output, existing, generations)
        sidecar = output.with_name(output.name + ".skipped.jsonl")
        return cls(output, sidecar, {r["id"] for r in existing}, {r["id"] for r in read_resumable_jsonl(sidecar)})

    def holds(self, answer: str) -> bool:
        return answer in self.written or answer in self.failed

    def append(self, records: list[dict], failures: list[dict]) -> tuple[list[dict], list[dict]]:
        """Step 4, write: append the unit's records and failures that the files do not hold yet
        (one fsynced write each); -> (records appended, failures appended)."""
        new_records = [r for r in records if r["id"] not in self.written]
        new_failures = [r for r in failures if r["id"] not in self.failed]
        _append_lines(self.sidecar, new_failures)  # sidecar first: a crash before the output line
        _append_lines(self.output, new_records)  # leaves the unit incomplete, so it is redone
        self.written.update(r["id"] for r in new_records)
        self.failed.update(r["id"] for r in new_failures)
        return new_records, new_failures
