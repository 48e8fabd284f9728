"""The loss mask on real chat templates equals an independent oracle: the same template, marked up.

For every real template (../shared/templates/ and tests/data/templates/real/) and every test row, phalanx's
``tokenize_conversation`` must give exactly the examples of ``data.templates.oracle_examples``: the same
input ids (the template's text tokenized in one pass) and the same labels (trained: each assistant turn's
output, after its header, through the end-of-turn marker and its newline). ``data.templates.CASES``
records, per template and row, the policy multi_turn="auto" must choose, or why the row must be refused.

The oracle is checked on its own first (the "self-check" tests): each marked copy renders byte for byte
what the original renders, its trained text is the hand-reviewed text of templates/expected_trained.json,
and transformers' own ``assistant_masks`` for the marked copy agree with the oracle's labels.
"""

from __future__ import annotations

import functools
import os
import re

import pytest

from data.templates import (
    CASE,
    CASES,
    IGNORE_INDEX,
    PROBE_USER,
    SHARED_ENV,
    Match,
    Refuse,
    build_tokenizer,
    expected_trained,
    marked_template,
    oracle_examples,
    original_template,
    row,
    shared_templates_dir,
    template_markers,
    trained_texts,
    turns_render_alike,
    with_text_arguments,
    with_text_parts,
)
from helpers import trained_runs
from phalanx.data.chat import tokenize_conversation
from phalanx.data.formats import to_conversation
from phalanx.errors import DataError

WHERE = "chats.jsonl line 7"

ROW_PARAMS = [pytest.param(case.name, kind, id=f"{case.name}-{kind}") for case in CASES for kind in case.rows]
MATCHED = [p for p in ROW_PARAMS if isinstance(CASE[p.values[0]].rows[p.values[1]], Match)]
MARKED = [p for p in ROW_PARAMS if CASE[p.values[0]].marked]
TEMPLATE_PARAMS = [pytest.param(case.name, id=case.name) for case in CASES]


@functools.lru_cache(maxsize=None)
def tokenizer_for(name: str):
    """One tokenizer per template for the whole module; its chat_template is the original template."""
    return build_tokenizer(original_template(name))


def conversation(kind: str) -> tuple[dict, list, list]:
    conv = to_conversation(row(kind), WHERE)
    return conv, conv["messages"], conv["tools"]


def oracle_conversation(name: str, kind: str) -> tuple[list, list]:
    """The row's messages and tools as the oracle renders them (tool-call arguments as text where the case says so)."""
    _, messages, tools = conversation(kind)
    expect = CASE[name].rows[kind]
    if isinstance(expect, Match) and expect.arguments == "text":
        messages = with_text_arguments(messages)
    if isinstance(expect, Match) and expect.content == "parts":
        messages = with_text_parts(messages)
    return messages, tools


