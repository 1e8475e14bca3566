"""Tau against training data size for the SmolLM2 drafters, from measured points only.

    python benchmarks/plot_data_size.py benchmarks/results/2026-12-01-data-size.json

Reads the points (each: the drafter's training conversations and targets, and the tau measured
with it, with the file that holds the measurement; the file's ``y_label`` says how tau was measured,
MT-bench greedy when it has none), prints them as a table (``--json``:
as JSON) and writes a PNG next to the input: tau per decoder against training targets on a log
axis, the goals as horizontal lines, and each series' log-linear trend through its points
extended to its goal (two points make a line, not a prediction: the plot says so).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def trend_to_goal(points: list[tuple[float, float]], goal: float) -> float | None:
    """Training targets at which the log-linear line through the first and last points reaches
    ``goal`` (None when the line does not rise, or the last point already reaches the goal)."""
    (x0, y0), (x1, y1) = points[0], points[-1]
    if y1 >= goal:
        return None
    slope = (y1 - y0) / (math.log(x1) - math.log(x0))
    if slope <= 0:
        return None
    return math.exp(math.log(x1) + (goal - y1) / slope)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", type=Path)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    data = json.loads(a.points.read_text())
    rows = []
    for s in data["series"]:
        pts = sorted((p["training_targets"], p["tau"]) for p in s["points"])
        need = trend_to_goal(pts, s["goal"]) if len(pts) >= 2 and s.get("goal") else None
        rows.append({"series": s["name"], "goal": s.get("goal"), "points": s["points"],
                     "targets_for_goal_by_trend": None if need is None else round(need)})
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            pts = ", ".join(f"{p['training_targets']:,} targets -> {p['tau']:.2f}" for p in r["points"])
            need = r["targets_for_goal_by_trend"]
            print(f"{r['series']}: {pts}; goal {r['goal']}" + (f", trend reaches it at ~{need:,} targets" if need else ""))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = plt.get_cmap("tab10").colors  # one per series, however many the file holds
    for i, r in enumerate(rows):
        color = colors[i % len(colors)]
        pts = sorted((p["training_targets"], p["tau"]) for p in r["points"])
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=color, label=r["series"])
        if r["goal"]:
            ax.axhline(r["goal"], color=color, ls=":", lw=1)
        need = r["targets_for_goal_by_trend"]
        if need and need < 1e9:
            ax.plot([pts[-1][0], need], [pts[-1][1], r["goal"]], "--", color=color, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("training targets (answer tokens the drafter was trained on)")
    ax.set_ylabel(data.get("y_label", "tau (tokens per round), MT-bench, greedy"), fontsize=8)
    ax.set_title("SmolLM2 drafters: tau against training data (dashed: log-linear trend, not measured)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    png = a.png or a.points.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot: {png}", file=sys.stderr if a.json else sys.stdout)  # --json: stdout is the JSON alone
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
