"""Render a trace's spans as a waterfall PNG: ``python -m bench.waterfall SPANS.json OUT.png``.

SPANS.json is what ``tests/test_tracing.py`` writes when ``DEX_TRACE_DUMP`` names a file (the
spans of a real run: the agent's from the in-memory exporter, the worker's and the API's from
OTLP). The picture is drawn here with matplotlib from those spans, and says so: it is not a
screenshot of Jaeger. Needs matplotlib (not a dependency of dex-tasks: ``pip install
matplotlib``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def render(spans: list[dict[str, Any]], out: Path) -> None:
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    by_id = {s["span_id"]: s for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        parent = s["parent_id"] if s["parent_id"] in by_id else None
        children.setdefault(parent, []).append(s)
    rows: list[tuple[int, dict[str, Any]]] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x["start"]):
            rows.append((depth, s))
            walk(s["span_id"], depth + 1)

    walk(None, 0)
    t0 = min(s["start"] for s in spans)
    colours = {"agent": "#4c72b0", "dex-tasks-api": "#dd8452", "dex-tasks-worker": "#55a868",
               "dex-tasks-sweep": "#c44e52"}
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(rows) + 1.6))
    for i, (_, s) in enumerate(rows):
        start, width = (s["start"] - t0) / 1e6, max((s["end"] - s["start"]) / 1e6, 0.3)
        ax.barh(i, width, left=start, color=colours.get(s["service"], "#8172b2"))
        ax.text(start + width, i, f"  {(s['end'] - s['start']) / 1e6:.1f} ms", va="center",
                fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{s['name']}  [{s['service']}] {'·' * d:<3}" for d, s in rows],
                       fontsize=8, family="monospace")
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the trace's first span")
    ax.set_title("One dex-tasks call approved through the API: rendered with matplotlib from the "
                 "exported spans\n(tests/test_tracing.py; not a Jaeger screenshot)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    render(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
