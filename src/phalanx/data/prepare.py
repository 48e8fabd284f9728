"""The data pipeline: read rows, normalise, render + tokenize with the loss mask, apply max_length, split, cache.

Tokenization runs once per (source content, tokenizer, data settings, seed) and is stored under
``cache_root/<key>``. The key hashes:

- the source: jsonl and Parquet files and save_to_disk folders by the content (blake2b) of every file up to
  64 MiB and by size + mtime for larger files; a ``dataset_name`` by the fingerprint
  ``datasets.load_dataset`` gives the loaded split (it follows the files / Hub revision);
- the tokenizer: class, vocabulary (size and a hash of token -> id), special tokens, chat template;
- the DataConfig fields that shape the result, the seed and CACHE_VERSION.

The folder is written under ``<key>.tmp-*`` and renamed into place with ``os.replace`` while a
``filelock.FileLock`` is held, so when several processes on one machine (the ranks of a job)
call ``prepare_data`` together one of them tokenizes and the others wait and load its result.
A folder that exists is complete. (FileLock on network file systems is only as good as their
locking; give each machine a local ``cache_root`` when in doubt.)
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Optional

from filelock import FileLock

from phalanx.config.chat_templates import (
    EVERY,
    WITH_SYSTEM,
    WITHOUT_SYSTEM,
    template_text,
    template_variables,
    variables_written_empty,
    written_empty_notes,
)
from phalanx.config.schema import BUNDLED_DATASET, DataConfig
from phalanx.data.chat import IGNORE_INDEX, Tokenized, tokenize_conversation
from phalanx.data.formats import detect_format, to_conversation
from phalanx.data.rows import TokenizedRows
from phalanx.data.sources import (
    ACCEPTED_PATHS,
    bundled_dataset_path,
    folder_data_files,
    is_disk_dataset,
    iter_dataset_rows,
    iter_rows,
    load_named_dataset,
    refuse_held_out_files_among_training_files,
)
from phalanx.errors import DataError, PhalanxError
from phalanx.runtime.durable import fsync_tree

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # bump when the cache layout changes meaning (a change in masking code changes the key itself)
MAX_SKIP_REASONS = 10
_HASH_CONTENT_UP_TO = 64 * 2**20


@dataclass
class DataReport:
    """What happened to the rows. Counts cover the training source and, when set, the evaluation source
    (eval_dataset_path or eval_dataset_split)."""

    rows_read: int  # rows and lines read, unreadable ones included
    rows_skipped: int  # bad rows skipped under on_bad_row="skip"
    skip_reasons: list[str]  # the first few skip messages
    rows_truncated: int  # cut to max_length
    rows_shortened: int  # fitted by leaving out their oldest exchanges (truncation keep_recent)
    rows_dropped: int  # longer than max_length under truncation="drop", or no target token left
    drop_reasons: dict[str, int]  # why rows were dropped, with counts
    length_tokens: dict[str, int]  # tokenized row lengths before max_length: min, median, p90, max
    conversations_full: int  # chat rows trained as one row (multi_turn full)
    conversations_per_turn: int  # chat rows split into one row per assistant turn (multi_turn per_turn)
    per_turn_reason: Optional[str]  # why auto chose per_turn, for the first such row
    reasoning_dropped: int  # assistant messages whose reasoning the chat template does not render
    system_dropped: int  # conversations whose system prompt the chat template does not render
    tools_dropped: int  # conversations whose tool schemas the chat template does not render
    unterminated_turns: int  # assistant turns the template ends with no marker after the text (no stop is trained)
    train_rows: int
    eval_rows: int
    train_target_tokens: int
    cache_hit: bool
    cache_dir: str
    # the chat template's own switches (config.chat_templates.template_variables), named when turns are unterminated:
    # some templates write the end-of-turn marker only when one is set (Apriel's training_prompt)
    template_variables: list[str] = field(default_factory=list)
    # variables the chat template writes into its text that nothing set, so the rows have them as empty text, each
    # with the rows it writes it into (config.chat_templates.variables_written_empty), where there are such rows
    variables_written_empty: dict[str, str] = field(default_factory=dict)
    # chat rows whose first message is not a system message (None: a cache written before this was counted)
    conversations_without_system: Optional[int] = None
    # markers that end trained turns but are no token of this tokenizer, in turns that train no end-of-sequence token
    # (data.chat.Tokenized.foreign_end_markers): marker -> turns
    foreign_end_markers: dict[str, int] = field(default_factory=dict)
    # tokens that end trained turns other than the tokenizer's end-of-sequence token (data.chat.Tokenized.end_tokens):
    # token -> turns
    turn_end_tokens: dict[str, int] = field(default_factory=dict)
    # those the model does not stop at (add_template_notes, each run): token -> (turns, its id), and what it stops at
    unstopped_end_tokens: dict[str, list[int]] = field(default_factory=dict)
    stop_tokens: list[str] = field(default_factory=list)
    # special tokens' text written in the rows, encoded as ordinary text (data.special_token_text): text -> occurrences
    special_texts: dict[str, int] = field(default_factory=dict)


@dataclass
class PreparedData:
    train: TokenizedRows
    eval: Optional[TokenizedRows]
    report: DataReport
    # config field -> what its local files hold (source_digest), recorded in each checkpoint: a resume on data that
    # changed since is refused unless --force. Hub datasets are left out: their fingerprint follows the local cache.
    # data.chat_template: the text of the template the rows were rendered with (the model's own when it is unset).
    sources: dict[str, str] = field(default_factory=dict)


CHAT_TEMPLATE_SOURCE = "data.chat_template"


def prepare_data(
    cfg: DataConfig, tokenizer: Any, *, seed: int, cache_root: Path, stop_token_ids: Collection[int] = ()
) -> PreparedData:
    """Tokenized train (and eval) sets for ``cfg``, from the cache when an identical run made them before.
    `stop_token_ids`: what the model's generation config stops at, besides the tokenizer's end-of-sequence token."""
    data = _cached_or_built(cfg, tokenizer, seed, Path(cache_root))
    add_template_notes(data.report, cfg, tokenizer, stop_token_ids)
    template = getattr(tokenizer, "chat_template", None)
    if template:  # a template file edited between a kill and the rerun masks the rows otherwise from there
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        data.sources[CHAT_TEMPLATE_SOURCE] = hashlib.sha256(text.encode()).hexdigest()[:20]
    return data


def _cached_or_built(cfg: DataConfig, tokenizer: Any, seed: int, cache_root: Path) -> PreparedData:
    train_source = DataSource.for_training(cfg)
    if train_source.kind == "path":
        refuse_held_out_files_among_training_files(train_source.target, cfg.eval_dataset_path)
    eval_source = DataSource.for_evaluation(cfg)
    train_identity = train_source.identity()
    eval_identity = eval_source.identity() if eval_source else None
    key = _cache_key(cfg, tokenizer, seed, train_identity, eval_identity)
    final = cache_root / key
    sources = {
        source.field: source_digest(identity)
        for source, identity in ((train_source, train_identity), (eval_source, eval_identity))
        if source is not None and source.kind == "path"
    }
    if final.is_dir():  # rename is atomic: an existing folder is complete
        return _load(final, cache_hit=True, sources=sources)
    cache_root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_root / f"{key}.lock")):
        if final.is_dir():  # another process built it while we waited
            return _load(final, cache_hit=True, sources=sources)
        for stale in cache_root.glob(f"{key}.tmp-*"):  # left by a process that died mid-write
            shutil.rmtree(stale, ignore_errors=True)
        train, eval_, report = _build(cfg, tokenizer, seed, train_source, eval_source)
        tmp = cache_root / f"{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            TokenizedRows.from_examples(train).write(tmp / "train.arrow")
            if eval_ is not None:
                TokenizedRows.from_examples(eval_).write(tmp / "eval.arrow")
            (tmp / "report.json").write_text(json.dumps(report, indent=2))
            fsync_tree(tmp)
            os.replace(tmp, final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno in DISK_REFUSED:
                raise cache_not_writable(cache_root, exc) from None
            raise
    return _load(final, cache_hit=False, sources=sources)


def add_template_notes(
    report: DataReport, cfg: DataConfig, tokenizer: Any, stop_token_ids: Collection[int] = ()
) -> None:
    """What the report says of the chat template itself, found again on every run (a few renderings): so a cache made
    before phalanx looked for it says it too. And which tokens that end trained turns the model does not stop at
    (`stop_token_ids`: its generation config's end-of-sequence ids; the tokenizer's own counts too)."""
    stops = {i for i in (getattr(tokenizer, "eos_token_id", None), *stop_token_ids) if isinstance(i, int)}
    report.stop_tokens = [f"{tokenizer.convert_ids_to_tokens(i)!r} ({i})" for i in sorted(stops)]
    report.unstopped_end_tokens = {}
    for token, turns in report.turn_end_tokens.items():
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id not in stops:
            report.unstopped_end_tokens[token] = [turns, token_id]
    if report.conversations_full or report.conversations_per_turn:  # chat rows went through the template
        chats = report.conversations_full + report.conversations_per_turn
        without = report.conversations_without_system
        rows_in = {EVERY: chats, WITHOUT_SYSTEM: without, WITH_SYSTEM: None if without is None else chats - without}
        report.variables_written_empty = {
            name: scope
            for name, scope in variables_written_empty(tokenizer, cfg.chat_template_kwargs).items()
            if rows_in[scope] != 0  # a default system prompt's variable, where every row brings its own: unused
        }


# ---------------------------------------------------------------------------- sources


@dataclass
class DataSource:
    """Where rows come from: a path (jsonl or Parquet file, folder, save_to_disk) or a datasets name; its identity
    keys the cache."""

    kind: str  # "path" or "name"
    target: str
    split: str = "train"
    dataset: Any = None  # the loaded datasets.Dataset of a "name" source
    field: str = "data.dataset_path"  # the config field that named it, for the messages

    @classmethod
    def for_training(cls, cfg: DataConfig) -> "DataSource":
        if cfg.dataset_name and cfg.dataset_name != BUNDLED_DATASET:
            ds = load_named_dataset(cfg.dataset_name, cfg.dataset_split)
            return cls("name", cfg.dataset_name, cfg.dataset_split, ds)
        if cfg.dataset_path and cfg.dataset_path != BUNDLED_DATASET:
            return cls.path(cfg.dataset_path)
        bundled = bundled_dataset_path()
        if not bundled.is_file():
            raise DataError(
                f"the bundled dataset is missing from the installation ({bundled}); reinstall phalanx or set dataset_path"
            )
        return cls.path(str(bundled))

    @classmethod
    def for_evaluation(cls, cfg: DataConfig) -> Optional["DataSource"]:
        """A separate evaluation source: eval_dataset_path, or eval_dataset_split of dataset_name (None: test_size
        of the training rows is held out)."""
        if cfg.eval_dataset_path:
            return cls.path(cfg.eval_dataset_path, "data.eval_dataset_path")
        if cfg.eval_dataset_split and cfg.dataset_name:
            ds = load_named_dataset(cfg.dataset_name, cfg.eval_dataset_split)
            return cls("name", cfg.dataset_name, cfg.eval_dataset_split, ds, field="data.eval_dataset_split")
        return None

    @classmethod
    def path(cls, path: str, field: str = "data.dataset_path") -> "DataSource":
        return cls("path", path, field=field)

    def rows(self, on_bad_row):
        if self.kind == "name":
            return iter_dataset_rows(self.dataset, f"{self.target} (split '{self.split}')")
        return iter_rows(self.target, kind="path", on_bad_row=on_bad_row)

    def identity(self) -> dict:
        if self.kind == "name":
            return {"name": self.target, "split": self.split, "fingerprint": self.dataset._fingerprint}
        root = Path(self.target)
        if not root.exists():
            raise DataError(f"{self.field} = {str(root)!r}: no such file or folder; {ACCEPTED_PATHS}")
        if root.is_file():
            files = [root]
        elif is_disk_dataset(root):  # save_to_disk: every file
            files = sorted(p for p in root.rglob("*") if p.is_file())
        else:  # a folder of jsonl and Parquet files: the files that are read
            files = folder_data_files(root)
        return {"path": str(root), "files": [_file_identity(p, root) for p in files]}


def _file_identity(path: Path, root: Path) -> list:
    stat = path.stat()
    name = str(path.relative_to(root)) if path != root else path.name
    if stat.st_size > _HASH_CONTENT_UP_TO:
        return [name, stat.st_size, stat.st_mtime_ns]
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return [name, stat.st_size, digest.hexdigest()]


# What a disk says when it takes no more: full, over quota, read-only, not this user's.
DISK_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def disk_refusal(exc: BaseException) -> Optional[OSError]:
    """The full, over-quota or read-only disk `exc` reports, as an OSError; None for any other failure. safetensors
    reports one as its own error, with the OS error's number in the text ('... (os error 28)')."""
    if isinstance(exc, OSError):
        return exc if exc.errno in DISK_REFUSED else None
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found and int(found.group(1)) in DISK_REFUSED:
        return OSError(int(found.group(1)), os.strerror(int(found.group(1))))
    return None


