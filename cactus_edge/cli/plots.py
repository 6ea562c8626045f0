"""PNG plots of a bench summary (matplotlib, the optional `plots` extra)."""

from __future__ import annotations

import os
from pathlib import Path

from ..files import temporary_next_to


def plot_bench(summary: dict[str, dict], out_dir: Path) -> list[Path]:
    """acceptance_vs_delta.png (AL and speedup of Cactus against delta; SpS plotted at delta 0, as
    Cactus(0) is SpS) and acceptance_by_position.png. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    groups: dict[tuple, list[tuple[float, dict]]] = {}
    for entry in summary.values():
        if entry["method"] in ("cactus", "sps"):
            key = (entry["n_draft"], entry["drafter"])
            delta = entry["delta"] if entry["method"] == "cactus" else 0.0
            groups.setdefault(key, []).append((delta, entry))
    if groups:
        figure, (al_axis, speed_axis) = plt.subplots(1, 2, figsize=(10, 4))
        for (n_draft, drafter), points in sorted(groups.items(), key=str):
            points.sort(key=lambda point: point[0])
            deltas = [delta for delta, _ in points]
            label = f"k={n_draft}" + ("" if drafter == "model" else f" {drafter}")
            al_axis.plot(deltas, [e["acceptance_length"] for _, e in points], marker="o", label=label)
            speed_axis.plot(deltas, [e["speedup_median"] for _, e in points], marker="o", label=label)
        al_axis.set(xlabel="delta (0 = SpS)", ylabel="AL (accepted drafts / verifier call)")
        speed_axis.set(xlabel="delta (0 = SpS)", ylabel="speedup vs none (median)")
        speed_axis.axhline(1.0, color="grey", linewidth=0.8)
        for axis in (al_axis, speed_axis):
            axis.grid(alpha=0.3)
            axis.legend()
        figure.tight_layout()
        written.append(_save(figure, out_dir / "acceptance_vs_delta.png"))
        plt.close(figure)
    frontier = plot_frontier(summary, out_dir)
    if frontier is not None:
        written.append(frontier)
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, entry in summary.items():
        # Positions never tried have no rate (None): plot what was measured.
        points = [
            (i + 1, r) for i, r in enumerate(entry.get("acceptance_by_position") or []) if r is not None
        ]
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", label=label)
    axis.set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1.05))
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize="small")
    figure.tight_layout()
    written.append(_save(figure, out_dir / "acceptance_by_position.png"))
    plt.close(figure)
    return written


def plot_frontier(summary: dict[str, dict], out_dir: Path) -> Path | None:
    """acceptance_vs_kl.png: AL against measured KL per token, one curve per lossy rule and draft
    length (Cactus over delta, typical acceptance over its threshold), SpS as the KL = 0 point.
    Variants with a KL budget are left out: the budget is another knob, not a point on these curves.
    None when no rule has two points."""
    import matplotlib.pyplot as plt

    curves: dict[tuple, list[tuple[float, float, str]]] = {}
    for entry in summary.values():
        if (
            entry["method"] in ("cactus", "tas", "sps")
            and entry["drafter"] == "model"
            and entry.get("kl_budget") is None
        ):
            key = (entry["method"], entry["n_draft"])
            knob = (
                f"δ={entry['delta']:g}"
                if entry["method"] == "cactus"
                else f"τ={entry['posterior_threshold']:g}"
            )
            curves.setdefault(key, []).append(
                (entry.get("kl_per_token") or 0.0, entry["acceptance_length"], knob)
            )
    if not any(len(points) > 1 for (method, _), points in curves.items() if method != "sps"):
        return None
    figure, axis = plt.subplots(figsize=(6.5, 4.2))
    for (method, n_draft), points in sorted(curves.items(), key=str):
        points.sort()
        name = {"cactus": "Cactus", "tas": "typical acceptance", "sps": "SpS (lossless)"}[method]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{name}, k={n_draft}")
        for kl, al, knob in points if method != "sps" else []:
            axis.annotate(knob, (kl, al), textcoords="offset points", xytext=(4, -10), fontsize="x-small")
    axis.set(
        xlabel="KL(output ‖ target) per emitted token (nats)", ylabel="AL (accepted drafts / verifier call)"
    )
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    path = _save(figure, out_dir / "acceptance_vs_kl.png")
    plt.close(figure)
    return path


def _save(figure, path: Path) -> Path:
    with temporary_next_to(path) as temporary:
        figure.savefig(temporary, dpi=110, format="png")
        os.replace(temporary, path)
    return path
