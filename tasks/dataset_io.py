"""Reading a dataset's rows from local files, with limits checked before anything is loaded.

Formats: JSON Lines (``.jsonl``), CSV (``.csv``, header row), Parquet (``.parquet``) and a folder
written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose split is
named). Only the named fields are kept, as strings. Every error is a :class:`DatasetError` (a
ValueError) naming the file and, where it applies, the row and the field; its
:attr:`~DatasetError.public` form quotes nothing read from the file (no field names from a
header, no values, no parser's message), for whoever submitted the job over the network.

Limits: a file (or a folder's files together) over ``max_bytes`` is refused by its size before
it is opened; a file with more than ``max_rows`` rows is refused from its metadata (Parquet, a
saved dataset) or as soon as row ``max_rows + 1`` is read (JSON Lines, CSV), so memory stays
bounded by the limit.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FORMATS = ("auto", "jsonl", "csv", "parquet", "disk")


class DatasetError(ValueError):
    """A dataset file that is missing, too big, malformed or lacks a field.

    ``str(exc)`` is the whole message, for the operator's log and local tools: it may quote the
    file (the fields a row has, a repeated id). :attr:`public` says the same without anything
    read from the file: what the job API answers, since a dataset path may name a file its
    submitter should not read (the first line of a CSV header is a file's first line).
    """

    def __init__(self, message: str, *, public: str | None = None) -> None:
        super().__init__(message)
        self.public = message if public is None else public


def detect_format(path: Path) -> str:
    """``jsonl``/``csv``/``parquet`` from the suffix, ``disk`` for a folder.

    :raises DatasetError: a missing path or an unknown suffix.
    """
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    if path.is_dir():
        return "disk"
    suffix = path.suffix.lower()
    for fmt, suffixes in (
        ("jsonl", (".jsonl", ".ndjson")),
        ("csv", (".csv",)),
        ("parquet", (".parquet", ".pq")),
    ):
        if suffix in suffixes:
            return fmt
    raise DatasetError(
        f"dataset file {path}: cannot tell the format from {suffix or 'no suffix'!r}; "
        "set params.format to jsonl, csv, parquet or disk"
    )


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def read_rows(
    path: Path,
    fmt: str,
    fields: list[str],
    *,
    max_rows: int,
    max_bytes: int,
    split: str = "train",
) -> list[dict[str, str]]:
    """The rows of ``path`` with only ``fields``, each value converted to ``str``.

    :raises DatasetError: missing file, unknown format, over a limit, unreadable content, or a
        row without one of ``fields`` (or with a null there).
    """
    fmt = detect_format(path) if fmt == "auto" else fmt
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    size = _size(path)
    if size > max_bytes:
        raise DatasetError(
            f"dataset file {path} is {size / 2**20:.1f} MiB, over the limit of "
            f"{max_bytes / 2**20:.0f} MiB (params.max_file_mb)"
        )
    if fmt == "jsonl":
        rows: Iterable[dict[str, Any]] = _jsonl(path)
    elif fmt == "csv":
        rows = _csv(path)
    elif fmt == "parquet":
        rows = _parquet(path, fields, max_rows)
    elif fmt == "disk":
        rows = _disk(path, fields, max_rows, split)
    else:
        raise DatasetError(f"dataset file {path}: unknown format {fmt!r} (known: {FORMATS})")
    out: list[dict[str, str]] = []
    for i, row in enumerate(rows):
        if i >= max_rows:
            raise DatasetError(
                f"dataset file {path} has more than {max_rows} rows (params.max_rows)"
            )
        out.append(_pick(path, i, row, fields))
    return out


def _pick(path: Path, i: int, row: Any, fields: list[str]) -> dict[str, str]:
    if not isinstance(row, dict):
        raise DatasetError(f"dataset file {path}: row {i} is not an object")
    picked = {}
    for f in fields:
        if f not in row:
            have = ", ".join(sorted(map(str, row))) or "none"
            missing = f"dataset file {path}: row {i} has no field {f!r}"
            raise DatasetError(
                f"{missing} (fields: {have})", public=f"{missing} (it has {len(row)} fields)"
            )
        value = row[f]
        if value is None:
            raise DatasetError(f"dataset file {path}: row {i}: field {f!r} is empty (null)")
        picked[f] = _text(value)
    return picked


def _text(value: Any) -> str:
    # A whole float ("18.0" in a Parquet float column) is written as the integer it is, so an
    # exact-match reward compares "18" with "18".
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value if isinstance(value, str) else str(value)


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with _utf8(path), path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"dataset file {path}: line {n} is not JSON: {exc}") from None


def _csv(path: Path) -> Iterator[dict[str, Any]]:
    with _utf8(path), path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        try:
            yield from reader
        except csv.Error as exc:
            raise DatasetError(f"dataset file {path}: line {reader.line_num}: {exc}") from None


@contextmanager
def _utf8(path: Path) -> Iterator[None]:
    """Turn a decoding error inside the block into a DatasetError: the codec's message quotes
    the offending byte, which the public form leaves out."""
    try:
        yield
    except UnicodeDecodeError as exc:
        bad = f"dataset file {path} is not UTF-8 text"
        raise DatasetError(f"{bad}: {exc}", public=bad) from None


def _check_columns(path: Path, have: list[str], fields: list[str]) -> None:
    for f in fields:
        if f not in have:
            missing = f"dataset file {path} has no field {f!r}"
            raise DatasetError(
                f"{missing} (fields: {', '.join(have) or 'none'})",
                public=f"{missing} (it has {len(have)} fields)",
            )


def _check_count(path: Path, n: int, max_rows: int) -> None:
    if n > max_rows:
        raise DatasetError(
            f"dataset file {path} has {n} rows, more than {max_rows} (params.max_rows)"
        )


def _parquet(path: Path, fields: list[str], max_rows: int) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
        bad = f"dataset file {path} is not Parquet"
        raise DatasetError(f"{bad}: {exc}", public=f"{bad} ({type(exc).__name__})") from None
    _check_columns(path, pf.schema_arrow.names, fields)
    _check_count(path, pf.metadata.num_rows, max_rows)
    yield from pf.read(columns=fields).to_pylist()


def _disk(path: Path, fields: list[str], max_rows: int, split: str) -> Iterator[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets raises several types for bad folders
        bad = f"dataset folder {path} is not a saved dataset"
        raise DatasetError(f"{bad}: {exc}", public=f"{bad} ({type(exc).__name__})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            missing = f"dataset folder {path} has no split {split!r}"
            raise DatasetError(
                f"{missing} (splits: {', '.join(ds)})", public=f"{missing} ({len(ds)} splits)"
            )
        ds = ds[split]
    _check_columns(path, list(ds.column_names), fields)
    _check_count(path, ds.num_rows, max_rows)
    # Memory-mapped: only the selected columns are materialised.
    yield from ds.select_columns(fields).to_list()