def cache_not_writable(cache_root: Path, exc: OSError, what: str = "the tokenized data") -> PhalanxError:
    """`what` could not be written into the cache. Said of output_dir by the run's catch-all for a full disk ('rank 0
    cannot write to output_dir ...: No space left on device (None)'): a user who freed space there met the same error
    again."""
    free_mb = shutil.disk_usage(cache_root).free / 2**20
    return PhalanxError(
        f"cannot write {what} into phalanx's cache {cache_root}: {os.strerror(exc.errno)} (free space "
        f"there: {free_mb:.1f} MB). That is the cache folder (PHALANX_CACHE, by default ~/.cache/phalanx), not "
        "output_dir: free space there, or set PHALANX_CACHE to a folder with room on a local disk, then rerun the same "
        "command."
    )


def source_digest(identity: dict) -> str:
    """What a path source holds, from its DataSource.identity(), however its path is spelled (`data/a.jsonl` or
    `/home/me/data/a.jsonl`) and wherever a copy lies (each node's own disk): its files' names within a folder, their
    sizes and contents; for a file over 64 MiB, which is not read for this, its size alone (its modification time
    differs between copies)."""
    single_file = len(identity["files"]) == 1 and identity["files"][0][0] == Path(identity["path"]).name
    files = [[*entry[:2], *([] if isinstance(entry[2], int) else entry[2:])] for entry in identity["files"]]
    if single_file:
        files = [entry[1:] for entry in files]  # a file's own name is its path's, which the config compares
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:20]


