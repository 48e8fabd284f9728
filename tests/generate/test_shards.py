"""Shard files, commit records, torn tails, the manifest, the merge and the work split."""

import json
import os

import pytest

from helpers import gone_pid
from phalanx.errors import ConfigError, DataError
from phalanx.generate.job import plan_batches, rank_batches
from phalanx.generate.prompts import Prompt
from phalanx.generate.shards import (
    ShardWriter,
    check_manifest,
    default_val_output,
    merge,
    prepare_folder,
    scan_folder,
    scan_shard,
    shard_dir,
    val_prompt_ids,
)


def rec(p: int, s: int, text: str = "answer") -> dict:
    return {
        "messages": [{"role": "user", "content": f"q{p}"}, {"role": "assistant", "content": f"{text} {p}.{s}"}],
        "metadata": {"prompt_id": p, "sequence_index": s},
    }


def test_commit_scan_and_torn_tail(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    w = ShardWriter(path)
    w.commit(0, [rec(0, 0), rec(0, 1)])
    w.commit(2, [rec(1, 0)])
    w.close()
    committed, end = scan_shard(path)
    assert [c.key for c in committed] == [(0, 0), (0, 1), (1, 0)] and end == path.stat().st_size
    # A killed run: a batch's records written, its commit line cut short.
    with open(path, "ab") as f:
        f.write((json.dumps(rec(5, 0)) + "\n").encode() + b'{"commit": {"batch": 9, "rec')
    assert [c.key for c in scan_shard(path)[0]] == [(0, 0), (0, 1), (1, 0)]
    w = ShardWriter(path)  # the next writer cuts the tail off before appending
    assert path.stat().st_size == end
    w.commit(4, [rec(5, 0, "again")])
    w.close()
    keys = scan_folder(tmp_path)
    assert sorted(keys) == [(0, 0), (0, 1), (1, 0), (5, 0)]
    raw = path.read_bytes()[keys[(5, 0)].offset :][: keys[(5, 0)].length]
    assert json.loads(raw)["messages"][1]["content"] == "again 5.0"


def test_corruption_before_a_commit_is_an_error(tmp_path):
    path = tmp_path / "rank-1.jsonl"
    w = ShardWriter(path)
    w.commit(0, [rec(0, 0)])
    w.commit(1, [rec(0, 1)])
    w.close()
    original = path.read_bytes()
    lines = original.split(b"\n")
    # The last batch's record no longer matches its checksum: after a power cut the last write may be
    # incomplete in any way, so the batch counts as not committed and is generated again.
    lines[2] = lines[2].replace(b"answer", b"ANSWER")
    path.write_bytes(b"\n".join(lines))
    assert [c.key for c in scan_shard(path)[0]] == [(0, 0)]
    # The same damage to a batch that a later commit follows is corruption, not a torn end.
    lines = original.split(b"\n")
    lines[0] = lines[0].replace(b"answer", b"ANSWER")
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match=r"rank-1.jsonl line 2: corrupt shard .*does not match"):
        scan_shard(path)
    # Unparseable mid-file garbage with a commit after it
    path.write_bytes(b'{"messages": [\n{"commit": {"batch": 0, "records": 0, "sha256": "x"}}\n')
    with pytest.raises(DataError, match="line 1: corrupt shard"):
        scan_shard(path)


