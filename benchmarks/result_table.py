"""A benchmark's table: rows printed as they are measured, then written as NAME.csv and NAME.md, the markdown headed
by the command that reproduces it."""
from __future__ import annotations

import csv
import pathlib
import sys


class ResultTable:
    def __init__(self, name: str, fields: list[str], script: str | None = None):
        """`script`: the benchmark that writes the table, when it is not named after it."""
        self.name, self.fields, self.script = name, fields, script or name
        self.rows: list[dict] = []

    def add(self, **row) -> None:
        """One row; floats to 4 significant digits."""
        row = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in row.items()}
        self.rows.append(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    def write(self, out: pathlib.Path, argv: list[str] | None) -> None:
        with open(out / f"{self.name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, self.fields)
            writer.writeheader()
            writer.writerows(self.rows)
        command = f"python benchmarks/{self.script}.py " + " ".join(argv if argv is not None else sys.argv[1:])
        lines = ["| " + " | ".join(self.fields) + " |", "|" + "---|" * len(self.fields)]
        lines += ["| " + " | ".join(str(row[k]) for k in self.fields) + " |" for row in self.rows]
        (out / f"{self.name}.md").write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")
