"""The tokenized rows a run trains on: `input_ids` and `labels`, int32 lists, one Arrow IPC file per split.

The ranks read the cache through pyarrow's memory map, without importing `datasets` (and pandas behind it): about
0.3-0.5 s less per rank start. `datasets` still reads the sources that need it (a Hub name, a save_to_disk folder).
Rows are fetched as zero-copy slices: `Table.take` and `pa.array` on Python values import pandas to check their input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import pyarrow as pa

COLUMNS = ("input_ids", "labels")
_SCHEMA = pa.schema([(name, pa.list_(pa.int32())) for name in COLUMNS])


class TokenizedRows:
    """A split's rows: `rows[i]` and `rows.__getitems__(indices)` give {column: ids} dicts (the DataLoader asks for
    a micro-batch's rows in one call), `rows["input_ids"]` a whole column as lists."""

    def __init__(self, table: pa.Table, path: Optional[Path] = None):
        self.table = table
        self.path = path  # the file it was read from: a loader worker that is not forked opens it again

    def __reduce__(self):
        if self.path is not None:
            return TokenizedRows.read, (self.path,)
        return TokenizedRows, (self.table,)

    @classmethod
    def from_examples(cls, examples: list[dict]) -> "TokenizedRows":
        columns = {
            name: pa.array([example[name] for example in examples], type=_SCHEMA.field(name).type) for name in COLUMNS
        }
        return cls(pa.table(columns, schema=_SCHEMA))

    @classmethod
    def read(cls, path: Path) -> "TokenizedRows":
        # The table's buffers point into the map, which stays open as long as they are referenced.
        return cls(pa.ipc.open_file(pa.memory_map(str(path))).read_all(), Path(path))

    def write(self, path: Path) -> None:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, _SCHEMA) as writer:
            writer.write_table(self.table)

    @property
    def column_names(self) -> list[str]:
        return self.table.column_names

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, key: Union[int, str]) -> Union[dict, list[list[int]]]:
        if isinstance(key, str):
            return self.table.column(key).to_pylist()
        if not -len(self) <= key < len(self):
            raise IndexError(f"row {key} of {len(self)}")
        return self.table.slice(key % len(self), 1).to_pylist()[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        return [self[index] for index in indices]
