"""`phalanx data preview` shows the rows as the loss sees them, and every refusal, without loading model weights."""

from __future__ import annotations

import json

from helpers import chat_row, run_phalanx
from phalanx.config.loader import load_config, overrides_from_flags
from phalanx.data.command import GREEN, MAX_REFUSALS_SHOWN, RESET, RefusalList, preview


def test_preview_marks_trained_tokens_and_lists_every_refused_row(tmp_path):
    rows = [json.dumps(chat_row(i)) for i in range(3)]
    no_answer = chat_row(3)
    no_answer["messages"][-1] = {"role": "assistant"}  # neither content nor tool calls
    rows += [json.dumps(no_answer), "{not json"]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(rows) + "\n")
    # on_bad_row is 'error' (the default): a run would stop at line 4; the preview reads on and lists both.
    proc = run_phalanx(
        "data", "preview", "--dataset_path", str(data), "--rows", "2", "--max_length", "4096", "--test_size", "0"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    headers = [line for line in out.splitlines() if line.startswith("── ")]
    assert len(headers) == 2 and headers[0].startswith(f"── {data} line 1: ") and "(multi_turn full)" in headers[0]
    assert "[[Your BMI is" in out and "[[<tool_call>" in out  # piped: brackets, not colour
    assert "[[<|im_start|>" not in out and "[[You are a careful" not in out  # headers and system text are not trained
    assert f"refused: {data} line 4: messages[4].content: missing" in out
    assert f"refused: {data} line 5: " in out
    summary = [line for line in out.splitlines() if line.startswith("Data: ")]
    assert summary and summary[0].startswith("Data: 5 rows read -> 3 train rows") and "2 refused" in summary[0]

    # A template that writes a variable nothing sets (GigaChat 3.5's current_date) is named in the summary.
    template = tmp_path / "dated.jinja"
    template.write_text(
        "Today: {{ current_date }}\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    plain = tmp_path / "plain.jsonl"
    plain.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    )
    dated = run_phalanx(
        "data",
        "preview",
        "--dataset_path",
        str(plain),
        "--rows",
        "0",
        "--chat_template",
        str(template),
        "--test_size",
        "0",
    )
    assert (
        "   the chat template writes current_date into every row, and nothing sets it: written as empty text "
        "(if the model is served with a value, train with it too: --chat_template_kwargs '{current_date: ...}'"
    ) in dated.stdout, dated.stdout[-3000:] + dated.stderr[-3000:]

    # A default system prompt's variable (Jamba 1.6's default_system_message) is written only into rows that bring no
    # system message: said of those, with their count, and not at all where every row brings one.
    template.write_text(
        "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}"
        "{% else %}{% set system = default_system_message %}{% set rest = messages %}{% endif %}"
        "<|im_start|>system\n{{ system }}<|im_end|>\n{% for m in rest %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    flags = ("--rows", "0", "--chat_template", str(template), "--test_size", "0")
    defaulted = run_phalanx("data", "preview", "--dataset_path", str(plain), *flags)
    assert (
        "   the chat template writes default_system_message into rows without a system message (1 here), and nothing "
        "sets it" in defaulted.stdout
    ), defaulted.stdout[-3000:] + defaulted.stderr[-3000:]
    with_system = tmp_path / "with_system.jsonl"
    system = {"role": "system", "content": "Be brief."}
    with_system.write_text(json.dumps({"messages": [system, *json.loads(plain.read_text())["messages"]]}) + "\n")
    own = run_phalanx("data", "preview", "--dataset_path", str(with_system), *flags)
    assert own.returncode == 0 and "Data: 1 rows read" in own.stdout, own.stdout[-3000:] + own.stderr[-3000:]
    assert "default_system_message" not in own.stdout

    listed = run_phalanx("data", "templates")
    assert listed.returncode == 0 and listed.stdout.startswith("deepseek-r1-distill ")
    typo = run_phalanx("data", "previw")
    assert typo.returncode == 2 and "unknown subcommand 'previw'; accepted: preview, templates" in typo.stderr


def test_preview_counts_the_eval_files_rows_as_eval_rows(tmp_path, tokenizer, write_jsonl):
    """`--eval_dataset_path` rows were counted as train rows ('60 rows read -> 60 train rows' for 50 training rows and
    10 to evaluate on), where the run's own line says '50 train rows, 10 eval rows'."""
    train = write_jsonl(tmp_path / "train.jsonl", [chat_row(i) for i in range(3)])
    held = write_jsonl(tmp_path / "val.jsonl", [chat_row(i) for i in range(3, 5)])
    flags = [("dataset_path", str(train)), ("eval_dataset_path", str(held)), ("max_length", "4096")]
    lines: list[str] = []
    assert preview(load_config(None, overrides_from_flags(flags)), tokenizer, 0, False, lines.append) == 0
    summary = next(line for line in lines if line.startswith("Data: "))
    assert summary.startswith("Data: 5 rows read -> 3 train rows, 2 eval rows, "), summary


def test_preview_colours_on_a_terminal_and_fails_when_nothing_trains(tmp_path, tokenizer, write_jsonl):
    cfg = load_config(
        None,
        overrides_from_flags(
            [
                (
                    "dataset_path",
                    str(
                        write_jsonl(
                            tmp_path / "a.jsonl",
                            [
                                {
                                    "messages": [
                                        {"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "HELLO"},
                                    ]
                                }
                            ],
                        )
                    ),
                )
            ]
        ),
    )
    lines: list[str] = []
    assert preview(cfg, tokenizer, 1, True, lines.append) == 0
    assert f"{GREEN}HELLO<|im_end|>\n{RESET}" in lines[1]
    # ByT5 has no <|im_end|> token: the answer ends with text no generation stops on, and the summary says so.
    note = (
        "   end of turn '<|im_end|>' is no token of this tokenizer: 1 turn trains it as ordinary text, and not the "
        "tokenizer's end-of-sequence token, so generation will not stop after an answer."
    )
    assert any(line.startswith(note) for line in lines), lines

    cfg = load_config(
        None,
        overrides_from_flags(
            [
                (
                    "dataset_path",
                    str(
                        write_jsonl(
                            tmp_path / "b.jsonl",
                            [
                                {
                                    "messages": [
                                        {"role": "user", "content": "x" * 50},
                                        {"role": "assistant", "content": "late"},
                                    ]
                                }
                            ],
                        )
                    ),
                ),
                ("max_length", "20"),
            ]
        ),
    )
    lines.clear()
    assert preview(cfg, tokenizer, 3, False, lines.append) == 1
    summary = next(i for i, line in enumerate(lines) if line.startswith("Data: "))
    assert lines[summary].startswith("Data: 1 rows read -> 0 train rows") and "1 dropped" in lines[summary]
    assert (
        "1 no assistant token left within max_length (cut at max_length 20 before its first assistant token"
        in lines[summary + 1]
    )


def test_rows_refused_one_after_another_for_the_same_reason_are_said_once():
    """A template that reads a token the tokenizer lacks refused all 300 bundled rows: the preview printed the same
    sentence 50 times, each with its line, then "... and 250 more rows"."""
    said: list[str] = []
    refusals = RefusalList(said.append)
    template = "the chat template reads bos_token, which this tokenizer does not have"
    for line in range(1, 301):
        refusals.add(ValueError(f"data.jsonl line {line}: {template}"))
    refusals.add(ValueError("data.jsonl line 301: messages[1].content: missing"))
    refusals.add(ValueError("data.jsonl line 302: messages[1].content: missing"))
    refusals.finish()
    assert said == [
        f"refused: data.jsonl line 1: {template}",
        "refused: 299 more rows for the same reason, line 2 to line 300 of data.jsonl",
        "refused: data.jsonl line 301: messages[1].content: missing",
        "refused: 1 more row for the same reason, line 302 of data.jsonl",
    ]
    # Distinct reasons are each shown, up to the cap; the rest are counted.
    said.clear()
    refusals = RefusalList(said.append)
    for line in range(MAX_REFUSALS_SHOWN + 7):
        refusals.add(ValueError(f"data.jsonl line {line}: messages[{line}].role: missing"))
    refusals.finish()
    assert len(said) == MAX_REFUSALS_SHOWN + 1 and said[-1] == "refused: ... and 7 more rows"
    # A refusal that names no line is repeated as a count alone.
    said.clear()
    refusals = RefusalList(said.append)
    for _ in range(3):
        refusals.add(ValueError("no chat template"))
    refusals.finish()
    assert said == ["refused: no chat template", "refused: 2 more rows for the same reason"]


def test_an_end_of_turn_token_the_model_does_not_stop_at_is_named_with_what_it_stops_at(tmp_path, write_jsonl):
    """A base model's tokenizer (eos <|endoftext|>) under ChatML: answers are trained to end with <|im_end|>, but the
    model's generation config stops at <|endoftext|> only, so the trained model writes <|im_end|> and goes on. The
    summary says so, with both ids; not once the generation config lists the token too (as Llama 3.1's lists
    <|eom_id|> beside <|eot_id|>). Under full fine-tuning it says that the saved model lists the token."""
    from phalanx.models.load import load_tokenizer

    tokenizer = load_tokenizer("embedded:tiny-qwen3")  # ChatML, eos <|im_end|> (1)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = tmp_path / "base-model"  # what generation_stop_ids reads: config.json, generation_config.json
    model.mkdir()
    (model / "config.json").write_text("{}")
    rows = write_jsonl(tmp_path / "rows.jsonl", [chat_row(i) for i in range(2)])

    def summary(stop_ids: list[int], finetune: str = "lora") -> list[str]:
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_ids}))
        flags = [("dataset_path", str(rows)), ("test_size", "0"), ("model_name", str(model)), ("finetune", finetune)]
        lines: list[str] = []
        assert preview(load_config(None, overrides_from_flags(flags)), tokenizer, 0, False, lines.append) == 0
        return lines

    note = (
        f"   end of turn '<|im_end|>' (1) is not a token this model stops at: 4 turns are trained to end with it, and "
        f"generation stops at '<|endoftext|>' ({endoftext}) (the tokenizer's end-of-sequence token and the model's "
        "generation_config.json eos_token_id), so the trained model will write it and go on. Serve it with 1 among "
        "generation_config.json's eos_token_id (a LoRA adapter runs with its base model's; `phalanx export` adds it to "
        "a merged model's), or train with a template whose turns end with a token it stops at (--chat_template "
        "FILE|NAME)"
    )
    got = summary([endoftext])
    assert note in got, got
    assert not any("stops at" in line for line in summary([endoftext, 1]))
    # Full fine-tuning saves the model whole, with a generation_config.json that lists the token (train/run.py).
    saved = note.split(", so the trained model")[0] + (
        "; the fine-tuned model's generation_config.json lists 1 too, so it stops there (a server that stops at the "
        "tokenizer's end-of-sequence token alone needs 1 as a stop token)"
    )
    assert saved in summary([endoftext], "full")
