"""The file side of every `--plot`: the formats, matplotlib loaded headless, PNG/SVG/HTML out.

The figures themselves are drawn by the module of their data (:mod:`~oomdoctor.plans.stepplot`
for the step, :mod:`~oomdoctor.plans.barplot` for probe and recommend); this module only knows
how a Figure becomes a file, so the three formats behave the same for every command.
"""
from __future__ import annotations

import html
import io
from typing import Any

FORMATS = ("png", "svg", "html")


def plot_format(path: str) -> str:
    """The format of ``path`` by its extension; ValueError naming the known ones otherwise."""
    ext = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if ext not in FORMATS:
        raise ValueError(f"--plot {path}: unknown format; end the file name in .png, .svg or "
                         ".html")
    return ext


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: files only, never a window (the `plot` extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_figure(fig: Any, path: str, title: str) -> None:
    """Write ``fig`` as PNG, SVG, or one HTML page with the SVG inline (it fetches nothing),
    by the file's extension; the figure is closed either way."""
    ext = plot_format(path)
    try:
        if ext == "html":
            buf = io.StringIO()
            fig.savefig(buf, format="svg")
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>"
                        f"{html.escape(title)}</title></head><body>\n"
                        f"{buf.getvalue()}\n</body></html>\n")
        else:
            fig.savefig(path, format=ext, dpi=120)
    finally:
        pyplot().close(fig)
