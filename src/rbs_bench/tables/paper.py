"""The paper's values: results/paper/paper_values.csv, one row per printed number of the paper's
tables and figures (PAPER_COLUMNS: the table or figure label, its short caption, row, column,
the value as printed, its unit, the line of the paper's source that prints it, and whether it is
bold), read back by the tables through `PaperValues`. The file is the repository's one copy of
the paper's numbers; it is edited by hand when the paper changes."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from rbs_bench import paths
from rbs_bench.errors import UserError

PAPER_COLUMNS = ["table", "caption_short", "row", "column", "value", "unit", "tex_line", "bold"]


@dataclass
class PaperValues:
    """The paper's numbers as printed, by (table, row, column)."""

    path: Path
    cells: dict[tuple[str, str, str], dict]

    @classmethod
    def load(cls, path: Path) -> PaperValues:
        path = Path(path)
        if not path.exists():
            raise UserError(f"{path} is missing; pass --paper-values with the paper's values file")
        rows = list(csv.DictReader(paths.read_text(path)))  # a regular file, never a FIFO
        return cls(path, {(r["table"], r["row"], r["column"]): r for r in rows})

    def get(self, table: str, row: str, column: str) -> str | None:
        r = self.cells.get((table, row, column))
        return None if r is None else r["value"]

    def lines(self, table: str) -> tuple[int, int]:
        ns = [int(r["tex_line"]) for k, r in self.cells.items() if k[0] == table]
        return min(ns), max(ns)

    def parts(self, table: str, row: str, column: str) -> str | None:
        """The value of a cell, or its numbered parts ("2/5/10" from column:1, :2, :3)."""
        whole = self.get(table, row, column)
        if whole is not None:
            return whole
        got, i = [], 1
        while (v := self.get(table, row, f"{column}:{i}")) is not None:
            got.append(v)
            i += 1
        return "/".join(got) if got else None
