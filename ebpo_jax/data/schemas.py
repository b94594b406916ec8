"""Dataset schemas: how each benchmark's rows map onto one `Record` (prompt, answer, topic, difficulty, id).

A field is a dotted path into the row ("reward_model.ground_truth", "prompt.0.content"), or a
tuple of such paths of which the first present one is used (dataset mirrors differ in case
and naming). A custom schema is a plain mapping from record field to path, e.g.
`{"prompt": "q", "answer": "sol.final"}`.
"""

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from ebpo_jax.rewards import last_boxed

Path = str | tuple[str, ...]


class DataError(ValueError):
    """A dataset that cannot be turned into records; the message names the file, row and field."""


@dataclasses.dataclass(frozen=True)
class Record:
    """One problem: `prompt` is the bare problem text (templates add instructions)."""

    prompt: str
    answer: str
    id: str
    topic: str | None = None
    difficulty: float | None = None  # higher is harder


@dataclasses.dataclass(frozen=True)
class Schema:
    """Paths of each record field in a row; `convert` maps a path to its raw-value converter."""

    name: str
    prompt: Path
    answer: Path
    topic: Path | None = None
    difficulty: Path | None = None
    id: Path | None = None
    convert: Mapping[str, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)


def gsm8k_answer(solution: str) -> str | None:
    """The number after GSM8K's "####" marker, commas removed."""
    _, sep, tail = str(solution).rpartition("####")
    if not sep:
        return None
    return tail.strip().replace(",", "") or None


def boxed_answer(solution: str) -> str | None:
    """The last \\boxed{} of a MATH solution."""
    return last_boxed(str(solution))


def math_level(level: Any) -> float | None:
    """MATH's "Level 3" (or 3) as 3.0; "Level ?" as None."""
    m = re.search(r"\d+", str(level))
    return float(m[0]) if m else None


def olympiad_answer(final_answer: Any) -> str | None:
    """OlympiadBench's `final_answer` list (["$x$", "$y$"]) as one comma-joined string."""
    items = final_answer if isinstance(final_answer, list | tuple) else [final_answer]
    parts = [str(a).strip().strip("$").strip() for a in items if a is not None]
    return ", ".join(p for p in parts if p) or None


# DAPO-Math-17k wraps every problem in the paper's instruction; strip it to the bare problem.
_DAPO_PREFIX = re.compile(
    r"^\s*Solve the following math problem.*?\$Answer is the answer to the problem\.\s*", re.DOTALL
)
_DAPO_SUFFIX = re.compile(
    r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$"
)


def dapo_prompt(content: Any) -> str:
    """The bare problem of a DAPO-Math-17k user message."""
    return _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", str(content)))


_PROBLEM = ("problem", "Problem", "question", "Question")
_ANSWER = ("answer", "Answer")
_ID = ("id", "ID", "unique_id", "idx")

SCHEMAS: dict[str, Schema] = {
    s.name: s
    for s in (
        # openai/gsm8k: question, answer = "reasoning ... #### 72"
        Schema("gsm8k", prompt="question", answer="answer", convert={"answer": gsm8k_answer}),
        # hendrycks MATH: problem, solution with \boxed{}, level "Level 3", type "Algebra"
        Schema(
            "math",
            prompt="problem",
            answer=("answer", "solution"),
            topic=("type", "subject"),
            difficulty="level",
            id=_ID,
            convert={"solution": boxed_answer, "level": math_level},
        ),
        # HuggingFaceH4/MATH-500: problem, solution, answer, subject, level (int), unique_id
        Schema(
            "math500",
            prompt="problem",
            answer="answer",
            topic="subject",
            difficulty="level",
            id=_ID,
            convert={"level": math_level},
        ),
        # AIME mirrors: problem/answer/id (lower case) or Problem/Answer/ID
        Schema("aime2024", prompt=_PROBLEM, answer=_ANSWER, id=_ID),
        Schema("aime2025", prompt=_PROBLEM, answer=_ANSWER, id=_ID),
        # AMC23: question (or problem), answer, id
        Schema("amc23", prompt=_PROBLEM, answer=_ANSWER, id=_ID),
        # OlympiadBench: question, final_answer (a list), subfield, id
        Schema(
            "olympiadbench",
            prompt=("question", "problem"),
            answer=("final_answer", "answer"),
            topic=("subfield", "subject"),
            id=_ID,
            convert={"final_answer": olympiad_answer},
        ),
        # DAPO-Math-17k: prompt = [{"role": "user", "content": ...}], reward_model.ground_truth
        Schema(
            "dapo",
            prompt="prompt.0.content",
            answer="reward_model.ground_truth",
            id=("extra_info.index", "id"),
            convert={"prompt.0.content": dapo_prompt},
        ),
        # Files this project writes (e.g. estimate_difficulty's output): the record's own fields.
        Schema(
            "record",
            prompt="prompt",
            answer="answer",
            topic="topic",
            difficulty="difficulty",
            id="id",
        ),
    )
}
SCHEMAS["math-500"] = SCHEMAS["math500"]
SCHEMAS["dapo-math-17k"] = SCHEMAS["dapo"]

