"""Records from local json/jsonl/parquet files (or, on an online machine, a hub dataset) via `datasets`.

Local files are the default and all that tests use. A hub name ("HuggingFaceH4/MATH-500")
is only tried with `hub=True`, so a mistyped local path fails with "not found" rather than
a network call. Hub names the schemas were written for:
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

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _files(source: str) -> list[str]:
    """The data files of a file or directory path, in sorted order."""
    if os.path.isdir(source):
        found = sorted(
            os.path.join(source, f)
            for f in os.listdir(source)
            if os.path.splitext(f)[1].lower() in FORMATS
        )
        if not found:
            raise DataError(f"directory {source!r} has no {sorted(FORMATS)} files")
        return found
    if os.path.splitext(source)[1].lower() not in FORMATS:
        raise DataError(f"{source!r}: unsupported file type; supported: {sorted(FORMATS)}")
    return [source]


def _rows_of_file(path: str, field: str | None) -> Iterable[Mapping[str, Any]]:
    import datasets  # slow import, only when loading

    builder = FORMATS[os.path.splitext(path)[1].lower()]
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
    if os.path.exists(source):
        sources = [(path, _rows_of_file(path, field)) for path in _files(source)]
    elif hub:
        import datasets

        sources = [(f"{source}[{split}]", datasets.load_dataset(source, hub_config, split=split))]
    else:
        raise FileNotFoundError(
            f"dataset {source!r} not found (pass hub=True to load a hub dataset by name)"
        )
    records = []
    for name, rows in sources:
        for i, row in enumerate(rows):
            if limit is not None and len(records) >= limit:
                break
            records.append(to_record(row, schema, source=name, row_index=i))
    if not records:
        raise DataError(f"dataset {source!r} (split {split!r}) is empty")
    return records


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
