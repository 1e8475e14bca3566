"""Drafters side by side from their `eyas bench --out` reports: per temperature and set, the accept
length tau, the first draft's acceptance and the speed over plain decoding, against issue 34's bars
(tau >= 3.2 and first-draft acceptance >= 0.8 on every set at temperature 0; tau >= 2.6 over the
sets at temperature 1), as a Markdown table, JSON (``--json``) and a PNG of tau per set.

    python benchmarks/compare_drafters.py new=eval/new.json shipped=eval/shipped.json \
        --md out.md --png out.png --json

Each report must come from the same prompts, tree and temperatures (the script checks the tree and
the sets); tau is tokens per round (accepted drafts + the bonus), as `eyas bench` reports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Bar:
    """What a drafter must reach at one temperature (0: no bar)."""

    tau_each: float = 0.0  # every set's accept length
    first_each: float = 0.0  # every set's first-draft acceptance
    tau_mean: float = 0.0  # the mean accept length of the sets


BARS: dict[float, Bar] = {0.0: Bar(tau_each=3.2, first_each=0.8), 1.0: Bar(tau_mean=2.6)}


@dataclass(frozen=True)
class SetFigures:
    """One drafter on one set at one temperature, as `eyas bench` reported it."""

    tau: float  # tokens per round: accepted drafts + the bonus
    first: float  # the first draft position's acceptance
    x_plain: float | None  # tokens/s over eyas' plain decoding in the same process
    prompts: int
    tree: str


Report = dict[float, dict[str, SetFigures]]  # temperature -> set -> figures


def read_report(label: str, path: Path) -> Report:
    """The figures per temperature and set of one `eyas bench --out` file."""
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{label}={path}: expected an `eyas bench --out` JSON report, found {e}")
    out: Report = {}
    for t in report.get("temperatures") or [report]:
        for s in t.get("sets", []):
            acc = s.get("acceptance_per_position") or [0.0]
            out.setdefault(float(s["temperature"]), {})[s["set"]] = SetFigures(
                s["tau"], acc[0], s.get("speedup_vs_plain"), s["prompts"], s["tree"])
    if not out:
        raise SystemExit(f"{label}={path}: field temperatures[].sets: expected bench rows, found none")
    return out


def compare(reports: dict[str, Report]) -> dict[str, Any]:
    """Rows per (temperature, set) with every drafter's figures, each drafter's means per
    temperature, the sets where it misses a bar, and whether it meets the bar (JSON-ready)."""
    labels = list(reports)
    first = reports[labels[0]]
    for label in labels[1:]:
        for t, sets in first.items():
            other = reports[label].get(t, {})
            if set(other) != set(sets) or any(other[k].tree != v.tree for k, v in sets.items()):
                raise SystemExit(f"{label}: expected the sets and tree of {labels[0]} at temperature {t:g} "
                                 f"({sorted(sets)}), found {sorted(other)}")
    rows, summary = [], {}
    for t in sorted(first):
        for name in first[t]:
            rows.append({"temperature": t, "set": name, **{lab: asdict(reports[lab][t][name]) for lab in labels}})
        bar = BARS.get(t, Bar())
        for lab in labels:
            sets = reports[lab][t].values()
            names = list(reports[lab][t])
            misses = [n for n, v in zip(names, sets) if v.tau < bar.tau_each or v.first < bar.first_each]
            mean_tau = sum(v.tau for v in sets) / len(sets)
            summary.setdefault(lab, {})[f"{t:g}"] = {
                "mean_tau": round(mean_tau, 3),
                "mean_first": round(sum(v.first for v in sets) / len(sets), 3),
                "sets_below_bar": misses,
                "meets_bar": not misses and mean_tau >= bar.tau_mean}
    return {"labels": labels, "bars": {f"{t:g}": asdict(b) for t, b in BARS.items()}, "rows": rows,
            "summary": summary}


def markdown(result: dict[str, Any]) -> str:
    labels = result["labels"]
    head = "| T | set | " + " | ".join(f"{lab} tau | {lab} 1st | {lab} x plain" for lab in labels) + " |"
    lines = [head, "|" + " --- |" * (2 + 3 * len(labels))]
    for r in result["rows"]:
        cells = []
        for lab in labels:
            v = r[lab]
            x = "-" if v["x_plain"] is None else f"{v['x_plain']:.2f}"
            cells += [f"{v['tau']:.2f}", f"{v['first']:.2f}", x]
        lines.append(f"| {r['temperature']:g} | {r['set']} | " + " | ".join(cells) + " |")
    for lab, per_t in result["summary"].items():
        for t, s in per_t.items():
            lines.append(f"\n{lab}, T={t}: mean tau {s['mean_tau']:.2f}, mean first-draft acceptance "
                         f"{s['mean_first']:.2f}; sets below the bar: {', '.join(s['sets_below_bar']) or 'none'}; "
                         f"bar {'met' if s['meets_bar'] else 'not met'}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    labels = result["labels"]
    width = 0.8 / len(labels)
    for ax, t in zip(axes[0], temps):
        rows = [r for r in result["rows"] if r["temperature"] == t]
        for i, lab in enumerate(labels):
            ax.bar([k + i * width for k in range(len(rows))], [r[lab]["tau"] for r in rows], width, label=lab)
        bar = BARS.get(t, Bar())
        for value, what in ((bar.tau_each, "each set"), (bar.tau_mean, "mean of sets")):
            if value:
                ax.axhline(value, color="k", ls="--", lw=1, label=f"bar {value:g} ({what})")
        ax.set_xticks([k + width * (len(labels) - 1) / 2 for k in range(len(rows))], [r["set"] for r in rows])
        top = max([r[lab]["tau"] for r in rows for lab in labels] + [bar.tau_each, bar.tau_mean])
        ax.set_ylim(0, 1.3 * top)  # room for the legend above the bars
        ax.set_title(f"temperature {t:g}")
        ax.set_ylabel("tau (tokens per round)")
        ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="LABEL=PATH of an `eyas bench --out` JSON, two or more")
    p.add_argument("--md", type=Path, help="write the table here")
    p.add_argument("--png", type=Path, help="write tau per set here")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    a = p.parse_args(argv)
    pairs = []
    for spec in a.reports:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            p.error(f"reports: expected LABEL=PATH, found {spec!r}")
        pairs.append((label, Path(path)))
    result = compare({label: read_report(label, path) for label, path in pairs})
    table = markdown(result)
    if a.md:
        a.md.write_text(table)
    if a.png:
        plot(result, a.png)
        result["png"] = str(a.png)
    print(json.dumps(result, indent=2) if a.json else table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
