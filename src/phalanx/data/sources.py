"""Read raw rows, each with its location, from a jsonl or Parquet file, a folder of them, a save_to_disk folder or
load_dataset.

``iter_rows`` yields ``(where, row)``; ``where`` ("data/train.jsonl line 17",
"data/disk row 3", "data/train-00000-of-00001.parquet row 5") starts every error about that row. Lines count
from 1 as editors do, rows of an Arrow dataset or a Parquet file count from 0 as ``dataset[i]`` does.
"""

from __future__ import annotations

import codecs
import itertools
import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional

from phalanx.errors import HUB_ID, DataError, exception_chain
from phalanx.runtime.hub import hub_load_failure, read_hub_from_cache_if_unresolvable

log = logging.getLogger(__name__)

ACCEPTED_PATHS = (
    "accepted: a .jsonl (or .json) file with one JSON object per line, a .parquet file (as the Hub stores datasets), "
    "a folder of *.jsonl / *.parquet files, or a folder written by datasets' save_to_disk"
)
# The files a dataset path may be, and the ones a folder given as a dataset path is read from.
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
FOLDER_FILE_SUFFIXES = (".jsonl", ".parquet")
# save_to_disk writes one of these next to the Arrow files.
DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_disk_dataset(folder: Path) -> bool:
    """Whether `folder` was written by datasets' save_to_disk (read with load_from_disk, not file by file)."""
    return any((Path(folder) / marker).is_file() for marker in DISK_MARKERS)


OnBadRow = Callable[[DataError], None]
# Words that, standing alone in a file's name (traj_val.jsonl, dev-set.jsonl), name a held-out split: the files
# datasets' own folder loading would not put in "train" either.
HELD_OUT_WORDS = frozenset({"val", "valid", "validation", "dev", "eval", "test", "holdout", "heldout"})


def bundled_dataset_path() -> Path:
    """The small tool-calling dataset shipped inside the package (OpenAI ``messages`` + ``tools``)."""
    return Path(__file__).resolve().parent / "bundled" / "health_agent.jsonl"


def iter_rows(
    path_or_name: str | Path,
    *,
    kind: Literal["path", "name"],
    split: str = "train",
    on_bad_row: Optional[OnBadRow] = None,
) -> Iterator[tuple[str, dict]]:
    """Yield ``(where, row)`` for every row of a dataset path (kind="path") or load_dataset name (kind="name").

    A row that cannot be read (malformed JSON, bytes that are not UTF-8, not a JSON object)
    raises DataError, or, when ``on_bad_row`` is given, is handed to it and reading goes on.
    A missing path or a dataset without any rows always raises. ``split`` picks the split of
    a load_dataset name, and of a save_to_disk DatasetDict.
    """
    if kind == "path":
        rows = _iter_path(Path(path_or_name), split)
        label = f"dataset path '{path_or_name}'"
    elif kind == "name":
        ds = load_named_dataset(str(path_or_name), split)
        rows = _iter_arrow(ds, f"{path_or_name} (split '{split}')")
        label = f"dataset '{path_or_name}' (split '{split}')"
    else:
        raise ValueError(f"kind must be 'path' or 'name', not {kind!r}")
    return _checked(rows, label, on_bad_row)


def iter_dataset_rows(ds, label: str) -> Iterator[tuple[str, dict]]:
    """Yield ``(where, row)`` from an already loaded ``datasets.Dataset`` (e.g. from load_named_dataset)."""
    return _checked(_iter_arrow(ds, label), f"dataset '{label}'", None)


def load_named_dataset(name: str, split: str = "train"):
    """``datasets.load_dataset(name, split=split)``; any failure becomes a DataError naming the dataset."""
    import datasets

    refuse_unloadable_name(name)
    if not Path(name).expanduser().exists():  # a Hub id, not a local folder
        read_hub_from_cache_if_unresolvable()
    elif is_disk_dataset(Path(name).expanduser()):
        return saved_split(Path(name).expanduser(), split)
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - missing repo, bad split, bad files: the user's to fix; or no network
        from phalanx.errors import network_failed

        bad_line = first_unreadable_line(Path(name).expanduser())
        if bad_line is not None:
            raise DataError(
                f"dataset '{name}' (split '{split}'): {bad_line}. datasets.load_dataset reads the folder whole, so "
                "one such line stops it whatever on_bad_row says: fix it, or give the files as --dataset_path, "
                "which --on_bad_row skip can read past"
            ) from None
        # What the Hub client said when it was unreachable is enough (hub_failure adds the way on); for anything
        # else the causes say what went wrong.
        said = f"{type(e).__name__}: {e}" if network_failed(e) else describe_causes(e)
        message = f"dataset '{name}' (split '{split}'): datasets.load_dataset failed: {said}"
        if Path(name).expanduser().is_dir() and "Unknown split" in str(e):
            message = message.rstrip(".") + _local_split_hint(Path(name).expanduser())
        raise hub_load_failure(e, message, DataError) from None