_MAPPING_KEYS = ("prompt", "answer", "topic", "difficulty", "id")


def get_schema(spec: "str | Schema | Mapping[str, Any]") -> Schema:
    """A Schema from a known name, a Schema, or a custom field mapping {record field: path}."""
    if isinstance(spec, Schema):
        return spec
    if isinstance(spec, str):
        if spec not in SCHEMAS:
            raise DataError(f"unknown schema {spec!r}; known: {sorted(SCHEMAS)} or a field mapping")
        return SCHEMAS[spec]
    if isinstance(spec, Mapping):
        mapping = dict(spec)
        unknown = set(mapping) - set(_MAPPING_KEYS)
        missing = {"prompt", "answer"} - set(mapping)
        if unknown or missing:
            raise DataError(
                f"custom schema {mapping}: unknown keys {sorted(unknown)}, missing {sorted(missing)}; "
                f"keys are {_MAPPING_KEYS}, prompt and answer required"
            )
        paths = {k: tuple(v) if isinstance(v, list) else v for k, v in mapping.items() if v}
        return Schema(name="custom", **paths)
    raise DataError(f"schema must be a name, a Schema or a field mapping, got {spec!r}")


_MISSING = object()


def _get_path(row: Any, path: str) -> Any:
    """The value at a dotted path ("a.0.b"), or _MISSING."""
    value = row
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif (
            isinstance(value, list | tuple)
            and part.lstrip("-").isdigit()
            and -len(value) <= int(part) < len(value)
        ):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def _lookup(row: Mapping, paths: Path) -> tuple[Any, str]:
    """(value, path) of the first path present with a non-empty value, else (None, all paths)."""
    candidates = (paths,) if isinstance(paths, str) else tuple(paths)
    for path in candidates:
        value = _get_path(row, path)
        if value is not _MISSING and value is not None and value != "":
            return value, path
    return None, " | ".join(candidates)


def to_record(row: Mapping, schema: Schema, *, source: str, row_index: int) -> Record:
    """One row as a Record; a missing prompt or answer raises DataError naming source, row, field."""
    where = f"{source} row {row_index}"

    def field(name: str, paths: Path | None, default=str):
        if paths is None:
            return None, ""
        raw, path = _lookup(row, paths)
        if raw is None:
            return None, path
        try:
            return schema.convert.get(path, default)(raw), path
        except (TypeError, ValueError) as e:
            raise DataError(f"{where}: bad {name} {raw!r} in field {path!r}: {e}") from None

    def required(name: str, paths: Path) -> str:
        value, path = field(name, paths)
        if value is None or str(value).strip() == "":
            raise DataError(
                f"{where}: no {name} (schema {schema.name!r}, field {path!r}); "
                f"the row has keys {sorted(row)}"
            )
        return str(value).strip()

    prompt = required("prompt", schema.prompt)
    answer = required("answer", schema.answer)
    topic, _ = field("topic", schema.topic)
    difficulty, _ = field("difficulty", schema.difficulty, float)
    rid, _ = field("id", schema.id)
    return Record(
        prompt=prompt,
        answer=answer,
        id=rid if rid is not None else f"{source}#{row_index}",
        topic=topic,
        difficulty=None if difficulty is None else float(difficulty),
    )
