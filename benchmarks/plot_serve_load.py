"""Output tokens/s against concurrent clients from a ``serve_load.py --json`` report: one line per
speculation setting, one panel per temperature, log axes; a level in which the server compiled a
step shape (``server.compile_s`` + ``server.target_compile_s`` > 0.5 s: every row stalled for
it) is marked with an open circle and its seconds, so a dip reads as what it was.

    python benchmarks/plot_serve_load.py benchmarks/results/2026-12-06-serve-bars-h100-b.json --out PLOT.png

Prints the table it plots (``--json``: as JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STALL_S = 0.5  # compiling this long in a level is marked on the plot


def series(report: dict) -> dict[tuple[float, str], list[dict]]:
    """(temperature, setting) -> that server's levels by clients: clients, tokens/s, seconds compiling."""
    out: dict[tuple[float, str], list[dict]] = {}
    for lv in report["levels"]:
        server = lv.get("server") or {}
        stall = float(server.get("compile_s", 0.0)) + float(server.get("target_compile_s", 0.0))
        out.setdefault((lv["temperature"], lv.get("speculation", "as served")), []).append(
            {"clients": lv["clients"], "tok_s": lv["throughput_tok_s"], "compile_s": round(stall, 2)})
    for rows in out.values():
        rows.sort(key=lambda r: r["clients"])
    return out


def plot(lines: dict[tuple[float, str], list[dict]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({t for t, _ in lines})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.5), squeeze=False)
    for ax, t in zip(axes[0], temperatures):
        for (tt, setting), rows in sorted(lines.items()):
            if tt != t:
                continue
            xs, ys = [r["clients"] for r in rows], [r["tok_s"] for r in rows]
            (line,) = ax.plot(xs, ys, marker="o", label=f"speculation {setting}")
            for r in rows:
                if r["compile_s"] > STALL_S:
                    ax.plot([r["clients"]], [r["tok_s"]], marker="o", markersize=12, fillstyle="none",
                            color=line.get_color())
                    ax.annotate(f"compiled {r['compile_s']:.1f} s", (r["clients"], r["tok_s"]), fontsize=7,
                                textcoords="offset points", xytext=(6, -10), color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"temperature {t:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="serve_load.py --json output")
    ap.add_argument("--out", type=Path, default=None, help="the PNG (default: beside the report)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        report = json.loads(a.report.read_text())
        levels = report["levels"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{a.report}: expected a serve_load.py --json report with 'levels', found {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    if not levels:
        print(f"{a.report}: levels: expected at least one, found none", file=sys.stderr)
        return 2
    lines = series(report)
    out = a.out or a.report.with_suffix(".png")
    plot(lines, a.title or f"eyas serve under load: {a.report.name}", out)
    table = [{"temperature": t, "speculation": s, **r} for (t, s), rows in sorted(lines.items()) for r in rows]
    if a.json:
        sys.stdout.write(json.dumps({"plot": str(out), "levels": table}, indent=2) + "\n")
    else:
        for row in table:
            print(f"T={row['temperature']:g} {row['speculation']:>9} {row['clients']:>4} clients "
                  f"{row['tok_s']:>10.1f} tok/s  compiled {row['compile_s']:.2f} s")
        print(f"plot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
