"""metrics.jsonl across a crash: what a resume keeps of the file a killed run left."""

import json

from phalanx.observe.metrics import Reporter, last_logged_step


def test_a_line_cut_short_by_a_crash_is_dropped_not_a_resume_that_cannot_start(tmp_path, capsys):
    """A node that dies (or a disk that fills) while a line is written leaves metrics.jsonl ending in half a record.
    The rerun resumes from checkpoint-4: it keeps steps 1-4, drops step 5 and the torn line, says so, and writes a
    clean file (it was a JSONDecodeError traceback on every rerun until the file was edited by hand)."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": step, "loss": 1.0 / step}) for step in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"kind": "train", "step": 6, "lo')
    assert last_logged_step(tmp_path) == 5
    reporter = Reporter(tmp_path, is_main=True, total_steps=8, tensorboard=False, progress_bar=False, resume_step=4)
    reporter.log(5, {"loss": 0.5}, kind="train")
    reporter.close()
    assert f"{path}: dropped 1 line(s) that hold no record" in capsys.readouterr().out
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25), (5, 0.5)]
    assert [r["step"] for r in reporter.history] == [1, 2, 3, 4, 5]
