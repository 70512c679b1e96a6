"""The one Markdown table writer: comparison reports, benchmark rows and the GPU check print their tables with it."""

from __future__ import annotations


def markdown_table(headers: list[str], body: list[list[str]]) -> list[str]:
    """A Markdown table whose columns are padded so that it also reads as plain text; a ``|`` or a line break inside
    a cell is escaped or flattened, so that no cell can break the table."""
    rows = [[c.replace("|", "\\|").replace("\n", " ") for c in row] for row in [headers, *body]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines
