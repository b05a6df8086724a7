"""Files that a crash never leaves half written, and CSV logs that a damaged row cannot block.

`atomic_open(path)` / `atomic_write(path, data)` write a temporary file beside `path`, named
`.<name>.<pid>.tmp`, flush it to disk and rename it over `path` (atomic on POSIX): readers, and a
run killed at any moment, see the old file or the new one, never half of one. A process killed while
writing leaves its temporary file behind; the next write of the same path removes every such file,
whatever process left it (one writer per path: the Trainer's rank 0, the study's parent process).

`read_csv(path, fields, types)` reads back a CSV file written with the header `fields`. A row that
cannot be read (garbled, or a last line cut short by a kill) is skipped with a warning naming the file
and the line; the caller rewrites the file without it at its next atomic write.
"""
from __future__ import annotations

import contextlib
import csv
import glob
import io
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_open", "atomic_write", "remove_stale_temps", "read_csv", "csv_text"]


def _temp_pattern(path: Path) -> str:
    return f".{glob.escape(path.name)}.*.tmp"


def remove_stale_temps(path: Path) -> None:
    """Remove the temporary files that writes of `path` killed half way left behind."""
    for tmp in path.parent.glob(_temp_pattern(path)):
        if tmp.name[len(path.name) + 2:-len(".tmp")].isdigit():  # .<name>.<pid>.tmp: ours, not a user's file
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file to write `path`'s new content into; it replaces `path` only if the block ends without error."""
    path = Path(path)
    remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace `path` by `data` in one step (see `atomic_open`)."""
    with atomic_open(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def csv_text(fields: Sequence[str], rows: Iterable[Mapping[str, Any]], lineterminator: str = "\n") -> str:
    """A header line of `fields` and one line per row, as csv.DictWriter writes them."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fields, lineterminator=lineterminator)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def read_csv(path: Path, fields: Sequence[str], types: Mapping[str, Callable[[str], Any]],
             then: str) -> tuple[list[dict[str, str]], bool]:
    """The readable rows of `path` (as text, each value checked with `types`, other fields non-empty) and
    whether the file is intact: a header of `fields`, every row readable.

    Unreadable rows are skipped with one UserWarning naming the file and their lines; `then` says what
    happens to them. A file whose first line is not the header is read as rows without one.
    """
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    header = bool(lines) and _fields_of(lines[0]) == list(fields)
    problems = [] if header else ["no header line" if lines else "empty file, no header"]
    rows = []
    for number, line in enumerate(lines[header:], 1 + header):
        row, problem = _parse(line, fields, types)
        if problem is None:
            rows.append(row)
        else:
            problems.append(f"line {number}: {problem}")
    if problems:
        shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        warnings.warn(f"{path}: skipped what cannot be read ({shown}); {then}", UserWarning, stacklevel=2)
    return rows, not problems


def _fields_of(line: str) -> list[str]:
    return next(csv.reader([line.rstrip("\r\n")]), [])


def _parse(line: str, fields: Sequence[str], types: Mapping[str, Callable[[str], Any]]
           ) -> tuple[dict[str, str], str | None]:
    """One data line as a row, or why it cannot be one."""
    if not line.endswith("\n"):
        return {}, "cut short (no line end)"
    values = _fields_of(line)
    if len(values) != len(fields):
        return {}, f"{len(values)} values, expected {len(fields)}"
    row = dict(zip(fields, values))
    for name, value in row.items():
        try:
            if name in types:
                types[name](value)
            elif not value:
                raise ValueError
        except ValueError:
            return {}, f"{name} is {value!r}"
    return row, None