def saved_split(folder: Path, split: str):
    """A save_to_disk folder given as dataset_name (seed 000's ./health-agent-dataset, named seed 002's way): read
    with load_from_disk, its split picked as load_dataset's would be. load_dataset read a DatasetDict's split folders
    by chance and refused a single Dataset ("You are trying to load a dataset that was saved using `save_to_disk`.
    Please use `load_from_disk` instead", which no flag does). A single Dataset has no splits: it is the training
    data, and another split asked of it (eval_dataset_split) is refused rather than read as the same rows."""
    import datasets

    saved = _load_from_disk(folder)
    if isinstance(saved, datasets.DatasetDict):
        return _split_of(saved, folder, split)
    if split != "train":
        raise DataError(
            f"dataset '{folder}' (split '{split}'): a save_to_disk Dataset has no splits, so this is none of it; "
            "evaluate on other rows with --eval_dataset_path, or leave the split out to hold out test_size"
        )
    return saved


def _local_split_hint(folder: Path) -> str:
    """How load_dataset split a local folder, for a split it did not find: by its files' names, where a file named
    for no split (seed 001's traj_chat.jsonl beside traj_val.jsonl) is left out of every split once another names one."""
    entries = itertools.islice(folder.rglob("*"), 10_000)  # a dataset folder; a mistyped home folder stays quick
    files = sorted(p.name for p in entries if p.suffix in (*DATA_FILE_SUFFIXES, ".csv") and p.is_file())
    shown = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
    return (
        f". datasets names a local folder's splits by its files' names (train*, test*, validation*/valid*/val*/dev*), "
        f"and leaves out a file named for none once another names one; this folder holds {shown or 'no data files'}. "
        "Give the training file as --dataset_path FILE (and a held-out one as --eval_dataset_path), or rename the "
        "files for their splits"
    )


def first_unreadable_line(folder: Path) -> Optional[DataError]:
    """The first malformed line (bad JSON, not UTF-8, not an object) of the *.jsonl files in a local dataset
    folder, named by file and line; None where there is none or `folder` is not a folder. load_dataset says only
    "An error occurred while generating the dataset" (the file is in a log line, a 0-based row in the cause)."""
    if not folder.is_dir():
        return None
    for file in sorted(p for p in folder.rglob("*.jsonl") if p.is_file()):
        for item in _iter_json_file(file):
            if isinstance(item, DataError):
                return item
    return None


def describe_causes(exc: BaseException) -> str:
    """'DatasetGenerationError: An error occurred ... (ArrowInvalid: JSON parse error ...)': the exception and the
    ones it was raised from, since datasets' own message often says nothing of what went wrong."""
    parts = [f"{type(e).__name__}: {e}" for e in itertools.islice(exception_chain(exc), 3)]
    return parts[0] + "".join(f" ({part})" for part in parts[1:])


def refuse_unloadable_name(name: str) -> None:
    """A dataset_name that is a file, or neither an existing folder nor a Hub id (a mistyped ``./data``), said as such:
    load_dataset would answer with the Hub client's repo-id rules, or "couldn't find any data file" for a file that
    exists."""
    path = Path(name).expanduser()
    if path.is_file():
        raise DataError(
            f"data.dataset_name {name!r} is a file; dataset_name takes a Hub dataset id ('org/name') or a dataset "
            f"folder. Give a file as --dataset_path {name} ({ACCEPTED_PATHS})"
        )
    if not path.exists() and not HUB_ID.fullmatch(name):
        raise DataError(
            f"data.dataset_name {name!r}: no such folder, and not a Hub dataset id ('org/name'). Give an existing "
            f"dataset folder or a Hub id; a jsonl file or save_to_disk folder goes to --dataset_path"
        )


