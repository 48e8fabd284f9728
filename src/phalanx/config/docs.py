"""Render the config reference and the flag table from the schema, for the README and `--help`."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from phalanx.config.loader import FLAT_FLAGS
from phalanx.config.schema import RunConfig


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "")
    if getattr(annotation, "__origin__", None) is typing.Literal:
        return " \\| ".join(repr(a) for a in annotation.__args__)
    return text.replace("<class '", "").replace("'>", "").replace("|", "\\|")


def _rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _rows(ann, prefix + name + ".")
            continue
        default = field.get_default(call_default_factory=True)
        rows.append((prefix + name, _type_name(ann), repr(default), field.description or ""))
    return rows


def config_reference() -> str:
    flags_by_field: dict[str, list[str]] = {}
    for flag, dotted in FLAT_FLAGS.items():
        flags_by_field.setdefault(dotted, []).append(f"`--{flag}`")
    lines = ["| key | type | default | flag | meaning |", "|---|---|---|---|---|"]
    for key, type_name, default, doc in _rows(RunConfig):
        flags = ", ".join(flags_by_field.get(key, [])) or f"`--{key}`"
        lines.append(f"| `{key}` | {type_name} | `{default}` | {flags} | {doc} |")
    return "\n".join(lines)


def flags_table() -> str:
    width = max(len(f) for f in FLAT_FLAGS) + 4
    docs = {key: doc for key, _, _, doc in _rows(RunConfig)}
    lines = [f"  --{flag:<{width}} {dotted}: {docs.get(dotted, '')}" for flag, dotted in FLAT_FLAGS.items()]
    lines.append("\nAny field can also be set by its dotted name, e.g. --training.weight_decay 0.01.")
    return "\n".join(lines)


START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def update_readme(path: str) -> None:
    """Rewrite the block between the config-reference markers of `path` from the schema."""
    from pathlib import Path

    text = Path(path).read_text(encoding="utf-8")
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    Path(path).write_text(f"{head}{START}\n{config_reference()}\n{END}{tail}", encoding="utf-8")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--update"]:
        update_readme(sys.argv[2])
    else:
        print(config_reference())
