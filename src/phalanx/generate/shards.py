"""The on-disk state of a generation job: per-rank shard files with commit records, a manifest, the merge.

Layout, next to the output file ``data/traj_chat.jsonl``::

    data/traj_chat.jsonl.shards/manifest.json   what the records were made with (rank 0 writes it first)
    data/traj_chat.jsonl.shards/rank-0.jsonl    rank 0's records, a commit line after each batch
    data/traj_chat.jsonl.shards/rank-1.jsonl    ...

A rank appends a batch's records and its commit line ``{"commit": {"batch", "records", "sha256"}}``
in one write and fsyncs. Readers trust a record only when a commit line with the right count and
checksum follows it; whatever comes after the last commit (the batch a killed run was writing) is
ignored, and cut off by the rank that next appends to that file. So a killed run loses at most
its in-flight batch, and a rerun (with any world size) skips every committed (prompt, sequence).

The merge reads all shards, keeps one record per (prompt id, sequence index), sorts them and
writes the output and validation files atomically (temporary file, fsync, rename). The shards
stay, so rerunning a finished command only merges again; delete the folder to reclaim space.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from phalanx.errors import ConfigError, DataError, PhalanxError
from phalanx.runtime.durable import check_can_create, remove_dead_writers, write_json_atomic

MANIFEST = "manifest.json"
FORMAT = 1
LOCK_WAIT_S = 10.0  # how long a rank waits for a shard file that another process still holds


def shard_dir(output: Path) -> Path:
    return output.with_name(output.name + ".shards")


def shard_path(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.jsonl"


def val_output_of(output: Path, val_output: Optional[str], val_fraction: float) -> Optional[Path]:
    """Where a job writes its validation records: none with --val_fraction 0, else --val_output or the default."""
    if val_fraction == 0:
        return None
    return Path(val_output) if val_output else default_val_output(output)


def default_val_output(output: Path) -> Path:
    """NAME_chat.jsonl -> NAME_val.jsonl (seed 001's traj_chat -> traj_val); anything else: NAME_val.jsonl."""
    stem = output.stem[: -len("_chat")] if output.stem.endswith("_chat") else output.stem
    return output.with_name(f"{stem}_val{output.suffix or '.jsonl'}")


# ---------------------------------------------------------------------------- manifest


def check_manifest(
    folder: Path, output: Path, settings: dict, overwrite: bool, val_output: Optional[Path] = None
) -> str:
    """What to do with earlier state: 'fresh', 'resume' or 'overwrite'. Raises ConfigError when it is not ours.

    `val_output` (None: no validation file) is checked as the output is: the merge writes both at the end."""
    manifest = folder / MANIFEST
    for flag, path, example in (("--output", output, "traj_chat"), ("--val_output", val_output, "traj_val")):
        # even with --overwrite: a file is written there at the end, and a folder is not replaced
        if path is not None and path.is_dir():
            raise ConfigError(
                f"{flag} {path} is a folder; give the JSONL file to write, e.g. {flag} {path / example}.jsonl"
            )
    check_can_create(folder, f"--output {output}")  # the shards folder sits beside the output file
    if val_output is not None:
        check_can_create(val_output.parent, f"--val_output {val_output}")
    if overwrite:
        return "overwrite"
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text(encoding="utf-8"))
            before = recorded["settings"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{manifest}: unreadable ({e}); delete {folder} or pass --overwrite true") from None
        if before != settings and not scan_folder(folder):
            # Nothing was committed under the old settings (the job stopped before its first batch: a bad --adapter,
            # a kill while the model loaded): starting over loses nothing, so the new settings start afresh.
            _refuse_files_not_ours(folder, output, val_output)
            return "overwrite"
        if before != settings:
            changed = [
                f"{k}: {before.get(k)!r} before, {settings.get(k)!r} now"
                for k in sorted(set(before) | set(settings))
                if before.get(k) != settings.get(k)
            ]
            raise ConfigError(
                f"{folder} holds records generated with other settings ({'; '.join(changed)}). Rerun with the "
                "earlier settings to resume, choose another --output, or pass --overwrite true to start over."
            )
        check_resumed_val_output(recorded, output, val_output)
        return "resume"
    if folder.exists() and any(folder.iterdir()):
        raise ConfigError(
            f"{folder} already exists and was not written by a phalanx generate run with these settings "
            f"(no {manifest}). Choose another --output, or pass --overwrite true to replace it."
        )
    _refuse_files_not_ours(folder, output, val_output)
    return "fresh"


def _refuse_files_not_ours(folder: Path, output: Path, val_output: Optional[Path]) -> None:
    """A job that starts afresh writes files that did not exist, so one found there is someone else's (a resumed
    job's own earlier merge wrote them)."""
    for path in (output, val_output):
        if path is not None and path.exists():
            raise ConfigError(
                f"{path} already exists and was not written by a phalanx generate run with these settings "
                f"(no {folder / MANIFEST}). Choose another --output, or pass --overwrite true to replace it."
            )


def check_resumed_val_output(recorded: dict, output: Path, val_output: Optional[Path]) -> None:
    """A resumed job may write its validation records elsewhere than before, but not over a file it did not write:
    the files its manifest names ("val_outputs"; a manifest from before they were recorded meant the default beside
    --output) are its own, any other existing file is someone else's."""
    if val_output is None or not val_output.exists():
        return
    own = recorded.get("val_outputs", [str(default_val_output(output).resolve())])
    if str(val_output.resolve()) in own:
        return
    named = ", ".join(own) if own else "none: it has run with --val_fraction 0 only"
    raise ConfigError(
        f"--val_output {val_output} already exists and is not a validation file this job wrote ({named}): the "
        "merge would replace it. Choose a file that does not exist, or one of those, or pass --overwrite true to "
        "start the job over."
    )


def prepare_folder(folder: Path, settings: dict, action: str, val_output: Optional[Path]) -> None:
    """Rank 0, before any rank writes: clear the folder on overwrite, write the manifest on a fresh start. The
    manifest lists the validation files the job writes (check_resumed_val_output): a resume that names another
    one (check_manifest let it: it does not exist yet) adds it, so the same command can be rerun after it."""
    if action == "overwrite" and folder.exists():
        shutil.rmtree(folder)
    own_val = [str(val_output.resolve())] if val_output is not None else []
    if action in ("fresh", "overwrite"):
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / MANIFEST, {"format": FORMAT, "settings": settings, "val_outputs": own_val})
        return
    recorded = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    before = recorded.get("val_outputs", [])
    if any(path not in before for path in own_val):
        write_json_atomic(folder / MANIFEST, {**recorded, "val_outputs": before + own_val})