# ---------------------------------------------------------------------------- cache key


def _cache_key(cfg: DataConfig, tokenizer: Any, seed: int, train: dict, eval_: Optional[dict]) -> str:
    """`train`, `eval_`: the sources' DataSource.identity()."""
    identity = {
        "version": CACHE_VERSION,
        "code": _tokenizing_code_digest(),
        "train": train,
        "eval": eval_,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "config": {
            "format": cfg.format,
            "max_length": cfg.max_length,
            "truncation": cfg.truncation,
            "on_bad_row": cfg.on_bad_row,
            "multi_turn": cfg.multi_turn,
            "chat_template_kwargs": cfg.chat_template_kwargs,
            "special_token_text": cfg.special_token_text,
            "test_size": None if eval_ else cfg.test_size,
        },
        "seed": seed,
    }
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


@functools.cache
def _tokenizing_code_digest() -> str:
    """A hash of the modules that turn rows into ids and labels: a phalanx whose reading or masking changed (a template handled
    differently) re-tokenizes instead of training on rows an older version masked."""
    from phalanx.data import chat, formats, sources, special_text

    digest = hashlib.blake2b(digest_size=16)
    for module in (chat, formats, sources, special_text):  # sources: what a row read from Arrow storage holds
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides token ids: class, vocabulary, special tokens and chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    parts = {
        "class": type(tokenizer).__name__,
        "len": len(tokenizer),
        "vocab_size": getattr(tokenizer, "vocab_size", None),
        "vocab": hashlib.sha256(json.dumps(vocab).encode()).hexdigest(),
        "special": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())},
        "special_ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, getattr(tokenizer, "pad_token_id", None)],
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------------------- build


