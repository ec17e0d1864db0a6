"""What reading a dataset's files found, common to the training data (prepare.py) and the RL
prompts (prompts.py): `RowReport` (files, rows read, bad rows with a few examples) and
`read_records`, the Ray Data read of those files into parsed records, good and bad."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial

from ..errors import RapidfireError

BAD_ROW_EXAMPLES = 5


@dataclass
class RowReport:
    files: list[str]
    rows_read: int = 0
    bad_rows: int = 0
    bad_examples: list[dict] = field(default_factory=list)

    def record_bad_rows(self, count: int, examples: Iterable[Mapping], on_bad_row: str, key: str) -> None:
        """Count `count` bad rows and keep the first `BAD_ROW_EXAMPLES` of `examples` (rows with
        source and error); with `data.on_bad_row: fail` raise a one-line error naming the first."""
        self.bad_rows = count
        if not count:
            return
        self.bad_examples = [{"source": r["source"], "error": r["error"]} for r in list(examples)[:BAD_ROW_EXAMPLES]]
        if on_bad_row == "fail":
            first = self.bad_examples[0]
            raise RapidfireError(f"{key}: bad row {first['source']}: {first['error']} ({count} bad row(s) in all); "
                                 "fix the row or set data.on_bad_row=skip to skip bad rows")

    def bad_rows_note(self) -> str:
        """"; skipped N bad row(s), e.g. <first>" for `describe()`, or "" when there were none."""
        if not self.bad_rows:
            return ""
        first = self.bad_examples[0]
        return f"; skipped {self.bad_rows} bad row(s), e.g. {first['source']}: {first['error']}"

    def to_dict(self) -> dict:
        return asdict(self)


def read_records(files: list[str], fmt: str):
    """The records of `files` in data.format `fmt` (rows.parse: good ones with error "", bad ones
    with the reason), materialised in file order."""
    import ray.data

    from . import rows

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    return (ray.data.read_binary_files(files, include_paths=True)
            .flat_map(partial(rows.parse, fmt=fmt))
            .materialize())
