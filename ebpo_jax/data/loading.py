"""Records from local json/jsonl/parquet files (or, on an online machine, a hub dataset) via `datasets`.

Local files are the default and all that tests use. A hub name ("HuggingFaceH4/MATH-500")
is only tried with `hub=True`, so a mistyped local path fails with "not found" rather than
a network call. JSON and JSON Lines files are parsed here with the standard library rather
than by `datasets`, whose errors for a bad byte, a malformed line or an empty file name
neither the file nor the line ("An error occurred while generating the dataset",
`StopIteration`); parquet files go through `datasets`. Rows sharing an id must share the
answer. Hub names the schemas were written for:
    gsm8k: openai/gsm8k (config "main")      math500: HuggingFaceH4/MATH-500 (split "test")
    math: EleutherAI/hendrycks_math           aime2024: HuggingFaceH4/aime_2024
    aime2025: yentinglin/aime_2025            amc23: math-ai/amc23
    olympiadbench: Hothan/OlympiadBench       dapo: BytedTsinghua-SIA/DAPO-Math-17k
"""

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ebpo_jax.data.schemas import DataError, Record, Schema, get_schema, to_record
from ebpo_jax.runtime import storage

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _files(source: str) -> list[str]:
    """The data files of a file or directory path, in sorted order."""
    if storage.isdir(source):  # a local folder or a gs:// prefix
        found = sorted(
            os.path.join(source, f)
            for f in storage.listdir(source)
            if os.path.splitext(f)[1].lower() in FORMATS
        )
        if not found:
            raise DataError(f"directory {source!r} has no {sorted(FORMATS)} files")
        return found
    if os.path.splitext(source)[1].lower() not in FORMATS:
        raise DataError(f"{source!r}: unsupported file type; supported: {sorted(FORMATS)}")
    return [source]


def _decode(path: str, data: bytes) -> str:
    """UTF-8 text of a file; DataError naming the line and column of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(
            f"{path}: line {line}, column {column}: byte 0x{data[e.start]:02x} is not UTF-8 text"
        ) from None


def _json_rows(path: str, field: str | None) -> list[Mapping[str, Any]]:
    """Rows of a JSON array / object (`field`: its key holding the rows) or JSON Lines file."""
    text = _decode(path, storage.read_bytes(path))
    if not text.strip():
        raise DataError(f"{path}: empty file")
    head = text.lstrip()[:1]
    whole = None
    if head == "[" or field:
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}: line {e.lineno}, column {e.colno}: malformed JSON ({e.msg})"
            ) from None
    if field:
        if not isinstance(whole, dict) or field not in whole:
            raise DataError(f"{path}: no top-level field {field!r} holding the rows")
        whole = whole[field]
    if whole is not None:
        if not isinstance(whole, list):
            raise DataError(f"{path}: expected a list of rows, got {type(whole).__name__}")
        rows, lines = whole, None
    else:  # JSON Lines (one object per line; a one-object .json file is one row)
        rows, lines = [], []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if n == 1 and head == "{":  # maybe one pretty-printed object
                    try:
                        return [_object(path, json.loads(text), None, 0)]
                    except json.JSONDecodeError:
                        pass
                raise DataError(
                    f"{path}: line {n}, column {e.colno}: malformed JSON ({e.msg})"
                ) from None
            lines.append(n)
    return [_object(path, r, None if lines is None else lines[i], i) for i, r in enumerate(rows)]


def _object(path: str, row: Any, line: int | None, index: int) -> Mapping[str, Any]:
    if not isinstance(row, dict):
        where = f"line {line}" if line is not None else f"row {index}"
        raise DataError(f"{path}: {where} is not a JSON object ({type(row).__name__})")
    return row


def _rows_of_file(path: str, field: str | None) -> Iterable[Mapping[str, Any]]:
    builder = FORMATS[os.path.splitext(path)[1].lower()]
    if builder == "json":
        return _json_rows(path, field)
    import datasets  # slow import, only when loading

    kwargs = {"field": field} if field and builder == "json" else {}
    try:
        return datasets.load_dataset(builder, data_files=path, split="train", **kwargs)
    except Exception as e:  # arrow/json errors name neither the file nor the fix
        raise DataError(f"cannot read {path!r} as {builder}: {type(e).__name__}: {e}") from e


def load_records(
    source: str,
    schema: "str | Schema | Mapping[str, Any]",
    *,
    split: str = "train",
    field: str | None = None,
    hub: bool = False,
    hub_config: str | None = None,
    limit: int | None = None,
) -> list[Record]:
    """All rows of `source` (a file, a directory of files, or with hub=True a hub name) as Records.

    `field` reads a .json file whose rows sit under one top-level key. `split` only applies to
    hub datasets (a local file is one split). Raises DataError for unreadable or empty data
    and for a row without its prompt or answer.
    """
    schema = get_schema(schema)
    if storage.exists(source):
        sources = [(path, _rows_of_file(path, field)) for path in _files(source)]
    elif hub:
        import datasets

        sources = [(f"{source}[{split}]", datasets.load_dataset(source, hub_config, split=split))]
    else:
        raise FileNotFoundError(
            f"dataset {source!r} not found (pass hub=True to load a hub dataset by name)"
        )
    records, where = [], []
    for name, rows in sources:
        for i, row in enumerate(rows):
            if limit is not None and len(records) >= limit:
                break
            records.append(to_record(row, schema, source=name, row_index=i))
            where.append(f"{name} row {i}")
    if not records:
        raise DataError(f"dataset {source!r} (split {split!r}) is empty")
    check_duplicate_ids(records, where)
    return records


def check_duplicate_ids(records: Sequence[Record], where: Sequence[str]) -> None:
    """DataError if two records share an id but not the answer (`where[i]`: file and row)."""
    from ebpo_jax.rewards import normalize_answer

    first: dict[str, int] = {}
    for i, r in enumerate(records):
        j = first.setdefault(r.id, i)
        if j != i and normalize_answer(records[j].answer) != normalize_answer(r.answer):
            raise DataError(
                f"{where[i]}: id {r.id!r} repeats {where[j]} with another answer "
                f"({r.answer!r} vs {records[j].answer!r}; field 'answer')"
            )


def save_records(records: Sequence[Record], path: str, **extra_columns: Sequence[Any]) -> None:
    """Write records (plus equally long extra columns) as jsonl, loadable with schema "record"."""
    for name, column in extra_columns.items():
        if len(column) != len(records):
            raise ValueError(f"column {name!r} has {len(column)} values for {len(records)} records")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for i, r in enumerate(records):
            row = dataclasses.asdict(r) | {k: v[i] for k, v in extra_columns.items()}
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)  # never a half-written file under the final name
