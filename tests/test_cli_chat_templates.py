"""Real models' chat templates train end to end through `phalanx train`, as users run them (tiny model, CPU)."""

from __future__ import annotations

import json

import pytest

from helpers import read_metrics, run_phalanx, shared_template, write_chat_jsonl

TINY_RUN = (
    "--max_steps",
    "2",
    "--batch_size",
    "2",
    "--max_length",
    "1024",
    "--test_size",
    "0",
    "--save_steps",
    "2",
    "--logging.progress_bar",
    "false",
)


def plain_multi_turn(i: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "You are a sleep coach."},
            {"role": "user", "content": f"I sleep {5 + i % 3} hours. Enough?"},
            {"role": "assistant", "content": "Adults need 7-9 hours.", "reasoning_content": "Compare with guidance."},
            {"role": "user", "content": "How do I get there?"},
            {
                "role": "assistant",
                "content": "<think>Routine first.</think>Keep a steady routine and go to bed earlier.",
            },
        ]
    }


def train(data, out, chat_template: str):
    """A tiny run of `phalanx train` with this template; it must succeed."""
    proc = run_phalanx(
        "train", "--dataset_path", str(data), "--output_dir", str(out), *TINY_RUN, "--chat_template", chat_template
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def plain_rows(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(plain_multi_turn(i)) + "\n" for i in range(4)))
    return plain


@pytest.mark.system
def test_deepseek_r1_distill_template_trains_plain_rows_and_its_corrected_copy_trains_tool_rows(tmp_path):
    out = tmp_path / "r1-plain"
    proc = train(plain_rows(tmp_path), out, str(shared_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")))
    assert "4 rows read -> 4 train rows" in proc.stdout and "multi_turn auto: 4 conversations whole" in proc.stdout
    # The template strips reasoning from every assistant turn: counted, not trained.
    assert "reasoning not rendered by the chat template (so not trained): 8 assistant messages" in proc.stdout
    assert read_metrics(out)[-1]["step"] == 2
    assert "<｜Assistant｜>" in (out / "chat_template.jinja").read_text()

    proc = train(write_chat_jsonl(tmp_path / "tools.jsonl", 4), tmp_path / "r1-tools", "deepseek-r1-distill")
    assert "4 rows read -> 4 train rows" in proc.stdout and "0 refused" in proc.stdout


@pytest.mark.system
def test_qwen3_template_trains_one_row_per_turn(tmp_path):
    """Qwen3 drops past reasoning once a later user query exists: auto splits each conversation per turn."""
    out = tmp_path / "qwen3"
    proc = train(plain_rows(tmp_path), out, str(shared_template("Qwen-Qwen3-0.6B")))
    assert "4 rows read -> 8 train rows" in proc.stdout
    assert "multi_turn auto: 0 conversations whole, 4 split per turn" in proc.stdout
    assert "split per turn because the chat template rewrites past turns, e.g. " in proc.stdout
    assert "reasoning not rendered" not in proc.stdout  # every turn's reasoning trains in its own row
    assert read_metrics(out)[-1]["step"] == 2
