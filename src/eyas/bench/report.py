"""Bench output: a table people read, the same facts as JSON, and a PNG of accept lengths."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rich.table import Table

if TYPE_CHECKING:
    from eyas.tune import TreeChoice


def bench_table(summaries: Sequence[dict[str, Any]], title: str = "") -> Table:
    """tokens/s is the mean of per-prompt rates (as in the EAGLE papers); the JSON has totals too."""
    t = Table(title=f"eyas bench{': ' + title if title else ''}: tokens/s (mean of per-prompt rates)")
    for col in ("set", "n", "tau", "spec", "plain", "hf", "x plain", "x hf", "same as plain"):
        t.add_column(col)
    for s in summaries:
        m = s["tokens_per_s"]
        ident = s["identical_to_plain"]
        t.add_row(
            s["set"], str(s["prompts"]), f"{s['tau']:.2f}",
            *(f"{m[k]:.1f}" if m[k] else "-" for k in ("speculative", "plain", "hf")),  # "-": not run (--no-hf)
            *("-" if x is None else f"{x:.2f}" for x in (s["speedup_vs_plain"], s["speedup_vs_hf"])),
            "n/a" if ident is None else ("[green]yes[/]" if ident else "[bold red]NO[/]"),
        )
    return t


def acceptance_lines(summaries: Sequence[dict[str, Any]]) -> list[str]:
    return [f"{s['set']}: acceptance per draft position "
            + " ".join(f"{a:.2f}" for a in s["acceptance_per_position"])
            + f"; total tokens/s spec {s['tokens_per_s_total']['speculative']:.1f}, plain "
            f"{s['tokens_per_s_total']['plain']:.1f}, hf {s['tokens_per_s_total']['hf']:.1f}"
            for s in summaries]


def plot_accept_lengths(summaries: Sequence[dict[str, Any]], png: Path) -> Path:
    """Histogram of tokens emitted per speculative round (accepted drafts + the bonus), per set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(summaries))
    for i, s in enumerate(summaries):
        hist = {int(k): v for k, v in s["accept_length_histogram"].items()}
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        offset = (i - (len(summaries) - 1) / 2) * width  # the sets' bars side by side, centred on x
        ax.bar([x + offset for x in xs], [hist[x] / total for x in xs], width=width,
               label=f"{s['set']} (tau {s['tau']:.2f})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # token counts are integers
    ax.set_xlabel("tokens per round (accepted drafts + bonus)")
    ax.set_ylabel("fraction of rounds")
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def auto_tree_table(choice: TreeChoice, top: int = 8) -> Table:
    """`--tree auto`: the best candidates (a :class:`~eyas.tune.TreeChoice`), the chosen
    one first, plus the best chain when it is not among them."""
    from eyas.tune import tree_label

    rows = list(choice.candidates[:top])
    chain = next((c for c in choice.candidates if c.spec.top_k == 1), None)
    if chain is not None and chain not in rows:
        rows.append(chain)
    searched = max(choice.searched, len(choice.candidates))
    t = Table(title=f"--tree auto at temperature {choice.temperature:g}: {searched} trees searched, "
                    f"{len(choice.candidates)} timed end to end (plain step {choice.cost.plain_s * 1e3:.2f} ms)")
    for col in ("depth,topk,total", "pred. tau", "draft ms", "verify ms", "round ms", "pred. speedup"):
        t.add_column(col, justify="right")
    for c in rows:
        style = "bold green" if c is choice.candidates[0] else None
        t.add_row(tree_label(c.spec), f"{c.tau:.2f}", f"{c.draft_s * 1e3:.2f}",
                  f"{c.verify_s * 1e3:.2f}", f"{c.round_s * 1e3:.2f}", f"{c.speedup:.2f}x", style=style)
    return t


def trees_table(temperature: dict[str, Any]) -> Table:
    """Every tree run at one temperature (a :meth:`eyas.bench.sweep.TemperatureRun.to_dict`), all sets
    pooled: tau, tokens/s, the speedups; the tree ``--tree auto`` chose is marked, with its prediction."""
    auto = temperature.get("tree_auto")
    t = Table(title=f"temperature {temperature['temperature']:g}: every tree, all sets pooled")
    for col in ("tree", "asked as", "tau", "spec tok/s", "x plain", "x hf", "pred. tau", "pred. x plain"):
        t.add_column(col, justify="right")
    for run in temperature["trees"]:
        o = run["overall"]
        mine = auto is not None and run["auto"]
        t.add_row(run["tree"], " ".join(run["asked_as"]), f"{o['tau']:.2f}", f"{o['tokens_per_s']['speculative']:.1f}",
                  *("-" if x is None else f"{x:.2f}" for x in (o["speedup_vs_plain"], o["speedup_vs_hf"])),
                  f"{auto['predicted_tau']:.2f}" if mine else "", f"{auto['predicted_speedup']:.2f}" if mine else "",
                  style="bold green" if mine else None)
    return t


def prediction_line(temperature: dict[str, Any]) -> str:
    """``--tree auto``'s prediction against the measurement at one temperature, and the comparison
    with the best fixed tree when there was one."""
    a = temperature.get("tree_auto")
    if a is None:
        return ""
    pct = lambda x: "-" if x is None else f"{100 * x:+.1f}%"  # noqa: E731
    text = (f"temperature {temperature['temperature']:g}: --tree auto chose {a['tree']}: tau predicted "
            f"{a['predicted_tau']:.2f}, measured {a['measured_tau']:.2f} ({pct(a['tau_error'])}); round predicted "
            f"{a['predicted_round_ms']:.2f} ms, measured "
            + ("-" if a["measured_round_ms"] is None else f"{a['measured_round_ms']:.2f} ms")
            + f" ({pct(a['round_prediction_error'])}); speedup over plain predicted {a['predicted_speedup']:.2f}x, "
            f"measured " + ("-" if a["measured_speedup"] is None else f"{a['measured_speedup']:.2f}x"))
    c = temperature.get("comparison")
    if c is not None and c["auto_vs_best_fixed"] is not None:
        text += (f"; auto at {c['auto_vs_best_fixed']:.3f}x the best fixed tree ({c['best_fixed']}, "
                 f"{c['best_fixed_tokens_per_s']:.1f} tok/s)")
    return text