# ---------------------------------------------------------------------------- shard files


@dataclass(frozen=True)
class Committed:
    key: tuple[int, int]  # (prompt id, sequence index)
    path: Path
    offset: int
    length: int


def scan_shard(path: Path) -> tuple[list[Committed], int]:
    """The committed records of one shard file and the byte offset where its committed part ends."""
    data = path.read_bytes()
    committed: list[Committed] = []
    pending: list[tuple[int, bytes, tuple[int, int]]] = []
    offset = end = 0
    number = 0
    while offset < len(data):
        newline = data.find(b"\n", offset)
        if newline < 0:
            break  # a line cut short by a kill: uncommitted by definition
        line = data[offset : newline + 1]
        number += 1
        try:
            obj = json.loads(line)
            if "commit" in obj:
                info = obj["commit"]
                digest = hashlib.sha256(b"".join(raw for _, raw, _ in pending)).hexdigest()
                if info["records"] != len(pending) or info["sha256"] != digest:
                    raise ValueError(
                        f"commit of batch {info.get('batch')} does not match the {len(pending)} lines before it"
                    )
                committed += [Committed(key, path, start, len(raw)) for start, raw, key in pending]
                pending, end = [], newline + 1
            else:
                meta = obj["metadata"]
                pending.append((offset, line, (int(meta["prompt_id"]), int(meta["sequence_index"]))))
        except (ValueError, KeyError, TypeError) as e:
            if _commit_follows(data, newline + 1):
                raise DataError(
                    f"{path} line {number}: corrupt shard ({e}); delete {path.parent} and "
                    "generate again (or pass --overwrite true)"
                ) from None
            break  # the torn end of the last batch
        offset = newline + 1
    return committed, end


