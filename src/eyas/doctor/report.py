"""The doctor's report: one object, rendered as JSON (``--json``), as a rich text report, and as a
PNG of accuracy per draft position (training, replay, live, and the protocol the search found)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.doctor.common import FAIL, OK, PASS, SKIPPED, WARN, Stage, jsonable, fmt_acc

STAGES = ("static", "replay", "live", "fingerprint", "search")


@dataclass
class DoctorReport:
    healthy: bool
    cause: str | None
    fix: str | None
    fix_edits: list[dict[str, Any]]
    warnings: list[str]
    problems: list[str]
    engine: dict[str, Any]
    target: dict[str, Any]
    draft: dict[str, Any]
    data: dict[str, Any] | None
    stages: dict[str, Stage]
    png: str | None = None
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def stage(self, name: str) -> Stage:
        return self.stages[name]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "healthy": self.healthy, "cause": self.cause, "fix": self.fix, "fix_edits": self.fix_edits,
            "warnings": self.warnings, "problems": self.problems, "engine": self.engine, "target": self.target,
            "draft": self.draft, "data": self.data,
        }
        for name in STAGES:
            d[name] = self.stages[name].to_dict()
        d["png"] = self.png
        d["wall_s"] = round(self.wall_s, 2)
        return jsonable(d)

    # -- curves ------------------------------------------------------------------------------------

    def curves(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        training = (self.stages["replay"].data.get("training") or {}).get("accuracy_per_position")
        if training:
            out["training (recorded)"] = training
        live_bs = self.stages["live"].data.get("boundaries")
        live_label = f"live ({self.engine.get('label')}" + (f", boundaries {live_bs})" if live_bs else ")")
        for name, label in (("replay", "replay (as trained)"), ("live", live_label)):
            acc = self.stages[name].data.get("accuracy_per_position")
            if acc and self.stages[name].status != SKIPPED:
                out[label] = acc
        winner = self.stages["search"].data.get("winner")
        if winner:
            out[f"search: {winner['label']}, boundaries {winner['boundaries']}"] = winner["accuracy_per_position"]
        return out


# ---------------------------------------------------------------------------------------------
# PNG
# ---------------------------------------------------------------------------------------------


def plot_png(report: DoctorReport, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    styles = {"training": ("k", ":", "o"), "replay": ("tab:blue", "-", "s"), "live": ("tab:red", "-", "^"),
              "search": ("tab:green", "--", "D")}
    for label, acc in report.curves().items():
        color, ls, marker = styles[label.split(" ")[0].rstrip(":")]
        ax.plot(range(len(acc)), acc, color=color, linestyle=ls, marker=marker, label=label)
    width = max((len(a) for a in report.curves().values()), default=1)
    ax.set_xticks(range(width))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    verdict = "healthy" if report.healthy else "NOT healthy"
    ax.set_title(f"eyas doctor ({report.engine.get('label')}): {verdict}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Rich text
# ---------------------------------------------------------------------------------------------

_STATUS = {PASS: "[bold green]PASS[/]", WARN: "[bold yellow]WARN[/]", FAIL: "[bold red]FAIL[/]",
           SKIPPED: "[dim]SKIPPED[/]"}
_MARK = {OK: "[green]ok[/]", WARN: "[yellow]warn[/]", FAIL: "[bold red]FAIL[/]", "info": "[dim]info[/]"}


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3f}"
    return "-" if x is None else str(x)


def render(report: DoctorReport, console: Any) -> None:
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    e = escape
    console.print(f"[bold]eyas doctor[/]  drafter {e(str(report.draft.get('path')))}  target {e(str(report.target.get('source')))}"
                  f"  engine [bold]{e(str(report.engine.get('label')))}[/]")
    if report.data:
        d = report.data
        console.print(f"  data: {d['source']} {e(str(d.get('path') or ''))} - {d['samples']} samples, {d['tokens']} tokens "
                      f"({e(d['selection'])})")
        for n in d.get("notes") or []:
            console.print(f"  [dim]{e(n)}[/]")

    for name in STAGES:
        st = report.stages[name]
        console.rule(f"{name}  {_STATUS.get(st.status, st.status)}", align="left")
        if st.summary:
            console.print(f"  {e(st.summary)}")
        for f in st.findings:
            if f.level == OK and name != "static":
                continue
            console.print(f"  {_MARK.get(f.level, f.level)} {e(f.message)}")
        if name == "static" and "engine" in st.data:
            eng = st.data["engine"]
            t = Table(title=f"what {e(eng['label'])} reads from the directory", title_justify="left", show_lines=False)
            for c in ("key", "as written", "used", "note"):
                t.add_column(c)
            for k in eng["keys"]:
                t.add_row(e(k["key"]), e(_fmt(k["raw"]) if k["present"] else "[absent]"), e(_fmt(k["used"])), e(k["note"]))
            console.print(t)
            caps = st.data.get("captures") or {}
            trained = st.data.get("trained", {}).get("boundaries")
            if caps:
                console.print("  trained boundaries " + e(str(trained)) + "; each engine captures: " + "; ".join(
                    f"{e(k)} {e(str(v))}{'' if v == trained else ' [red](differs)[/]'}" for k, v in caps.items()))
        if name == "live":
            curves = report.curves()
            if curves:
                t = Table(title="accuracy per draft position", title_justify="left")
                t.add_column("")
                width = max(len(v) for v in curves.values())
                for k in range(width):
                    t.add_column(str(k))
                for label, acc in curves.items():
                    t.add_row(e(label), *[f"{a:.3f}" for a in acc] + [""] * (width - len(acc)))
                console.print(t)
            for stage_name in ("replay", "live"):
                s = report.stages[stage_name].data
                if "simulated_accept_length" in s:
                    console.print(f"  {stage_name}: simulated accept length {s['simulated_accept_length']:.2f}, "
                                  f"{s.get('tokens_counted')} tokens counted")
        if name == "fingerprint" and st.data.get("slots"):
            t = Table(title=f"slots vs training fingerprint ({e(st.data.get('reference', ''))})", title_justify="left")
            for c in ("slot", "served", "trained", "RMS live", "RMS train", "rms z", "channel", "looks like", "off"):
                t.add_column(c)
            for r in st.data["slots"]:
                t.add_row(str(r["slot"]), str(r["served_boundary"]), str(r["trained_boundary"]),
                          f"{r['rms_observed']:.4g}", f"{r['rms_trained']:.4g}", f"{r['rms_z']:+.1f}",
                          f"{r['channel_z']:.2f}", e(r["looks_like_name"]), "[bold red]yes[/]" if r["off"] else "no")
            console.print(t)
        if name == "search" and st.data.get("candidates"):
            t = Table(title=f"protocols tried (score = mean accuracy over the first {st.data['positions_scored']} "
                            f"positions; replay {st.data['reference_score']:.3f}, as served {st.data['served_score']:.3f})",
                      title_justify="left")
            for c in ("protocol", "boundaries", "score", "restores"):
                t.add_column(c)
            for r in st.data["candidates"][:8]:
                t.add_row(e(r["label"]), e(str(r["boundaries"])), f"{r['score']:.3f}", "[green]yes[/]" if r["restores"] else "no")
            console.print(t)

    if report.healthy:
        body = "[bold green]HEALTHY[/]: the drafter sees, as served, what it was trained on."
        if report.warnings:
            body += "\n" + "\n".join(f"[yellow]warning[/] {e(w)}" for w in report.warnings)
        console.print(Panel(body, title="verdict", border_style="green"))
    else:
        body = f"[bold red]NOT HEALTHY[/]\n[bold]cause[/] {e(report.cause or '-')}\n[bold]fix[/]   {e(report.fix or '-')}"
        others: dict[str, int] = {}
        for name in STAGES:
            for f in report.stages[name].failures():
                others[f"{name}: {f.code}"] = others.get(f"{name}: {f.code}", 0) + 1
        if len(others) > 1:
            body += "\n[bold]failing checks[/] " + ", ".join(f"{k}" + (f" x{n}" if n > 1 else "") for k, n in others.items())
        if report.warnings:
            body += "\n" + "\n".join(f"[yellow]warning[/] {e(w)}" for w in report.warnings)
        console.print(Panel(body, title="verdict", border_style="red"))
    if report.png:
        console.print(f"  plot: {e(report.png)}")
    acc = [fmt_acc(report.stages[n].data.get("accuracy_per_position")) for n in ("replay", "live")]
    console.print(f"  [dim]{report.wall_s:.1f} s; replay/live accuracies {acc[0]} / {acc[1]}[/]")
