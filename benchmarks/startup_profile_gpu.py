"""Where ``eyas serve``'s start-up goes: :func:`eyas.serve.startup.load_served` in this process under
cProfile, on the cache directory ``--cache`` (run it once to fill the cache, then again: the warm start
that issue 33 bounds at 20 s). Prints the server's own stages, dynamo's compile times per phase,
how many frames dynamo traced and the functions with the most cumulative time.

    python benchmarks/startup_profile_gpu.py --target /tmp/smol.gguf --draft DIR --cache /tmp/eyas-cache --json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--tree", default="4,8,15")
    ap.add_argument("--cache", required=True, help="EYAS_CACHE")
    ap.add_argument("--top", type=int, default=45, help="functions listed, by cumulative time")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    os.environ["EYAS_CACHE"] = a.cache
    t0 = time.perf_counter()
    import torch  # imports timed apart from the start-up

    from eyas.serve.startup import load_served

    imports_s = time.perf_counter() - t0
    profile = cProfile.Profile()
    t1 = time.perf_counter()
    profile.enable()
    served = load_served(a.target, a.draft, tree=a.tree, log=lambda m: print(f"[{time.perf_counter() - t1:7.2f}] {m}",
                                                                                file=sys.stderr))
    profile.disable()
    wall = time.perf_counter() - t1
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
    stats.print_stats(a.top)
    # eyas' own functions and the loaders they call: where each stage's seconds go
    stats.print_stats(r"eyas/|from_pretrained|\(to\)|_lazy_init|GGUFReader", a.top)
    from torch._dynamo.utils import compile_times, counters

    out = {"torch": torch.__version__, "imports_s": round(imports_s, 2), "load_served_s": round(wall, 2), "startup": served.startup.to_dict(),
           "dynamo_compile_times": compile_times(repr="str", aggregate=True),
           "dynamo_counters": {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "inductor")},
           "profile": text.getvalue()}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(out["profile"])
        print(json.dumps({k: v for k, v in out.items() if k != "profile"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
