"""`eyas doctor`'s wall time on this CPU, SmolLM2-135M-Instruct with 16 samples (built-in prompts).

    PYTHONPATH=src .venv/bin/python benchmarks/doctor_time_cpu.py prepare OUT
    PYTHONPATH=src .venv/bin/python benchmarks/doctor_time_cpu.py worst OUT/far [--profile FILE]

``prepare`` writes the broken directories the timings use, from the shipped drafter exported for
vLLM (``eyas export default --to vllm``): ``far`` (top-level ids [0, 8, 20]), ``shift`` (one block
early, [1, 14, 26]) and ``noids`` (no eyas.json, no eyas_* keys, no ids: the boundaries are assumed
and decided from live accuracy). The healthy run and the three broken ones are plain CLI calls (see
benchmarks/results/2026-12-01-doctor-time-cpu.md). ``worst`` is the worst case: ``far`` served as vLLM
serves it, with nothing restoring (the search's restore test patched to fail), so every candidate
is scored and the combined flags too; it prints the wall time as JSON (``--profile``: cProfile).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def prepare(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    vllm = out / "vllm"
    shutil.rmtree(vllm, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "eyas.cli.main", "export", "default", "--to", "vllm", "--out", str(vllm)],
                   check=True, stdout=subprocess.DEVNULL)
    for name, ids in (("far", [0, 8, 20]), ("shift", [1, 14, 26]), ("noids", None)):
        d = out / name
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(vllm, d)
        cfg = json.loads((d / "config.json").read_text())
        if ids is None:
            (d / "eyas.json").unlink()
            for key in [k for k in cfg if k.startswith("eyas_") or k == "eagle_aux_hidden_state_layer_ids"]:
                del cfg[key]
        else:
            cfg["eagle_aux_hidden_state_layer_ids"] = ids
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        print(d)


def worst(draft: str, engine: str, profile: str | None) -> None:
    import cProfile
    import pstats

    import eyas.doctor.search as search
    from eyas.doctor import run_doctor

    search.short_by = lambda *a, **k: True  # nothing restores: every candidate is scored
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    r = run_doctor("smollm2", draft, engine=engine, samples=16)
    if prof:
        prof.disable()
    s = r.stages.search.result
    print(json.dumps({"status": r.status, "wall_s": round(time.perf_counter() - t, 2),
                      "search_candidates": len(s.candidates) if s else 0,
                      "screened_out": sum(1 for c in s.candidates if c.screened_out_on) if s else 0}))
    if prof and profile:
        prof.dump_stats(profile)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out", type=Path)
    w = sub.add_parser("worst")
    w.add_argument("draft")
    w.add_argument("--engine", default="vllm")
    w.add_argument("--profile")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.out)
    else:
        worst(a.draft, a.engine, a.profile)


if __name__ == "__main__":
    main()