def _checked(rows, label: str, on_bad_row: Optional[OnBadRow]) -> Iterator[tuple[str, dict]]:
    seen = 0
    for item in rows:
        seen += 1
        if isinstance(item, DataError):  # a row-level failure from the readers below
            if on_bad_row is None:
                raise item
            on_bad_row(item)
            continue
        yield item
    if seen == 0:
        raise DataError(f"{label}: no rows; the dataset is empty")


# ---------------------------------------------------------------------------- paths


def _iter_path(path: Path, split: str):
    if not path.exists():
        raise DataError(f"{path}: no such file or folder; {ACCEPTED_PATHS}")
    if path.is_file():
        if path.suffix not in DATA_FILE_SUFFIXES:
            raise DataError(f"{path}: unsupported file type '{path.suffix or '(none)'}'; {ACCEPTED_PATHS}")
        yield from _iter_file(path)
        return
    if is_disk_dataset(path):
        yield from _iter_arrow(*_load_disk(path, split))
        return
    files = folder_data_files(path)
    if not files:
        raise DataError(
            f"{path}: folder holds no *.jsonl or *.parquet files and is not a save_to_disk folder"
            f"{_where_data_files_are(path)}; {ACCEPTED_PATHS}"
        )
    for file in files:
        yield from _iter_file(file)


def folder_data_files(folder: Path) -> list[Path]:
    """The files a folder given as a dataset path is read from: every *.jsonl and *.parquet in it, by name (not its
    subfolders)."""
    return sorted(p for p in folder.iterdir() if p.suffix in FOLDER_FILE_SUFFIXES and p.is_file())


def _where_data_files_are(folder: Path) -> str:
    """A hint for a folder that holds its data a level down (a dataset repository downloaded from the Hub keeps its
    Parquet files in data/, one or more per split): the subfolders that hold data files, or ""."""
    # Two levels down at most: a mistyped path can be a home folder, whose whole tree is no place to search.
    patterns = [f"{levels}*{suffix}" for levels in ("*/", "*/*/") for suffix in FOLDER_FILE_SUFFIXES]
    below = sorted({p.parent for pattern in patterns for p in folder.glob(pattern) if p.is_file()})
    if not below:
        return ""
    shown = ", ".join(str(p) for p in below[:3]) + (f" and {len(below) - 3} more" if len(below) > 3 else "")
    return (
        f" (its subfolders do: give one of {shown}, or the folder as --dataset_name, which load_dataset reads by split)"
    )


def _iter_file(path: Path):
    return _iter_parquet(path) if path.suffix == ".parquet" else _iter_json_file(path)


def held_out_split_word(file: Path) -> Optional[str]:
    """The held-out split `file`'s name marks ("val" for traj_val.jsonl), if any."""
    words = set(re.split(r"[^a-z0-9]+", file.stem.lower()))
    return next((w for w in sorted(HELD_OUT_WORDS) if w in words), None)


def refuse_held_out_files_among_training_files(train_path: str, eval_path: Optional[str]) -> None:
    """A folder given as data.dataset_path is read whole (every *.jsonl and *.parquet), so a held-out file inside it would be
    trained on: the eval file itself (then scored on rows the run trained on), or a file whose name marks a held-out
    split (seed 001's data/ holds traj_chat.jsonl and traj_val.jsonl). Both are refused, naming the file and the
    training file(s) to point at instead. A folder of held-out files only is taken as meant. The training file
    given again as the eval file is refused too: every eval row would be one the run trained on."""
    folder = Path(train_path)
    if eval_path and folder.is_file() and folder.resolve() == Path(eval_path).resolve():
        raise DataError(
            f"data.eval_dataset_path {eval_path} is the training file data.dataset_path {train_path}: the run would be "
            "scored on rows it trained on. Give a held-out file (phalanx generate writes one beside its output, e.g. "
            "data/traj_val.jsonl), or leave eval_dataset_path out to hold out data.test_size of the rows"
        )
    if not folder.is_dir() or is_disk_dataset(folder):
        return
    files = folder_data_files(folder)
    eval_file = Path(eval_path).resolve() if eval_path else None
    named = [f for f in files if held_out_split_word(f) and f.resolve() != eval_file]
    training = [f for f in files if f not in named and f.resolve() != eval_file]
    instead = (
        f"Point data.dataset_path at the training file{'s' if len(training) > 1 else ''} (e.g. {training[0]})"
        if training
        else f"{folder} holds no other data file to train on"
    )
    if any(f.resolve() == eval_file for f in files):
        raise DataError(
            f"data.eval_dataset_path {eval_path} is one of the *.jsonl / *.parquet files that data.dataset_path "
            f"{folder} reads for training: its rows would be trained on and then scored. {instead}, or move the eval "
            f"file out of {folder}"
        )
    if named and training:
        raise DataError(
            f"data.dataset_path {folder} is a folder, and every *.jsonl and *.parquet in it is trained on, "
            f"{named[0].name} too, "
            f"whose name marks a held-out split ('{held_out_split_word(named[0])}'): its rows would be trained on. "
            f"{instead} and, to score the held-out rows, data.eval_dataset_path at {named[0]}; or move or rename it "
            "if it is training data"
        )