def _render(tok, template: str, messages, tools, generation_prompt: bool):
    try:
        return tok.apply_chat_template(
            messages, tools=tools, chat_template=template, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as e:  # noqa: BLE001 - the template's own error is part of what must match
        return f"<raised {type(e).__name__}: {e}>"


def assert_examples_equal(tok, got: list[dict], want: list[dict]):
    assert len(got) == len(want), f"{len(got)} examples, the oracle has {len(want)}"
    for n, (g, w) in enumerate(zip(got, want)):
        assert set(g) >= {"input_ids", "labels"}, f"example {n}: keys {sorted(g)}"
        g_ids, g_labels = list(g["input_ids"]), list(g["labels"])
        assert tok.decode(g_ids) == tok.decode(w["input_ids"]), (
            f"example {n}: the input text differs from the template's"
        )
        assert g_ids == w["input_ids"], (
            f"example {n}: same text, other tokens (tokenized in pieces, or special tokens added?)"
        )
        assert trained_runs(tok, {"input_ids": g_ids, "labels": g_labels}) == trained_runs(tok, w), (
            f"example {n}: trained text differs"
        )
        assert g_labels == w["labels"], f"example {n}: labels differ"


# ------------------------------------------------------------------------------- the test data


def test_the_shared_real_templates_are_there():
    folder = shared_templates_dir()
    missing = [f"{c.name}.jinja" for c in CASES if c.shared and not c.original_path.is_file()]
    assert not missing, (
        f"missing from {folder.resolve()}: {', '.join(missing)}; these tests read the real chat templates from the "
        f"'shared' folder beside the repository root (set {SHARED_ENV} to where they are)"
    )


def test_a_missing_shared_folder_fails_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(AssertionError, match=rf"Qwen-Qwen3-0\.6B\.jinja is missing: .*nowhere.*set {SHARED_ENV}"):
        original_template("Qwen-Qwen3-0.6B")


@pytest.mark.parametrize("name", TEMPLATE_PARAMS)
def test_every_marker_the_template_writes_is_one_special_token(name):
    case, tok = CASE[name], tokenizer_for(name)
    assert tok.is_fast
    for marker in template_markers(original_template(case)) + [t for t in (case.bos, case.eos) if t]:
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    assert (tok.bos_token, tok.eos_token) == (case.bos, case.eos)


# ------------------------------------------------------------------------ oracle self-checks


@pytest.mark.parametrize("name,kind", MARKED)
def test_marked_copy_renders_like_the_original(name, kind):
    """Byte for byte, on the row and each of its prefixes, with and without the generation prompt."""
    tok, original, marked = tokenizer_for(name), original_template(name), marked_template(name)
    messages, tools = oracle_conversation(name, kind)
    for n in range(1, len(messages) + 1):
        for generation_prompt in (False, True):
            want = _render(tok, original, messages[:n], tools, generation_prompt)
            got = _render(tok, marked, messages[:n], tools, generation_prompt)
            assert got == want, f"messages[:{n}], add_generation_prompt={generation_prompt}"
    outcome = _render(tok, original, messages, tools, False)
    what = outcome if outcome.startswith("<raised") else f"renders {len(outcome)} characters"
    print(f"{name}/{kind}: identical on {2 * len(messages)} renderings; the whole row {what}")


@pytest.mark.parametrize("name,kind", MATCHED)
def test_oracle_trains_exactly_the_reviewed_text(name, kind):
    tok, marked, expect = tokenizer_for(name), marked_template(name), CASE[name].rows[kind]
    messages, tools = oracle_conversation(name, kind)
    reviewed = expected_trained()[f"{name}/{kind}"]
    if expect.arguments == "text":  # the template cannot take the arguments as a mapping: it raises (DeepSeek-V3.1),
        _, as_mapping, _ = conversation(kind)  # or writes Python's repr (`| string`: InternLM2's)
        try:
            as_repr = tok.apply_chat_template(as_mapping, tools=tools, tokenize=False)
        except TypeError:
            pass
        else:
            assert "{'city': 'Paris'}" in as_repr
    for policy in ("full", "per_turn"):
        assert trained_texts(tok, marked, messages, tools, policy) == reviewed[policy], policy

    # transformers' own mask for the marked copy is the oracle's "full" labels, over the original's text; or, where a
    # user message after the last turn writes its close (Apertus, Hunyuan 3), the original's text up to the last turn's
    # end, then that close (the last trained run ends with it); transformers' mask then holds over the rendering with
    # the user message when that rendering starts with it (not when it rewrites the last turn: Hunyuan 3's reasoning)
    [full] = oracle_examples(tok, marked, messages, tools, "full")
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    rendered = messages
    if full["input_ids"] != tok(text, add_special_tokens=False)["input_ids"]:
        closed = tok.decode(full["input_ids"])
        cut = len(os.path.commonprefix([closed, text]))
        assert cut < len(closed) and reviewed["full"][0][-1].endswith(closed[cut:])
        assert full["input_ids"] == tok(closed, add_special_tokens=False)["input_ids"]
        rendered = messages + [PROBE_USER]
    enc = tok.apply_chat_template(
        rendered, tools=tools, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    n = len(full["input_ids"])
    rewritten = not tok.apply_chat_template(rendered, tools=tools, tokenize=False).startswith(text)
    if not rewritten:
        assert full["input_ids"] == list(enc["input_ids"])[:n] and (
            rendered is not messages or n == len(enc["input_ids"])
        )
        assert [int(label != IGNORE_INDEX) for label in full["labels"]] == list(enc["assistant_masks"])[:n]

    # per turn: example i is messages[:i+1] as the original renders it, trained on turn i only; or, where the next
    # message (for the last turn, PROBE_USER) writes the turn's close (Apertus), that rendering cut after the close;
    # where it also rewrites the turn (Hunyuan 3 drops its reasoning), the turn as messages[:i+1] renders it, then it
    per_turn = oracle_examples(tok, marked, messages, tools, "per_turn")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(per_turn) == len(turns)
    for i, example, spans in zip(turns, per_turn, reviewed["per_turn"]):
        prefix = tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        ids = tok(prefix, add_special_tokens=False)["input_ids"]
        if example["input_ids"] != ids:  # the turn, then the close the following message writes
            closed = tok.decode(example["input_ids"])
            cut = len(os.path.commonprefix([closed, prefix]))
            assert cut < len(closed) and spans[0].endswith(closed[cut:])
            assert example["input_ids"] == tok(closed, add_special_tokens=False)["input_ids"]
            after = messages[: i + 2] if i + 1 < len(messages) else messages + [PROBE_USER]
            following = tok.apply_chat_template(after, tools=tools, tokenize=False)
            if following.startswith(prefix):  # not rewritten by it (Apertus): that rendering, cut after the close
                assert following.startswith(closed)
    for example, spans in zip(per_turn, reviewed["per_turn"]):
        runs = trained_runs(tok, example)
        assert len(runs) == 1 and spans[0] in runs[0]  # tokens overlapping the span: the span, maybe a bit more

    # the recorded "auto" policy is the one the template calls for
    alike = turns_render_alike(tok, marked, messages, tools)
    assert expect.auto == ("full" if alike else "per_turn")
    print(f"{name}/{kind}: auto={expect.auto}; full trains {reviewed['full'][0]}")


# ----------------------------------------------------------------------- the masker vs the oracle


def _check_masker(name: str, kind: str, multi_turn: str):
    tok, expect = tokenizer_for(name), CASE[name].rows[kind]
    conv, messages, tools = conversation(kind)
    if isinstance(expect, Refuse):
        with pytest.raises(DataError) as info:
            tokenize_conversation(tok, conv, WHERE, multi_turn=multi_turn)
        message = str(info.value)
        assert message.startswith(WHERE + ": "), message
        assert re.search(expect.pattern, message, re.S), (
            f"{expect.why}; the refusal should match {expect.pattern!r}: {message}"
        )
        return
    policy = expect.auto if multi_turn == "auto" else multi_turn
    fresh, _ = oracle_conversation(name, kind)  # a copy of its own, so the masker cannot change what the oracle sees
    want = oracle_examples(tok, marked_template(name), fresh, tools, policy)
    out = tokenize_conversation(tok, conv, WHERE, multi_turn=multi_turn)
    assert out.policy == policy
    assert out.unterminated == expect.unterminated, "turns with no end-of-turn marker after the text"
    assert_examples_equal(tok, out.examples, want)


@pytest.mark.parametrize("name,kind", ROW_PARAMS)
def test_masker_matches_the_oracle_under_auto(name, kind):
    _check_masker(name, kind, "auto")


@pytest.mark.parametrize("name,kind", ROW_PARAMS)
def test_masker_matches_the_oracle_per_turn(name, kind):
    _check_masker(name, kind, "per_turn")