def test_merge_sorts_splits_by_prompt_and_writes_atomically(tmp_path):
    folder = tmp_path / "out.jsonl.shards"
    folder.mkdir()
    a, b = ShardWriter(folder / "rank-0.jsonl"), ShardWriter(folder / "rank-1.jsonl")
    a.commit(0, [rec(2, 1), rec(0, 0)])
    b.commit(1, [rec(1, 1), rec(2, 0), rec(0, 1)])
    a.commit(2, [rec(1, 0), rec(0, 0, "duplicate")])  # a duplicate pair: the first committed copy wins
    a.close(), b.close()
    expected = [(p, s) for p in range(3) for s in range(2)]
    out, val = tmp_path / "out.jsonl", tmp_path / "val.jsonl"
    assert merge(folder, expected, {1}, out, val) == (4, 2)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["metadata"]["prompt_id"], r["metadata"]["sequence_index"]) for r in rows] == [
        (0, 0),
        (0, 1),
        (2, 0),
        (2, 1),
    ]
    assert rows[0]["messages"][1]["content"] == "answer 0.0"
    assert [json.loads(x)["metadata"]["prompt_id"] for x in val.read_text().splitlines()] == [1, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.shards", "val.jsonl"]  # no temp files
    # A merge killed with SIGKILL left its temporary file; the next merge removes it, not a live writer's.
    dead, live = tmp_path / f".out.jsonl.tmp-{gone_pid()}", tmp_path / f".val.jsonl.tmp-{os.getppid()}"
    dead.write_text("half"), live.write_text("being written")
    assert merge(folder, expected, {1}, out, val) == (4, 2)
    assert not dead.exists() and live.read_text() == "being written"
    live.unlink()
    with pytest.raises(DataError, match=r"1 \(prompt, sequence\) pairs have no committed record.*\(3, 0\)"):
        merge(folder, expected + [(3, 0)], set(), out, None)


def test_validation_split_is_whole_prompts_and_seeded():
    assert val_prompt_ids(88, 0.1, 42) == val_prompt_ids(88, 0.1, 42) != val_prompt_ids(88, 0.1, 43)
    assert len(val_prompt_ids(88, 0.1, 42)) == 9
    assert len(val_prompt_ids(3, 0.01, 0)) == 1 and len(val_prompt_ids(2, 0.9, 0)) == 1
    assert val_prompt_ids(1, 0.5, 0) == set() and val_prompt_ids(50, 0.0, 0) == set()


def test_names():
    from pathlib import Path

    assert default_val_output(Path("data/traj_chat.jsonl")) == Path("data/traj_val.jsonl")
    assert default_val_output(Path("x/answers.jsonl")) == Path("x/answers_val.jsonl")
    assert shard_dir(Path("data/traj_chat.jsonl")) == Path("data/traj_chat.jsonl.shards")


def test_manifest_decides_fresh_resume_or_refuse(tmp_path):
    out = tmp_path / "traj_chat.jsonl"
    folder = shard_dir(out)
    settings = {"seed": 1, "model_name": "m"}
    assert check_manifest(folder, out, settings, overwrite=False) == "fresh"
    prepare_folder(folder, settings, "fresh", None)
    assert check_manifest(folder, out, settings, overwrite=False) == "resume"
    # Nothing committed under the old settings (the job stopped before its first batch): nothing to lose, a new start.
    assert check_manifest(folder, out, {"seed": 2, "model_name": "m"}, overwrite=False) == "overwrite"
    writer = ShardWriter(folder / "rank-0.jsonl")
    writer.commit(0, [rec(0, 0)])
    writer.close()
    with pytest.raises(ConfigError, match=r"other settings \(seed: 1 before, 2 now\).*--overwrite true"):
        check_manifest(folder, out, {"seed": 2, "model_name": "m"}, overwrite=False)
    (folder / "rank-0.jsonl").write_text("x")
    assert check_manifest(folder, out, {"seed": 2}, overwrite=True) == "overwrite"
    prepare_folder(folder, {"seed": 2}, "overwrite", None)
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json"]
    # An output that phalanx did not write is never replaced silently.
    other = tmp_path / "mine.jsonl"
    other.write_text("{}\n")
    with pytest.raises(ConfigError, match="mine.jsonl already exists and was not written by a phalanx generate run"):
        check_manifest(shard_dir(other), other, settings, overwrite=False)


def test_an_output_under_a_file_is_refused_before_any_rank_writes(tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    out = blocker / "traj_chat.jsonl"
    for overwrite in (False, True):  # --overwrite true would otherwise fail only once rank 0 makes the folder
        with pytest.raises(ConfigError, match=f"^--output {out}: {blocker} is a file, not a folder"):
            check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=overwrite)


def test_an_output_that_is_a_folder_is_refused_asking_for_the_file(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for overwrite in (False, True):  # --overwrite true would write the records onto the folder's path at the end
        with pytest.raises(ConfigError, match=f"^--output {data} is a folder; .* --output {data}/traj_chat.jsonl"):
            check_manifest(shard_dir(data), data, {"seed": 1}, overwrite=overwrite)
    assert list(data.iterdir()) == []


def prompt(i: int, length: int) -> Prompt:
    return Prompt(i, f"line {i + 1}", [{"role": "user", "content": "q"}], None, None, tuple(range(length)))


def test_batches_do_not_depend_on_the_world_size():
    prompts = [prompt(i, n) for i, n in enumerate([5, 9, 9, 2, 7, 3, 8])]
    batches = plan_batches(prompts, num_sequences=3, batch_size=4)
    assert batches[0] == [(1, 0), (1, 1), (1, 2), (2, 0)]  # longest first, ties by id
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 1]
    everything = sorted(pair for b in batches for pair in b)
    assert everything == [(p, s) for p in range(7) for s in range(3)]
    for world in (1, 2, 3, 5):
        mine = [rank_batches(batches, r, world, set()) for r in range(world)]
        assert sorted(index for m in mine for index, _ in m) == list(range(len(batches)))
        assert all(pairs == batches[index] for m in mine for index, pairs in m)
    done = set(batches[0]) | {batches[1][0]}
    assert rank_batches(batches, 0, 2, done) == [(2, batches[2]), (4, batches[4])]
    assert rank_batches(batches, 1, 2, done) == [(1, batches[1][1:]), (3, batches[3]), (5, batches[5])]


def test_a_validation_file_phalanx_did_not_write_or_a_folder_is_refused_as_the_output_is(tmp_path):
    """--val_output (or the default traj_val.jsonl beside --output) was replaced by the merge whatever it held, and a
    folder there failed the merge with IsADirectoryError after all the generation."""
    out = tmp_path / "traj_chat.jsonl"
    theirs = tmp_path / "traj_val.jsonl"
    theirs.write_text('{"mine": 1}\n')
    with pytest.raises(ConfigError, match=f"^{theirs} already exists and was not written by a phalanx generate run"):
        check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=False, val_output=theirs)
    assert check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=False, val_output=None) == "fresh"  # none written
    assert check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=True, val_output=theirs) == "overwrite"
    prepare_folder(shard_dir(out), {"seed": 1}, "fresh", theirs)
    assert check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=False, val_output=theirs) == "resume"
    folder = tmp_path / "val"
    folder.mkdir()
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=f"^--val_output {folder} is a folder; .* --val_output {folder}/traj_val"):
            check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=overwrite, val_output=folder)
    assert theirs.read_text() == '{"mine": 1}\n' and list(folder.iterdir()) == []