class RowCounts:
    """What happened to the rows of one preparation (train and eval sources together); becomes the DataReport."""

    def __init__(self) -> None:
        self.read = self.skipped = self.truncated = self.dropped = 0
        self.reasons: list[str] = []
        self.drop_reasons: dict[str, int] = {}
        self.lengths: list[int] = []
        self.policies = {"full": 0, "per_turn": 0, "text": 0}
        self.per_turn_reason: Optional[str] = None
        self.reasoning_dropped = self.system_dropped = self.tools_dropped = self.unterminated = 0
        self.foreign_end_markers: dict[str, int] = {}
        self.end_tokens: dict[str, int] = {}
        self.special_texts: dict[str, int] = {}
        self.without_system = 0  # chat rows whose first message is not a system message
        self.shortened = 0  # rows that fit after their oldest exchanges were left out (truncation keep_recent)
        self.on_refusal: Optional[Callable[[DataError], None]] = None  # `phalanx data preview` prints each one

    def tokenized(self, result: Tokenized, where: str) -> None:
        self.policies[result.policy] += 1
        if result.notes and self.per_turn_reason is None:
            self.per_turn_reason = f"{where}: {result.notes[0]}"
        self.reasoning_dropped += result.reasoning_dropped
        self.system_dropped += int(result.system_dropped)
        self.tools_dropped += int(result.tools_dropped)
        self.unterminated += result.unterminated
        for marker, turns in result.foreign_end_markers.items():
            self.foreign_end_markers[marker] = self.foreign_end_markers.get(marker, 0) + turns
        for token, turns in result.end_tokens.items():
            self.end_tokens[token] = self.end_tokens.get(token, 0) + turns
        for text, times in result.special_texts.items():
            self.special_texts[text] = self.special_texts.get(text, 0) + times

    def drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1

    def skip(self, error: DataError) -> None:
        self.read += 1  # unreadable lines count as read
        self.refuse(error)

    def refuse(self, error: DataError) -> None:
        self.skipped += 1
        if len(self.reasons) < MAX_SKIP_REASONS:
            self.reasons.append(str(error))
        if self.on_refusal is not None:
            self.on_refusal(error)

    def report(self, train: list[dict], eval_: Optional[list[dict]]) -> dict:
        """The DataReport fields (less the cache's) for these counts and the rows that train."""
        return {
            "rows_read": self.read,
            "rows_skipped": self.skipped,
            "skip_reasons": self.reasons,
            "rows_truncated": self.truncated,
            "rows_shortened": self.shortened,
            "rows_dropped": self.dropped,
            "drop_reasons": self.drop_reasons,
            "length_tokens": _length_stats(self.lengths),
            "conversations_full": self.policies["full"],
            "conversations_per_turn": self.policies["per_turn"],
            "per_turn_reason": self.per_turn_reason,
            "reasoning_dropped": self.reasoning_dropped,
            "system_dropped": self.system_dropped,
            "tools_dropped": self.tools_dropped,
            "unterminated_turns": self.unterminated,
            "foreign_end_markers": self.foreign_end_markers,
            "turn_end_tokens": self.end_tokens,
            "special_texts": self.special_texts,
            "conversations_without_system": self.without_system,
            "train_rows": len(train),
            "eval_rows": len(eval_) if eval_ else 0,
            "train_target_tokens": sum(sum(1 for t in ex["labels"] if t != IGNORE_INDEX) for ex in train),
        }


