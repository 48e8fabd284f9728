"""The whole pipeline: policies and their counts, the eval split, and the on-disk cache shared by processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
from pathlib import Path

import pytest

from phalanx.config.schema import DataConfig
from phalanx.data import prepare as prepare_module
from phalanx.data.chat import IGNORE_INDEX
from phalanx.data.prepare import prepare_data
from phalanx.errors import DataError

REAL_TEMPLATES = Path(__file__).parent / "templates" / "real"


def _cfg(**kw) -> DataConfig:
    kw.setdefault("test_size", 0.0)
    return DataConfig(**kw)


def _prepare(cfg, tok, tmp_path, seed=0):
    return prepare_data(cfg, tok, seed=seed, cache_root=tmp_path / "cache")


def _answers(ds, tok) -> list[str]:
    return [tok.decode([t for t in row if t != IGNORE_INDEX]) for row in ds["labels"]]


def test_jsonl_to_train_and_eval_sets(tmp_path, tokenizer, write_jsonl, chat_row):
    f = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(10)])
    data = _prepare(_cfg(dataset_path=str(f), test_size=0.2), tokenizer, tmp_path, seed=3)
    assert data.train.column_names == ["input_ids", "labels"]
    assert (len(data.train), len(data.eval)) == (8, 2)
    everything = _answers(data.train, tokenizer) + _answers(data.eval, tokenizer)
    assert sorted(everything) == sorted(f"fine {i}<|im_end|>\n" for i in range(10))
    r = data.report
    assert (r.rows_read, r.rows_skipped, r.train_rows, r.eval_rows, r.cache_hit) == (10, 0, 8, 2, False)
    assert r.train_target_tokens == sum(sum(t != IGNORE_INDEX for t in row) for row in data.train["labels"])

    again = _prepare(_cfg(dataset_path=str(f), test_size=0.2), tokenizer, tmp_path, seed=3)
    assert _answers(again.eval, tokenizer) == _answers(data.eval, tokenizer)  # deterministic
    other = _prepare(_cfg(dataset_path=str(f), test_size=0.2), tokenizer, tmp_path, seed=4)
    assert other.report.cache_dir != data.report.cache_dir
    assert _answers(other.eval, tokenizer) != _answers(data.eval, tokenizer)

    none = _prepare(_cfg(dataset_path=str(f), test_size=0.0), tokenizer, tmp_path)
    assert none.eval is None and len(none.train) == 10


def test_a_parquet_dataset_trains_the_rows_its_jsonl_would(tmp_path, tokenizer, write_jsonl, tool_row, chat_row):
    """Parquet's schema gives every tool every other tool's parameters and every message every other message's keys,
    as nulls; the rows render and mask as their jsonl lines do (the template writes the tools as JSON: with the
    nulls each tool's schema was trained on with the others' parameters). A held-out file beside the training file,
    as a Hub dataset's data/ holds it, is refused by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    booking = {"name": "book", "parameters": {"type": "object", "properties": {"clinic": {"type": "string"}}}}
    other_tool = {**tool_row, "tools": [{"type": "function", "function": booking}]}
    rows = [tool_row, chat_row(1), other_tool]
    lines = write_jsonl(tmp_path / "rows.jsonl", rows)
    table = tmp_path / "data" / "train-00000-of-00001.parquet"
    table.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), table)
    from_lines = _prepare(_cfg(dataset_path=str(lines)), tokenizer, tmp_path).train
    from_table = _prepare(_cfg(dataset_path=str(table)), tokenizer, tmp_path).train
    assert from_table["input_ids"] == from_lines["input_ids"] and from_table["labels"] == from_lines["labels"]
    assert _prepare(_cfg(dataset_path=str(table.parent)), tokenizer, tmp_path).train["labels"] == from_lines["labels"]
    pq.write_table(pa.Table.from_pylist(rows[:1]), table.parent / "test-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"test-00000-of-00001.parquet too, whose name marks a held-out split"):
        _prepare(_cfg(dataset_path=str(table.parent)), tokenizer, tmp_path)


def test_eval_dataset_split_evaluates_the_datasets_own_split(tmp_path, tokenizer, chat_row):
    """A Hub dataset with its own test split (a local repository of it here: data/train-*.parquet, data/test-*.parquet):
    --eval_dataset_split test scores those rows and holds none of the training rows out; a split it lacks is named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist([chat_row(i) for i in range(6)]), repo / "data" / "train-00000-of-00001.parquet"
    )
    pq.write_table(
        pa.Table.from_pylist([chat_row(i, "held") for i in range(2)]), repo / "data" / "test-00000-of-00001.parquet"
    )
    data = _prepare(_cfg(dataset_name=str(repo), eval_dataset_split="test", test_size=0.5), tokenizer, tmp_path)
    assert (data.report.train_rows, data.report.eval_rows, data.report.rows_read) == (6, 2, 8)
    assert sorted(_answers(data.eval, tokenizer)) == [f"held {i}<|im_end|>\n" for i in range(2)]
    held_out = _prepare(_cfg(dataset_name=str(repo), test_size=0.5), tokenizer, tmp_path)
    assert (held_out.report.train_rows, held_out.report.eval_rows) == (3, 3)  # without it: half the train split
    with pytest.raises(DataError, match=r"split 'validation'.*Unknown split"):
        _prepare(_cfg(dataset_name=str(repo), eval_dataset_split="validation"), tokenizer, tmp_path)


def test_eval_dataset_path_replaces_test_size(tmp_path, tokenizer, write_jsonl, chat_row):
    train = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(4)])
    evalf = write_jsonl(tmp_path / "eval.jsonl", [{"text": "held out"}])
    data = _prepare(_cfg(dataset_path=str(train), eval_dataset_path=str(evalf), test_size=0.5), tokenizer, tmp_path)
    assert (data.report.train_rows, data.report.eval_rows, data.report.rows_read) == (4, 1, 5)
    assert tokenizer.decode(data.eval[0]["input_ids"]) == "held out</s>"


def test_an_eval_file_inside_the_training_folder_is_refused(tmp_path, tokenizer, write_jsonl, chat_row):
    """Seed 001's data/ holds traj_chat.jsonl and traj_val.jsonl: --dataset_path data/ reads both for training, so
    --eval_dataset_path data/traj_val.jsonl would score rows the run trained on. The file itself, or an eval file
    elsewhere, is fine."""
    data = tmp_path / "data"
    train = write_jsonl(data / "traj_chat.jsonl", [chat_row(i) for i in range(4)])
    val = write_jsonl(data / "traj_val.jsonl", [chat_row(i) for i in range(4, 6)])
    with pytest.raises(DataError) as err:
        _prepare(_cfg(dataset_path=f"{data}/", eval_dataset_path=str(val)), tokenizer, tmp_path)
    said = str(err.value)
    assert f"data.eval_dataset_path {val} is one of the *.jsonl / *.parquet files that data.dataset_path {data}" in said
    assert f"e.g. {train}" in str(err.value)
    ok = _prepare(_cfg(dataset_path=str(train), eval_dataset_path=str(val)), tokenizer, tmp_path)
    assert (ok.report.train_rows, ok.report.eval_rows) == (4, 2)


def test_a_held_out_file_inside_the_training_folder_is_refused(tmp_path, tokenizer, write_jsonl, chat_row):
    """Without --eval_dataset_path, --dataset_path data/ would train on seed 001's traj_val.jsonl as well: a file
    whose name marks a held-out split (a word of its name: val, dev, test, ...) is refused, naming what to pass
    instead. Names that only contain such letters are training files; a folder of held-out files only is meant."""
    data = tmp_path / "data"
    train = write_jsonl(data / "traj_chat.jsonl", [chat_row(i) for i in range(4)])
    write_jsonl(data / "devices-and-contests.jsonl", [chat_row(i) for i in range(4, 6)])  # no held-out word
    assert _prepare(_cfg(dataset_path=str(data)), tokenizer, tmp_path).report.train_rows == 6
    val = write_jsonl(data / "traj_val.jsonl", [chat_row(i) for i in range(6, 8)])
    with pytest.raises(DataError) as err:
        _prepare(_cfg(dataset_path=f"{data}/"), tokenizer, tmp_path)
    message = str(err.value)
    assert f"data.dataset_path {data} is a folder" in message
    assert "traj_val.jsonl too, whose name marks a held-out split ('val')" in message, message
    assert f"Point data.dataset_path at the training files (e.g. {data / 'devices-and-contests.jsonl'})" in message
    assert f"data.eval_dataset_path at {val}" in message
    # Scoring it instead is not enough while the folder is still read whole: the eval-file refusal names it.
    with pytest.raises(DataError, match="is one of the \\*.jsonl / \\*.parquet files"):
        _prepare(_cfg(dataset_path=str(data), eval_dataset_path=str(val)), tokenizer, tmp_path)
    ok = _prepare(_cfg(dataset_path=str(train), eval_dataset_path=str(val)), tokenizer, tmp_path)
    assert (ok.report.train_rows, ok.report.eval_rows) == (4, 2)
    held_out_only = tmp_path / "held"
    write_jsonl(held_out_only / "test.jsonl", [chat_row(i) for i in range(3)])
    assert _prepare(_cfg(dataset_path=str(held_out_only)), tokenizer, tmp_path).report.train_rows == 3


def test_every_source_kind(tmp_path, tokenizer, write_jsonl, chat_row, tool_row):
    import datasets

    folder = tmp_path / "folder"
    write_jsonl(folder / "a.jsonl", [chat_row(0)])
    write_jsonl(folder / "b.jsonl", [{"instruction": "hi", "output": "fine 1"}])  # first row decides: messages
    with pytest.raises(
        DataError, match=r"b.jsonl line 1: messages: missing.*looks like format 'alpaca'.*a.jsonl line 1"
    ):
        _prepare(_cfg(dataset_path=str(folder)), tokenizer, tmp_path)
    write_jsonl(folder / "b.jsonl", [chat_row(1)])
    assert _answers(_prepare(_cfg(dataset_path=str(folder)), tokenizer, tmp_path).train, tokenizer) == [
        "fine 0<|im_end|>\n",
        "fine 1<|im_end|>\n",
    ]

    datasets.Dataset.from_list([tool_row] * 3).save_to_disk(str(tmp_path / "disk"))
    data = _prepare(_cfg(dataset_path=str(tmp_path / "disk")), tokenizer, tmp_path)
    assert data.report.train_rows == 3 and "ASSISTANT-TWO" in _answers(data.train, tokenizer)[0]

    write_jsonl(tmp_path / "repo" / "data" / "train.jsonl", [{"text": f"story {i}"} for i in range(3)])
    data = _prepare(_cfg(dataset_name=str(tmp_path / "repo")), tokenizer, tmp_path)
    assert [tokenizer.decode(x) for x in data.train["input_ids"]] == [f"story {i}</s>" for i in range(3)]
    assert _prepare(_cfg(dataset_name=str(tmp_path / "repo")), tokenizer, tmp_path).report.cache_hit


def test_bundled_dataset_when_no_source_is_set(tmp_path, tokenizer, write_jsonl, tool_row, monkeypatch):
    fake = write_jsonl(tmp_path / "bundled" / "health_agent.jsonl", [tool_row] * 2)
    monkeypatch.setattr(prepare_module, "bundled_dataset_path", lambda: fake)
    assert _prepare(_cfg(), tokenizer, tmp_path).report.train_rows == 2
    monkeypatch.setattr(prepare_module, "bundled_dataset_path", lambda: tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="bundled dataset is missing"):
        _prepare(_cfg(), tokenizer, tmp_path)


def _mixed_file(tmp_path, chat_row):
    f = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps(chat_row(0)).encode(),
        b'{"messages": [',  # line 2: malformed JSON
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}).encode(),  # 3
        b'{"text": "caf\xe9"}',  # line 4: not UTF-8
        json.dumps(chat_row(4)).encode(),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}).encode(),  # 6: no assistant
    ]
    f.write_bytes(b"\n".join(lines) + b"\n")
    return f


def test_bad_rows_stop_the_run_by_default(tmp_path, tokenizer, chat_row):
    with pytest.raises(DataError, match=r"mixed.jsonl line 2: malformed JSON"):
        _prepare(_cfg(dataset_path=str(_mixed_file(tmp_path, chat_row))), tokenizer, tmp_path)


def test_skip_mode_counts_and_keeps_the_reasons(tmp_path, tokenizer, chat_row):
    f = _mixed_file(tmp_path, chat_row)
    r = _prepare(_cfg(dataset_path=str(f), on_bad_row="skip"), tokenizer, tmp_path).report
    assert (r.rows_read, r.rows_skipped, r.train_rows) == (6, 4, 2)
    assert [reason.split(": ")[0] for reason in r.skip_reasons] == [f"{f} line {n}" for n in (2, 3, 4, 6)]
    assert "messages[1].role: unknown role 'bot'" in r.skip_reasons[1]
    assert "no assistant turn" in r.skip_reasons[3]


def test_a_dataset_held_out_whole_for_evaluation_says_how_to_train(tmp_path, tokenizer, chat_row, write_jsonl):
    """One usable row and test_size 0.2: ceil(0.2) = 1 row held out, none left to train; the error says why."""
    f = write_jsonl(tmp_path / "one.jsonl", [chat_row(0)])
    with pytest.raises(DataError) as err:
        _prepare(_cfg(dataset_path=str(f), test_size=0.2), tokenizer, tmp_path)
    assert "1 held out for evaluation" in str(err.value)
    assert "every usable row was held out by data.test_size 0.2: give more rows, --test_size 0" in str(err.value)


def test_skip_mode_with_nothing_usable_left_raises(tmp_path, tokenizer):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"oops"\n{"messages": []}\n')
    with pytest.raises(
        DataError, match=r"no usable training rows \(2 read, 2 skipped.*first problem: .*line 1: malformed"
    ):
        _prepare(_cfg(dataset_path=str(f), on_bad_row="skip"), tokenizer, tmp_path)


def _lengths_file(tmp_path, write_jsonl):
    # ByT5 has one token per byte: 62 template bytes + the question + the answer.
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "short"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 200}]},
        {"messages": [{"role": "user", "content": "q" * 200}, {"role": "assistant", "content": "late answer"}]},
    ]
    return write_jsonl(tmp_path / "lengths.jsonl", rows)


def test_truncate_cuts_and_drops_rows_left_without_targets(tmp_path, tokenizer, write_jsonl):
    f = _lengths_file(tmp_path, write_jsonl)
    data = _prepare(_cfg(dataset_path=str(f), max_length=100, truncation="truncate"), tokenizer, tmp_path)
    r = data.report
    assert (r.rows_truncated, r.rows_dropped, r.train_rows) == (2, 1, 2)  # row 3 lost its whole answer
    assert [len(x) for x in data.train["input_ids"]] == [len(data.train[0]["input_ids"]), 100]
    assert all(len(a) == len(b) for a, b in zip(data.train["input_ids"], data.train["labels"]))


def test_drop_omits_long_rows(tmp_path, tokenizer, write_jsonl):
    f = _lengths_file(tmp_path, write_jsonl)
    r = _prepare(_cfg(dataset_path=str(f), max_length=100, truncation="drop"), tokenizer, tmp_path).report
    assert (r.rows_truncated, r.rows_dropped, r.train_rows) == (0, 2, 1)


def test_keep_recent_leaves_out_the_oldest_exchanges_and_keeps_the_system_prompt(tmp_path, tokenizer, write_jsonl):
    """A long chat keeps its system prompt and latest exchanges; a row of one exchange too long is cut at its end."""
    exchanges = [
        m
        for k in range(6)
        for m in (
            {"role": "user", "content": f"QUESTION-{k} " + "x" * 30},
            {"role": "assistant", "content": f"ANSWER-{k}"},
        )
    ]
    long_chat = {"messages": [{"role": "system", "content": "SYSTEM-TEXT"}] + exchanges}
    f = write_jsonl(
        tmp_path / "chats.jsonl",
        [long_chat, {"messages": [{"role": "user", "content": "q" * 400}, {"role": "assistant", "content": "late"}]}],
    )
    data = _prepare(_cfg(dataset_path=str(f), max_length=200, truncation="keep_recent"), tokenizer, tmp_path)
    r = data.report
    assert (r.rows_shortened, r.rows_truncated, r.rows_dropped, r.train_rows) == (1, 1, 1, 1)
    text = tokenizer.decode(data.train[0]["input_ids"])
    assert len(data.train[0]["input_ids"]) <= 200 and text.startswith("<|im_start|>system\nSYSTEM-TEXT<|im_end|>\n")
    kept = [k for k in range(6) if f"QUESTION-{k}" in text]
    assert kept == list(range(6 - len(kept), 6)) and 0 < len(kept) < 6  # the latest ones, whole
    assert _answers(data.train, tokenizer) == ["".join(f"ANSWER-{k}<|im_end|>\n" for k in kept)]
    assert r.length_tokens["max"] > 200  # lengths as rendered, before max_length
    # The same conversations under multi_turn per_turn: each turn's row keeps as many earlier exchanges as fit.
    data = _prepare(
        _cfg(dataset_path=str(f), max_length=200, truncation="keep_recent", multi_turn="per_turn"), tokenizer, tmp_path
    )
    assert _answers(data.train, tokenizer) == [f"ANSWER-{k}<|im_end|>\n" for k in range(6)]
    assert all(len(row) <= 200 for row in data.train["input_ids"])


def test_keep_recent_keeps_a_mid_conversation_system_message_in_its_place(tmp_path, tokenizer, write_jsonl):
    """An instruction given mid-conversation stays after the exchanges it followed; once those are dropped, it comes
    right after the system prompt, still before the exchanges it governs (it was moved to the front before)."""
    exchanges = [
        [{"role": "user", "content": f"QUESTION-{k} " + "x" * 30}, {"role": "assistant", "content": f"ANSWER-{k}"}]
        for k in range(6)
    ]
    switch = {"role": "system", "content": "SWITCH-TEXT"}
    messages = [{"role": "system", "content": "SYSTEM-TEXT"}]
    for k, exchange in enumerate(exchanges):
        messages += ([switch] if k == 4 else []) + exchange
    f = write_jsonl(tmp_path / "chats.jsonl", [{"messages": messages}])
    # 350 tokens keep the last two exchanges (the instruction's are dropped); 450 keep three.
    for max_length, order in (
        (350, ["SYSTEM-TEXT", "SWITCH-TEXT", "QUESTION-4", "QUESTION-5"]),
        (450, ["SYSTEM-TEXT", "QUESTION-3", "SWITCH-TEXT", "QUESTION-4", "QUESTION-5"]),
    ):
        data = _prepare(_cfg(dataset_path=str(f), max_length=max_length, truncation="keep_recent"), tokenizer, tmp_path)
        text = tokenizer.decode(data.train[0]["input_ids"])
        assert sorted((text.find(m), m) for m in order if m in text) == [(text.find(m), m) for m in order], text
        assert all(f"QUESTION-{k}" not in text for k in range(6) if f"QUESTION-{k}" not in order)


def test_error_names_the_row_and_its_length(tmp_path, tokenizer, write_jsonl):
    f = _lengths_file(tmp_path, write_jsonl)
    with pytest.raises(DataError, match=rf"{f} line 2: 262 tokens, longer than max_length=100"):
        _prepare(_cfg(dataset_path=str(f), max_length=100, truncation="error"), tokenizer, tmp_path)


def test_cache_is_hit_and_follows_settings_content_and_tokenizer(
    tmp_path, tokenizer, make_tokenizer, write_jsonl, chat_row
):
    f = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(5)])
    first = _prepare(_cfg(dataset_path=str(f)), tokenizer, tmp_path)
    second = _prepare(_cfg(dataset_path=str(f)), make_tokenizer(), tmp_path)  # an equal tokenizer
    assert (first.report.cache_hit, second.report.cache_hit) == (False, True)
    assert second.report.cache_dir == first.report.cache_dir and os.path.isdir(first.report.cache_dir)
    assert second.train["input_ids"] == first.train["input_ids"] and second.report.rows_read == 5

    longer = _prepare(_cfg(dataset_path=str(f), max_length=64), tokenizer, tmp_path)
    assert not longer.report.cache_hit and longer.report.cache_dir != first.report.cache_dir

    other_template = make_tokenizer(tokenizer.chat_template.replace("<|im_end|>", "<|end|>"))
    assert not _prepare(_cfg(dataset_path=str(f)), other_template, tmp_path).report.cache_hit
    variables = _cfg(dataset_path=str(f), chat_template_kwargs={"enable_thinking": False})
    assert not _prepare(variables, tokenizer, tmp_path).report.cache_hit  # they can change every rendering

    write_jsonl(f, [chat_row(i, "changed") for i in range(5)])
    changed = _prepare(_cfg(dataset_path=str(f)), tokenizer, tmp_path)
    assert not changed.report.cache_hit and _answers(changed.train, tokenizer)[0] == "changed 0<|im_end|>\n"
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]


def test_a_phalanx_whose_masking_code_changed_tokenizes_again(tmp_path, tokenizer, write_jsonl, chat_row, monkeypatch):
    """Rows masked by an older phalanx (a template it handled differently) are not reused: the cache key holds a hash
    of the masking code (data/chat.py, data/formats.py), read from the files."""
    f = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(3)])
    first = _prepare(_cfg(dataset_path=str(f)), tokenizer, tmp_path)
    assert _prepare(_cfg(dataset_path=str(f)), tokenizer, tmp_path).report.cache_hit
    from phalanx.data import chat

    source = Path(chat.__file__).read_bytes()
    real_read = Path.read_bytes
    monkeypatch.setattr(
        Path, "read_bytes", lambda p: source + b"# changed" if p == Path(chat.__file__) else real_read(p)
    )
    prepare_module._tokenizing_code_digest.cache_clear()
    try:
        changed = _prepare(_cfg(dataset_path=str(f)), tokenizer, tmp_path)
    finally:
        prepare_module._tokenizing_code_digest.cache_clear()
    assert not changed.report.cache_hit and changed.report.cache_dir != first.report.cache_dir


def test_unterminated_turns_name_the_template_switches_that_may_close_them(tmp_path, write_jsonl, chat_row):
    """A template that writes its end-of-turn marker only when a variable asks (Apriel 1.6's training_prompt): the
    data summary names its switches and how to set one; set, the marker trains and the line is gone."""
    from data.templates import build_tokenizer
    from phalanx.data.prepare import describe_report

    apriel = (REAL_TEMPLATES / "Apriel-1.6-15b-Thinker-fixed.jinja").read_text()
    tok = build_tokenizer(apriel, bos_token="<s>", eos_token="</s>", pad_token=None)
    f = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(3)])
    cfg = _cfg(dataset_path=str(f))
    plain = _prepare(cfg, tok, tmp_path)
    assert plain.report.unterminated_turns == 3 and plain.report.template_variables == ["training_prompt"]
    line = next(line for line in describe_report(plain.report, cfg) if "no end-of-turn marker" in line)
    assert "it reads training_prompt: if one makes it write the marker, set it with " in line, line
    assert "--chat_template_kwargs '{training_prompt: true}'" in line, line

    switched = _cfg(dataset_path=str(f), chat_template_kwargs={"training_prompt": True})
    closed = _prepare(switched, tok, tmp_path)
    assert closed.report.unterminated_turns == 0 and closed.report.template_variables == []
    assert all(answer.endswith("\n<|end|>\n") for answer in _answers(closed.train, tok)), _answers(closed.train, tok)
    assert not [line for line in describe_report(closed.report, switched) if "no end-of-turn marker" in line]


def test_special_token_text_in_rows_is_counted_said_and_part_of_the_cache_key(tmp_path, tokenizer, write_jsonl):
    """Rows quoting the tokenizer's </s> train it as text (data.special_text): the data summary says how often and how
    to read it as the token instead, and that setting tokenizes again rather than reusing the cache."""
    from phalanx.data.prepare import describe_report

    rows = [
        {"messages": [{"role": "user", "content": f"What is </s> ({i})?"}, {"role": "assistant", "content": "An end."}]}
        for i in range(3)
    ]
    f = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = _cfg(dataset_path=str(f))
    as_text = _prepare(cfg, tokenizer, tmp_path)
    assert as_text.report.special_texts == {"</s>": 3}
    (line,) = [line for line in describe_report(as_text.report, cfg) if "special tokens' text" in line]
    assert "'</s>' x3" in line and "--special_token_text token" in line, line
    tokens = _cfg(dataset_path=str(f), special_token_text="token")
    as_tokens = _prepare(tokens, tokenizer, tmp_path)
    assert not as_tokens.report.cache_hit and as_tokens.report.special_texts == {}
    assert as_tokens.train[0]["input_ids"] != as_text.train[0]["input_ids"]
    assert not [line for line in describe_report(as_tokens.report, tokens) if "special tokens' text" in line]


# Runs in a fresh interpreter. Test modules are not importable by name there (pytest imports them
# with --import-mode=importlib), so the child runs this source through the builtin exec.
CHILD = """
from transformers import ByT5Tokenizer
from phalanx.config.schema import DataConfig
from phalanx.data.prepare import prepare_data

tok = ByT5Tokenizer()
tok.chat_template = template
barrier.wait()  # both processes start preparing at the same moment
data = prepare_data(DataConfig(dataset_path=path, test_size=0.1), tok, seed=7, cache_root=cache_root)
results.put((data.report.cache_hit, data.report.cache_dir, data.train["input_ids"], data.train["labels"],
             data.eval["input_ids"]))
"""


def test_two_processes_prepare_at_once_and_get_identical_data(tmp_path, write_jsonl, tool_row, chatml):
    f = write_jsonl(tmp_path / "train.jsonl", [tool_row] * 150)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    scope = {
        "path": str(f),
        "cache_root": tmp_path / "cache",
        "template": chatml,
        "barrier": barrier,
        "results": results,
    }
    procs = [ctx.Process(target=exec, args=(CHILD, dict(scope))) for _ in range(2)]
    for p in procs:
        p.start()
    got = []
    while len(got) < 2:
        try:
            got.append(results.get(timeout=1))
        except queue.Empty:
            assert all(p.is_alive() for p in procs), "a child process died; see its traceback above"
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sorted(hit for hit, *_ in got) == [False, True]  # one tokenized, the other loaded its result
    assert got[0][1:] == got[1][1:]
    assert len(got[0][2]) == 135 and len(got[0][4]) == 15


def test_a_missing_dataset_or_eval_dataset_is_named_by_its_field(tmp_path):
    from phalanx.data.prepare import DataSource
    from phalanx.errors import DataError

    for source, field in [
        (DataSource.for_training(DataConfig(dataset_path=str(tmp_path / "nope.jsonl"))), "data.dataset_path"),
        (DataSource.path(str(tmp_path / "nope.jsonl"), "data.eval_dataset_path"), "data.eval_dataset_path"),
    ]:
        with pytest.raises(DataError, match=f"^{field} = '{tmp_path}/nope.jsonl': no such file or folder; accepted"):
            source.identity()
