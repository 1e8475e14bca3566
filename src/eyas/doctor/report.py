"""The doctor's report: one object, rendered as JSON (``--json``), as a rich text report, and as a
PNG of accuracy per draft position (training, replay, live, and the protocol the search found)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.doctor.common import FAIL, OK, PASS, SKIPPED, STAGES, WARN, DoctorStages, Edit, fmt_acc, jsonable

if TYPE_CHECKING:
    from eyas.doctor.context import EngineChoice, TargetFacts
    from eyas.doctor.samples import SampleSet
    from eyas.doctor.verdict import Verdict

__all__ = ["STAGES", "DoctorReport", "DraftFacts", "plot_png", "render"]


@dataclass(frozen=True)
class DraftFacts:
    """The drafter directory as the report names it (None where it could not be read)."""

    path: str
    layout: str | None = None
    format: str | None = None
    trained_boundaries: list[int] | None = None
    trained_flags: dict[str, bool] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "layout": self.layout, "format": self.format,
                "trained_boundaries": self.trained_boundaries, "trained_flags": self.trained_flags}


EXIT_UNVERIFIED = 3  # nothing failed, but the trained boundaries are an unsettled assumption


@dataclass
class DoctorReport:
    verdict: Verdict
    engine: EngineChoice
    target: TargetFacts
    draft: DraftFacts
    data: SampleSet | None
    stages: DoctorStages
    png: str | None = None
    wall_s: float = 0.0

    @property
    def healthy(self) -> bool:
        return self.verdict.healthy

    @property
    def cause(self) -> str | None:
        return self.verdict.cause

    @property
    def fix(self) -> str | None:
        return self.verdict.fix

    @property
    def fix_edits(self) -> list[Edit]:
        return self.verdict.fix_edits

    @property
    def warnings(self) -> list[str]:
        return self.verdict.warnings

    @property
    def problems(self) -> list[str]:
        return self.verdict.problems

    @property
    def unverified(self) -> str | None:
        return self.verdict.unverified

    @property
    def status(self) -> str:
        """healthy, unverified or unhealthy."""
        return "healthy" if self.healthy else "unverified" if self.unverified else "unhealthy"

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 not healthy, 3 unverified (2 is the CLI's bad-input code)."""
        return {"healthy": 0, "unhealthy": 1, "unverified": EXIT_UNVERIFIED}[self.status]

    def to_dict(self) -> dict[str, Any]:
        v = self.verdict
        d: dict[str, Any] = {
            "healthy": v.healthy, "status": self.status, "unverified": v.unverified, "cause": v.cause, "fix": v.fix, "fix_edits": [e.to_dict() for e in v.fix_edits],
            "warnings": v.warnings, "problems": v.problems, "engine": self.engine.to_dict(),
            "target": self.target.to_dict(), "draft": self.draft.to_dict(),
            "data": self.data.to_dict() if self.data is not None else None,
        }
        for name, stage in self.stages.items():
            d[name] = stage.to_dict()
        d["png"] = self.png
        d["wall_s"] = round(self.wall_s, 2)
        return jsonable(d)

    # -- curves ------------------------------------------------------------------------------------

    def curves(self) -> dict[str, list[float]]:
        """Accuracy per draft position: recorded at training, replay, live, and the search's winner."""
        out: dict[str, list[float]] = {}
        st = self.stages
        replay, live, search = st.replay.result, st.live.result, st.search.result
        training = replay.training.accuracy_per_position if replay is not None and replay.training is not None else None
        if training:
            out["training (recorded)"] = training
        live_label = f"live ({self.engine.label}" + (f", boundaries {live.boundaries})" if live is not None else ")")
        if replay is not None and st.replay.status != SKIPPED:
            out["replay (as trained)"] = replay.accuracy.accuracy_per_position
        if live is not None and st.live.status != SKIPPED:
            out[live_label] = live.accuracy.accuracy_per_position
        if search is not None and search.winner is not None and search.winner_accuracy is not None:
            w = search.winner
            out[f"search: {w.protocol.label}, boundaries {w.boundaries}"] = search.winner_accuracy.accuracy_per_position
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
    verdict = {"healthy": "healthy", "unverified": "UNVERIFIED"}.get(report.status, "NOT healthy")
    ax.set_title(f"eyas doctor ({report.engine.label}): {verdict}", fontsize=10)
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
    console.print(f"[bold]eyas doctor[/]  drafter {e(str(report.draft.path))}  target {e(str(report.target.source))}"
                  f"  engine [bold]{e(str(report.engine.label))}[/]")
    if report.data is not None:
        d = report.data
        console.print(f"  data: {d.source} {e(str(d.path or ''))} - {len(d.samples)} samples, {d.num_tokens} tokens "
                      f"({e(d.selection)})")
        for n in d.notes:
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
        static = report.stages.static.result
        if name == "static" and static is not None:
            eng = static.engine
            t = Table(title=f"what {e(eng.label)} reads from the directory", title_justify="left", show_lines=False)
            for c in ("key", "as written", "used", "note"):
                t.add_column(c)
            for k in eng.keys:
                t.add_row(e(k.key), e(_fmt(k.raw) if k.present else "[absent]"), e(_fmt(k.used)), e(k.note))
            console.print(t)
            caps = static.captures
            trained = static.trained.boundaries
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
            for stage_name, measured in (("replay", report.stages.replay.result), ("live", report.stages.live.result)):
                if measured is not None:
                    a = measured.accuracy
                    console.print(f"  {stage_name}: simulated accept length {a.simulated_accept_length:.2f}, "
                                  f"{a.tokens_counted} tokens counted")
        fingerprint = report.stages.fingerprint.result
        if name == "fingerprint" and fingerprint is not None and fingerprint.slots:
            t = Table(title=f"slots vs training fingerprint ({e(fingerprint.reference)})", title_justify="left")
            for c in ("slot", "served", "trained", "RMS live", "RMS train", "rms z", "channel", "looks like",
                      "train matches", "train dist (match/looks/next)", "off"):
                t.add_column(c)
            for r in fingerprint.slots:
                m = r.match
                dists = f"{m.d_trained_match:.3g}/{m.d_trained_looks:.3g}/" + (
                    f"{m.d_trained_runner_up:.3g}" if m.d_trained_runner_up is not None else "-")
                off = "[bold red]yes[/]" if r.off else "[yellow]indistinct[/]" if r.indistinct else "no"
                t.add_row(str(r.slot), str(r.served_boundary), str(r.trained_boundary),
                          f"{r.rms_observed:.4g}", f"{r.rms_trained:.4g}", f"{r.rms_z:+.1f}",
                          f"{r.comparison.channel_z:.2f}", e(r.looks_like_name), str(r.trained_matches), dists, off)
            console.print(t)
        search = report.stages.search.result
        if name == "search" and search is not None and search.candidates:
            t = Table(title=f"protocols tried (score = mean accuracy over the first {search.positions_scored} "
                            f"positions; replay {search.reference_score:.3f}, as served {search.served_score:.3f})",
                      title_justify="left")
            for c in ("protocol", "boundaries", "score", "restores"):
                t.add_column(c)
            for r in search.candidates[:8]:
                t.add_row(e(r.protocol.label), e(r.boundaries), f"{r.score:.3f}", "[green]yes[/]" if r.restores else
                          f"no (ruled out on {r.screened_out_on} samples)" if r.screened_out_on else "no")
            console.print(t)

    if report.healthy:
        body = "[bold green]HEALTHY[/]: the drafter sees, as served, what it was trained on."
        if report.warnings:
            body += "\n" + "\n".join(f"[yellow]warning[/] {e(w)}" for w in report.warnings)
        console.print(Panel(body, title="verdict", border_style="green"))
    elif report.unverified:
        body = f"[bold yellow]UNVERIFIED[/]: {e(report.unverified)}"
        console.print(Panel(body, title="verdict", border_style="yellow"))
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
    acc = [fmt_acc(m.accuracy.accuracy_per_position if m is not None else None)
           for m in (report.stages.replay.result, report.stages.live.result)]
    console.print(f"  [dim]{report.wall_s:.1f} s; replay/live accuracies {acc[0]} / {acc[1]}[/]")