def _build(cfg: DataConfig, tokenizer: Any, seed: int, train_source: DataSource, eval_source: Optional[DataSource]):
    counts = RowCounts()
    rows, n_rows = _tokenize_source(train_source, cfg, tokenizer, counts)
    if eval_source is not None:
        train = [ex for _, ex in rows]
        eval_ = [ex for _, ex in _tokenize_source(eval_source, cfg, tokenizer, counts)[0]] or None
    else:
        train, eval_ = _split(rows, cfg.test_size, seed, n_rows)
    if not train:
        raise DataError(
            f"{train_source.target}: no usable training rows ({counts.read} read, {counts.skipped} skipped, "
            f"{counts.dropped} dropped, {len(eval_ or [])} held out for evaluation)"
            + (f"; dropped: {describe_drops(counts.drop_reasons, cfg)}" if counts.dropped else "")
            + (f"; row lengths {describe_lengths(_length_stats(counts.lengths))}" if counts.lengths else "")
            + (f"; first problem: {counts.reasons[0]}" if counts.reasons else "")
            + (
                f"; every usable row was held out by data.test_size {cfg.test_size}: give more rows, "
                "--test_size 0, or a separate --eval_dataset_path (or --eval_dataset_split)"
                if eval_ and eval_source is None
                else ""
            )
        )
    report = counts.report(train, eval_)
    if counts.unterminated:
        report["template_variables"] = template_variables(template_text(getattr(tokenizer, "chat_template", None)))
    if counts.skipped:
        log.warning("skipped %d bad rows; first: %s", counts.skipped, counts.reasons[0])
    return train, eval_, report


def _tokenize_source(source: DataSource, cfg: DataConfig, tokenizer: Any, counts: RowCounts):
    """``(index, example)`` for every usable row, and the number of readable rows the index counts."""
    out, n_rows = [], 0
    for outcome in iter_outcomes(source, cfg, tokenizer, counts):
        n_rows = outcome.index + 1
        if outcome.error is not None and cfg.on_bad_row != "skip":
            raise outcome.error
        out += [(outcome.index, example) for example in outcome.examples]  # per_turn rows share their source index
    return out, n_rows