def _iter_json_file(path: Path):
    """One JSON object per line; a .json file that is one JSON array is read as a list of rows."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}") from None
    with f:
        start = len(codecs.BOM_UTF8) if f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8 else 0
        f.seek(start)  # past the byte-order mark Windows editors write at the start of a UTF-8 file
        if path.suffix == ".json" and f.read(64).lstrip()[:1] == b"[":
            f.seek(start)
            yield from _iter_json_array(path, f.read())
            return
        f.seek(start)
        for number, raw in enumerate(f, start=1):
            where = f"{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield DataError(
                    f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the line); "
                    "save the file as UTF-8"
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield DataError(
                    f"{where}: malformed JSON: {e.msg} at column {e.colno}; each line must be one JSON object"
                )
                continue
            if not isinstance(row, dict):
                yield DataError(f"{where}: expected a JSON object, found {type(row).__name__} {line.strip()[:60]}")
                continue
            yield where, row


def _iter_json_array(path: Path, data: bytes):
    try:
        rows = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte 0x{data[e.start]:02x} at byte offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: malformed JSON: {e.msg} at column {e.colno}") from None
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        if isinstance(row, dict):
            yield where, row
        else:
            yield DataError(f"{where}: expected a JSON object, found {type(row).__name__}")


def _iter_parquet(path: Path, batch_size: int = 1000):
    """The rows of a Parquet file, a batch at a time (pyarrow, which datasets reads Parquet with too), as_written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=batch_size)
        index = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{path} row {index}", as_written(row)
                index += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot be read as Parquet: {e}") from None


# ---------------------------------------------------------------------------- Arrow datasets


def _load_from_disk(path: Path):
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - any failure here is a bad dataset folder
        raise DataError(f"{path}: cannot be loaded with datasets.load_from_disk: {type(e).__name__}: {e}") from None


def _split_of(saved, path: Path, split: str):
    """`split` of a DatasetDict read from `path`, or a DataError naming the splits it has."""
    if split not in saved:
        raise DataError(f"{path}: a DatasetDict without a '{split}' split (splits: {', '.join(saved)})")
    log.info("%s is a DatasetDict: using its '%s' split", path, split)
    return saved[split]


def _load_disk(path: Path, split: str):
    import datasets

    ds = _load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        return _split_of(ds, path, split), f"{path} (split '{split}')"
    return ds, str(path)


def _iter_arrow(ds, label: str, batch_size: int = 1000):
    index = 0
    # Reading column batches is much faster than ds[i] one row at a time.
    for batch in ds.iter(batch_size=batch_size):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            yield f"{label} row {index}", as_written(dict(zip(columns, values)))
            index += 1


def as_written(row: dict) -> dict:
    """A row read from Arrow storage (Parquet, save_to_disk, load_dataset) without the nulls Arrow's one schema per
    column adds: every struct holds every field any row's struct has, None where it had none. So each tool's
    `parameters.properties` listed every other tool's parameters as null, dict arguments of a call every other call's
    (the model learned to write `"city": null` into every call), and each message every other message's keys (a
    `tool_calls: None` that a template testing `'tool_calls' in message` loops over). Arrow cannot tell a null written
    from a field absent; a null JSON Schema keyword or argument value is rare, these are in every row. A message's
    `content` keeps its None: OpenAI's form of a tool-calling message without text."""
    cleaned = {}
    for key, value in row.items():
        if value is None:
            continue
        if key in ("messages", "conversations") and isinstance(value, list):
            value = [_message_as_written(m) for m in value]
        else:
            value = _without_nulls(value)
        cleaned[key] = value
    return cleaned


def _message_as_written(message):
    if not isinstance(message, dict):
        return message
    return {k: _without_nulls(v) for k, v in message.items() if v is not None or k == "content"}


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