def test_a_resumed_job_does_not_replace_a_validation_file_it_did_not_write(tmp_path):
    """The manifest lists the validation files a job writes: a resume may name another one that does not exist yet
    (the manifest then lists it too), or one of its own again, but not an existing file of someone else (the merge
    would replace it)."""
    out = tmp_path / "traj_chat.jsonl"
    own, theirs, new = tmp_path / "traj_val.jsonl", tmp_path / "notes.jsonl", tmp_path / "new_val.jsonl"
    prepare_folder(shard_dir(out), {"seed": 1}, "fresh", own)
    theirs.write_text('{"mine": 1}\n')
    own.write_text("{}\n")  # as an earlier merge of this job left it
    assert check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=False, val_output=own) == "resume"
    refused = f"^--val_output {theirs} already exists and is not a validation file this job wrote \\({own}\\)"
    with pytest.raises(ConfigError, match=refused):
        check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=False, val_output=theirs)
    assert check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=True, val_output=theirs) == "overwrite"
    # A resume into new_val.jsonl, then the same command again after its merge, then back to the first file.
    assert check_manifest(shard_dir(out), out, {"seed": 1}, False, new) == "resume"
    prepare_folder(shard_dir(out), {"seed": 1}, "resume", new)
    new.write_text("{}\n")
    for path in (new, own):
        assert check_manifest(shard_dir(out), out, {"seed": 1}, False, path) == "resume"
    # Run with --val_fraction 0 only, then with a fraction and an existing file there: refused too.
    prepare_folder(shard_dir(out), {"seed": 1}, "overwrite", None)
    with pytest.raises(ConfigError, match="none: it has run with --val_fraction 0 only"):
        check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=False, val_output=own)
    # A manifest written before the files were recorded meant the default beside --output.
    (shard_dir(out) / "manifest.json").write_text(json.dumps({"format": 1, "settings": {"seed": 1}}))
    assert check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=False, val_output=own) == "resume"
    with pytest.raises(ConfigError, match=refused):
        check_manifest(shard_dir(out), out, {"seed": 1}, overwrite=False, val_output=theirs)
    assert theirs.read_text() == '{"mine": 1}\n'