@dataclass
class RowOutcome:
    """What one readable source row became."""

    index: int  # among the readable rows of the source
    where: str  # e.g. "train.jsonl line 7"
    tokenized: Optional[Tokenized]  # None when the row was refused
    examples: list[dict]  # the rows that train, after max_length (fewer than tokenized has when some were dropped)
    error: Optional[DataError] = None  # why the row was refused


def iter_outcomes(source: DataSource, cfg: DataConfig, tokenizer: Any, counts: RowCounts):
    """Every readable row of ``source``, converted, rendered, masked and fitted to max_length; refusals are
    yielded (and counted as skipped) rather than raised, so the caller decides between stopping and skipping."""
    fmt, detected_at = cfg.format, None
    index = -1
    for where, row in source.rows(counts.skip if cfg.on_bad_row == "skip" else None):
        counts.read += 1
        index += 1
        try:
            if fmt == "auto":  # the first readable row decides for the whole source
                fmt, detected_at = detect_format(row, where), where
            conv = _convert(row, where, fmt, detected_at)
            result = tokenize_conversation(
                tokenizer, conv, where, cfg.multi_turn, cfg.chat_template_kwargs, cfg.special_token_text
            )
            counts.lengths += [len(ex["input_ids"]) for ex in result.examples]  # as rendered, before max_length
            if cfg.truncation == "keep_recent" and _too_long(result.examples, cfg):
                result = _keep_recent(tokenizer, conv, result, where, cfg, counts)
        except DataError as e:
            counts.refuse(e)
            yield RowOutcome(index, where, None, [], e)
            continue
        counts.tokenized(result, where)
        if result.policy != "text":
            counts.without_system += not conv.get("messages") or conv["messages"][0].get("role") != "system"
        fitted = (_fit(example, cfg, where, counts) for example in result.examples)
        yield RowOutcome(index, where, result, [ex for ex in fitted if ex is not None])


def _convert(row: dict, where: str, fmt: str, detected_at: Optional[str]):
    try:
        return to_conversation(row, where, fmt)
    except DataError as e:
        if detected_at and detected_at != where:
            try:
                own = detect_format(row, where)
            except DataError:
                own = None
            if own and own != fmt:
                raise DataError(
                    f"{e} (this row looks like format '{own}', but format '{fmt}' was detected from the first "
                    f"row, {detected_at}; all rows of a dataset share one format)"
                ) from None
        raise


def _fit(example: dict, cfg: DataConfig, where: str, counts: RowCounts) -> Optional[dict]:
    """Apply max_length / truncation; drop a row with no target token left."""
    n = len(example["input_ids"])
    if n > cfg.max_length:
        if cfg.truncation == "error":
            raise DataError(
                f"{where}: {n} tokens, longer than max_length={cfg.max_length}; raise max_length, "
                "or set truncation to 'truncate' or 'drop'"
            )
        if cfg.truncation == "drop":
            counts.drop(DROP_TOO_LONG)
            return None
        counts.truncated += 1
        example = {k: v[: cfg.max_length] for k, v in example.items()}
        if all(t == IGNORE_INDEX for t in example["labels"]):
            counts.drop(DROP_TRUNCATED_AWAY)
            return None
    if all(t == IGNORE_INDEX for t in example["labels"]):
        counts.drop(DROP_NO_TARGET)
        return None
    return example


DROP_TOO_LONG = "longer than max_length"
DROP_TRUNCATED_AWAY = "no assistant token left within max_length"
DROP_NO_TARGET = "no assistant token to train on"


def describe_drops(reasons: dict[str, int], cfg: DataConfig) -> str:
    """Each drop reason with its count and what to change."""
    remedies = {
        DROP_TOO_LONG: f"truncation 'drop' with max_length {cfg.max_length}: raise max_length, or set truncation 'truncate'",
        DROP_TRUNCATED_AWAY: f"cut at max_length {cfg.max_length} before its first assistant token: raise max_length"
        + (
            ", or set truncation 'keep_recent' to leave out the oldest exchanges of long conversations instead (it"
            " cannot shorten a first exchange, nor a long system prompt the template writes)"
            if cfg.truncation != "keep_recent"
            else ""
        ),
        DROP_NO_TARGET: "every assistant turn renders to nothing the loss can train on",
    }
    return "; ".join(f"{n} {reason} ({remedies.get(reason, '')})" for reason, n in reasons.items())