def _commit_follows(data: bytes, offset: int) -> bool:
    # Record lines start with {"messages" or {"text"; only a commit line starts like this.
    return data.find(b'\n{"commit": {"batch": ', offset - 1) >= 0


def scan_folder(folder: Path) -> dict[tuple[int, int], Committed]:
    """Every committed (prompt id, sequence index) across the shard files; the first copy wins."""
    found: dict[tuple[int, int], Committed] = {}
    if folder.is_dir():
        for path in sorted(folder.glob("rank-*.jsonl")):
            for record in scan_shard(path)[0]:
                found.setdefault(record.key, record)
    return found


class ShardWriter:
    """Appends committed batches to one rank's shard file; cuts off an uncommitted tail first.

    The file stays locked while it is open: a rank of an earlier run that is still alive (its
    launcher was killed, not the rank) and a rank of the rerun never write one file together.
    Such a rank stops on its own within a moment (launch.local.watch_launcher_and_peers), so the lock
    is waited for, LOCK_WAIT_S at most, before the rerun gives up.
    """

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "ab")
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                self.file.close()
                raise PhalanxError(
                    f"{path} is being written by another process (still after {LOCK_WAIT_S:.0f} s): is an earlier "
                    "`phalanx generate` with this --output still running? Wait for it or stop it, then rerun."
                ) from None
        end = scan_shard(path)[1]
        self.file.truncate(end)
        self.file.seek(end)

    def commit(self, batch: int, records: Iterable[dict]) -> None:
        lines = [(json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in records]
        body = b"".join(lines)
        mark = {"commit": {"batch": batch, "records": len(lines), "sha256": hashlib.sha256(body).hexdigest()}}
        self.file.write(body + (json.dumps(mark) + "\n").encode("utf-8"))
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


# ---------------------------------------------------------------------------- merge


def _remove_dead_writers_files(path: Path) -> None:
    """A merge killed with SIGKILL leaves its `.NAME.tmp-PID` (as large as the output) where no rerun looked: each
    kill during a merge kept another hidden copy. Those of processes that are gone are removed; a live one's stays."""
    remove_dead_writers(path.parent, f".{path.name}.tmp-")


def val_prompt_ids(num_prompts: int, val_fraction: float, seed: int) -> set[int]:
    """Whole prompts go to validation (all their sequences), so no question is on both sides."""
    if val_fraction <= 0 or num_prompts < 2:
        return set()
    count = min(max(round(val_fraction * num_prompts), 1), num_prompts - 1)
    return set(random.Random(seed).sample(range(num_prompts), count))


def merge(
    folder: Path, expected: list[tuple[int, int]], val_ids: set[int], output: Path, val_output: Optional[Path]
) -> tuple[int, int]:
    """Write the sorted records to output (and validation prompts' to val_output); returns the two counts."""
    found = scan_folder(folder)
    missing = [key for key in expected if key not in found]
    if missing:
        raise DataError(
            f"{folder}: {len(missing)} (prompt, sequence) pairs have no committed record "
            f"(first: {missing[:3]}); rerun the same command to generate them"
        )
    keys = sorted(expected)
    train = [found[k] for k in keys if k[0] not in val_ids]
    val = [found[k] for k in keys if k[0] in val_ids]
    _write_records_atomic(output, train)
    if val_output is not None:
        _write_records_atomic(val_output, val)
    return len(train), len(val)


def _write_records_atomic(path: Path, records: list[Committed]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_writers_files(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    handles: dict[Path, object] = {}
    try:
        with open(tmp, "wb") as out:
            for r in records:
                src = handles.get(r.path) or handles.setdefault(r.path, open(r.path, "rb"))
                src.seek(r.offset)
                out.write(src.read(r.length))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        for f in handles.values():
            f.close()
        if tmp.exists():
            tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