def describe_report(report: DataReport, cfg: DataConfig, saves_stop_tokens: bool = False) -> list[str]:
    """The data summary a run prints: one line of counts, then a line for each thing worth a look.

    `saves_stop_tokens`: the run writes the model whole (full fine-tuning), and with it a generation_config.json that
    stops at the end-of-turn tokens its data trains (train/run.py); an adapter runs with its base model's."""
    r = report
    rows = f"{r.train_rows:,} train rows" + (f", {r.eval_rows:,} eval rows" if r.eval_rows else "")
    policy = (
        f"; multi_turn {cfg.multi_turn}: {r.conversations_full:,} conversations whole, "
        f"{r.conversations_per_turn:,} split per turn"
        if r.conversations_full + r.conversations_per_turn
        else ""
    )
    lines = [
        f"{r.rows_read:,} rows read -> {rows}, {r.train_target_tokens:,} target tokens; {r.rows_skipped:,} refused, "
        + (f"{r.rows_shortened:,} shortened to their latest exchanges, " if r.rows_shortened else "")
        + f"{r.rows_truncated:,} truncated, {r.rows_dropped:,} dropped (max_length {cfg.max_length}, {cfg.truncation}); "
        f"row lengths {describe_lengths(r.length_tokens)}{policy}"
    ]
    if r.rows_dropped:
        lines.append(f"   dropped: {describe_drops(r.drop_reasons, cfg)}")
    if r.per_turn_reason:
        lines.append(f"   split per turn because the chat template rewrites past turns, e.g. {r.per_turn_reason}")
    if r.reasoning_dropped:
        lines.append(
            f"   reasoning not rendered by the chat template (so not trained): {r.reasoning_dropped:,} assistant messages"
        )
    if r.system_dropped:
        lines.append(
            f"   system prompt not rendered by the chat template: {r.system_dropped:,} conversations train without it"
        )
    if r.tools_dropped:
        lines.append(
            f"   tool schemas not rendered by the chat template: {r.tools_dropped:,} conversations train without "
            "them (describe the tools in the system prompt, or use a template that renders `tools`)"
        )
    if r.unterminated_turns:
        lines.append(
            f"   no end-of-turn marker after the assistant's text: {_turns(r.unterminated_turns)} (the template "
            "writes none there, so these rows teach no stop; check the template if the model should learn one"
            + (
                f"; it reads {', '.join(r.template_variables)}: if one makes it write the marker, set it with "
                f"--chat_template_kwargs '{{{r.template_variables[0]}: true}}'"
                if r.template_variables
                else ""
            )
            + ")"
        )
    for marker, turns in sorted(r.foreign_end_markers.items(), key=lambda item: -item[1])[:3]:
        trained = (
            "1 turn trains it as ordinary text, and not"
            if turns == 1
            else f"{turns:,} turns train it as ordinary text, and none of them trains"
        )
        lines.append(
            f"   end of turn {marker!r} is no token of this tokenizer: {trained} the tokenizer's end-of-sequence token, "
            "so generation will not stop after an answer. The template was written for another tokenizer: use the "
            "model it belongs to (--model_name), or a template written for this one (--chat_template FILE|NAME)"
        )
    for token, (turns, token_id) in sorted(r.unstopped_end_tokens.items(), key=lambda item: -item[1][0])[:3]:
        said = (
            f"   end of turn {token!r} ({token_id}) is not a token this model stops at: {_turns(turns)} "
            f"{'is' if turns == 1 else 'are'} trained to end with it, and generation stops at "
            f"{', '.join(r.stop_tokens) or 'no token'} (the tokenizer's end-of-sequence token and the model's "
            "generation_config.json eos_token_id)"
        )
        if saves_stop_tokens:
            said += (
                f"; the fine-tuned model's generation_config.json lists {token_id} too, so it stops there (a server "
                f"that stops at the tokenizer's end-of-sequence token alone needs {token_id} as a stop token)"
            )
        else:
            said += (
                f", so the trained model will write it and go on. Serve it with {token_id} among "
                "generation_config.json's eos_token_id (a LoRA adapter runs with its base model's; `phalanx export` "
                "adds it to a merged model's), or train with a template whose turns end with a token it stops at "
                "(--chat_template FILE|NAME)"
            )
        lines.append(said)
    if r.special_texts:
        texts = ", ".join(
            f"{text!r} x{times:,}" for text, times in sorted(r.special_texts.items(), key=lambda i: -i[1])
        )
        lines.append(
            f"   special tokens' text in the rows, encoded as ordinary text (the template's own markup alone is tokens): "
            f"{texts}; --special_token_text token reads it as the tokens"
        )
    without = r.conversations_without_system
    counts = {
        WITHOUT_SYSTEM: without,
        WITH_SYSTEM: None if without is None else r.conversations_full + r.conversations_per_turn - without,
    }
    advice = "if the model is served with a value, train with it too: --chat_template_kwargs '{{{name}: ...}}'; the "
    advice += "model's card says what it holds"
    lines += [f"   {note}" for note in written_empty_notes(r.variables_written_empty, advice, counts=counts)]
    lines += [f"   refused: {reason}" for reason in r.skip_reasons]
    if r.rows_skipped > len(r.skip_reasons):
        lines.append(f"   refused: ... and {r.rows_skipped - len(r.skip_reasons):,} more")
    return lines


def _length_stats(lengths: list[int]) -> dict[str, int]:
    if not lengths:
        return {}
    ordered = sorted(lengths)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"min": ordered[0], "median": pick(0.5), "p90": pick(0.9), "max": ordered[-1]}


def _turns(count: int) -> str:
    return f"{count:,} turn" + ("" if count == 1 else "s")


def describe_lengths(stats: dict[str, int]) -> str:
    if not stats:
        return "unknown"
    return f"{stats['min']}-{stats['max']} tokens (median {stats['median']}, p90 {stats['p90']})"


def _too_long(examples: list[dict], cfg: DataConfig) -> bool:
    return any(len(ex["input_ids"]) > cfg.max_length for ex in examples)


def _keep_recent(
    tokenizer: Any, conv: dict, result: Tokenized, where: str, cfg: DataConfig, counts: RowCounts
) -> Tokenized:
    """``result`` with each row that is too long rendered again without its oldest exchanges (system messages and
    tools stay), the fewest dropped that make it fit; a row whose last exchange alone is too long keeps that one
    exchange, and _fit then cuts its end.

    A system message stays where it was among what is kept: one from the dropped exchanges moves up only to just
    before the first kept one, in its order, so an instruction given mid-conversation still comes after the
    exchanges it followed and before the ones it governs."""
    messages = conv["messages"]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    # per_turn rows are turn views (messages[:i+1]); a full row is the whole conversation.
    ends = turns if result.policy == "per_turn" else [len(messages) - 1]
    # A cut drops at least one message that is not a system message: the leading system prompt alone is no exchange.
    first_exchange = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    examples = []
    for example, end in zip(result.examples, ends):
        if len(example["input_ids"]) > cfg.max_length:
            starts = [k for k in range(first_exchange + 1, end + 1) if messages[k]["role"] == "user"]
            for k in starts:
                kept_system = [m for m in messages[:k] if m["role"] == "system"]
                shorter = {**conv, "messages": kept_system + messages[k : end + 1]}
                rows = tokenize_conversation(
                    tokenizer, shorter, where, result.policy, cfg.chat_template_kwargs, cfg.special_token_text
                ).examples
                example = rows[-1] if result.policy == "per_turn" else rows[0]
                if len(example["input_ids"]) <= cfg.max_length:
                    counts.shortened += 1
                    break
        examples.append(example)
    return dataclasses.replace(result, examples=examples)


def _split(rows: list[tuple[int, dict]], test_size: float, seed: int, n_read: int):
    """Hold out ceil(test_size * readable rows) by a seeded draw of row indices.

    Drawing indices of the source rows, not of the rows that survived, keeps a row on the same
    side of the split when max_length or the skip policy change."""
    if test_size <= 0:
        return [ex for _, ex in rows], None
    n_eval = math.ceil(n_read * test_size - 1e-9)
    held_out = set(random.Random(seed).sample(range(n_read), n_eval))
    train = [ex for i, ex in rows if i not in held_out]
    eval_ = [ex for i, ex in rows if i in held_out]
    return train, (eval_ or None)


# ---------------------------------------------------------------------------- storage


def _load(folder: Path, *, cache_hit: bool, sources: dict[str, str]) -> PreparedData:
    fields = json.loads((folder / "report.json").read_text())
    report = DataReport(**fields, cache_hit=cache_hit, cache_dir=str(folder))
    train = TokenizedRows.read(folder / "train.arrow")
    eval_ = TokenizedRows.read(folder / "eval.arrow") if (folder / "eval.arrow").is_file() else None
    return PreparedData(train=train, eval=eval_, report=report, sources=sources)


def report_dict(report: DataReport) -> dict:
    """The report as plain JSON-ready data (for training_info.json and logs)."""
    return dataclasses.asdict(report)
