"""`phalanx data`: look at the data as the loss will see it, before any model weights are loaded.

    phalanx data preview [CONFIG.yaml] [--rows N] [--color auto|always|never] [--flag value ...]
    phalanx data templates

`preview` takes the same config and flags as `phalanx train`, loads only the tokenizer (with
`--chat_template` applied), and reads every row through the training pipeline: the first N rows
are printed with their trained tokens marked (green on a terminal, ``[[...]]`` otherwise) and their
target counts; every refused row is printed with its reason; the last line is the data summary a
run prints. It exits 1 when no row would train.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

from phalanx.errors import PhalanxError

USAGE = (
    "usage: phalanx data preview [CONFIG.yaml] [--rows N] [--color auto|always|never] [--flag value ...]\n"
    "       phalanx data templates\n\n"
    "preview: the first N rows (default 3) with the tokens the loss trains on marked, every refused row with its\n"
    "reason, and the data summary; the same config and flags as `phalanx train`; no model weights are loaded.\n"
    "templates: the chat templates phalanx ships (pass one to --chat_template by name)."
)
MAX_REFUSALS_SHOWN = 50
GREEN, RESET = "\x1b[1;32m", "\x1b[0m"


def main(args: Sequence[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if any(arg in ("-h", "--help") for arg in args[1:2]):
        print(USAGE)  # `phalanx data preview --help`: the usage, not "unknown flag --help"
        return 0
    if args[0] == "templates":
        if len(args) > 1:
            raise PhalanxError(f"phalanx data templates takes no arguments, got {args[1]!r}\n\n{USAGE}")
        return _templates()
    if args[0] == "preview":
        return _preview(list(args[1:]))
    raise PhalanxError(f"phalanx data: unknown subcommand {args[0]!r}; accepted: preview, templates\n\n{USAGE}")


def _templates() -> int:
    from phalanx.config.chat_templates import shipped_templates

    for name, description in shipped_templates().items():
        print(f"{name:<24} {description}")
    return 0


def _preview(args: list[str]) -> int:
    rows, args = _take(args, "rows", "3", int, "a whole number of rows, e.g. --rows 5")
    if rows < 0:
        raise PhalanxError(f"--rows {rows}: expected a whole number of rows, 0 or more, e.g. --rows 5")
    color, args = _take(args, "color", "auto", str, "auto, always or never")
    if color not in ("auto", "always", "never"):
        raise PhalanxError(f"--color {color!r}: accepted values are auto, always, never")
    from phalanx.config.loader import config_from_args
    from phalanx.runtime.quiet import quiet_libraries

    cfg = config_from_args(args, own_flags=("rows", "color"))[0]  # the same config and flags as `phalanx train`
    quiet_libraries()
    from phalanx.models.load import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.model_name, cfg.model.trust_remote_code, cfg.data.chat_template)
    use_color = color == "always" or (color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ)
    return preview(cfg, tokenizer, rows, use_color, print)


def preview(cfg: Any, tokenizer: Any, rows: int, color: bool, say: Callable[[str], None]) -> int:
    """Print the first ``rows`` rows marked, the refusals (RefusalList), and the summary; 1 when no row would train."""
    from phalanx.data.prepare import (
        DataReport,
        DataSource,
        RowCounts,
        add_template_notes,
        describe_report,
        iter_outcomes,
    )
    from phalanx.data.sources import refuse_held_out_files_among_training_files
    from phalanx.models.load import generation_config_eos_ids

    counts, shown = RowCounts(), [0]
    refusals = RefusalList(say)
    counts.on_refusal = refusals.add
    # Every row is read, whatever on_bad_row says: a preview lists all refusals instead of stopping at the first.
    data_cfg = cfg.data.model_copy(update={"on_bad_row": "skip"})
    sources = [DataSource.for_training(data_cfg)]
    if sources[0].kind == "path":  # what training refuses before reading a row (a traj_val.jsonl in the folder)
        refuse_held_out_files_among_training_files(sources[0].target, data_cfg.eval_dataset_path)
    eval_source = DataSource.for_evaluation(data_cfg)
    if eval_source is not None:
        sources.append(eval_source)
    trained: list[dict] = []
    evaluated: list[dict] = []  # rows of eval_dataset_path (or eval_dataset_split), counted as the run counts them
    for source in sources:
        for outcome in iter_outcomes(source, data_cfg, tokenizer, counts):
            (trained if source is sources[0] else evaluated).extend(outcome.examples)
            if outcome.tokenized is not None and shown[0] < rows:
                shown[0] += 1
                _show(outcome, tokenizer, color, say)
    refusals.finish()
    # test_size is not held out here (which rows it holds out depends on the seed): every training row counts as one.
    report = DataReport(**counts.report(trained, evaluated or None), cache_hit=False, cache_dir="")
    add_template_notes(report, data_cfg, tokenizer, generation_config_eos_ids(cfg.model.model_name))
    lines = describe_report(report, cfg.data, saves_stop_tokens=cfg.model.finetune == "full")
    say("Data: " + lines[0])
    for line in lines[1:]:
        if not line.lstrip().startswith("refused:"):  # printed above, each one
            say(line)
    return 0 if trained else 1


class RefusalList:
    """Prints refused rows as they come, up to MAX_REFUSALS_SHOWN. Rows refused one after another for the same reason
    (a template that reads a token this tokenizer lacks refuses all 300 bundled rows) are said once, then as one line
    naming the rows: the reason is what a reader needs, not 50 copies of it."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.shown = self.hidden = 0
        self.last_reason: str | None = None
        self.repeats: list[str] = []  # where the rows refused again for last_reason are

    def add(self, error: Exception) -> None:
        where, reason = _where_and_reason(str(error))
        if reason == self.last_reason:
            self.repeats.append(where)
            return
        self._say_repeats()
        if self.shown == MAX_REFUSALS_SHOWN:
            self.hidden += 1
            self.last_reason = None
            return
        self.shown += 1
        self.last_reason = reason
        self.say(f"refused: {error}")

    def finish(self) -> None:
        self._say_repeats()
        if self.hidden:
            self.say(f"refused: ... and {self.hidden} more rows")

    def _say_repeats(self) -> None:
        if not self.repeats:
            return
        rows = self.repeats
        files = {where.rpartition(" line ")[0] for where in rows}
        if len(files) == 1 and all(" line " in where for where in rows):
            numbers = [where.rpartition(" line ")[2] for where in rows]
            named = f"line {numbers[0]}" + (f" to line {numbers[-1]}" if len(rows) > 1 else "") + f" of {files.pop()}"
        elif all(rows):
            named = rows[0] + (f" to {rows[-1]}" if len(rows) > 1 else "")
        else:
            named = ""  # a refusal that names no place (said as it came)
        plural = "s" if len(rows) > 1 else ""
        self.say(f"refused: {len(rows)} more row{plural} for the same reason" + (f", {named}" if named else ""))
        self.repeats = []


def _where_and_reason(message: str) -> tuple[str, str]:
    """'data.jsonl line 28: the template ...' -> ('data.jsonl line 28', 'the template ...')."""
    where, colon, reason = message.partition(": ")
    return (where, reason) if colon and " line " in where else ("", message)


def _show(outcome: Any, tokenizer: Any, color: bool, say: Callable[[str], None]) -> None:
    result = outcome.tokenized
    n = len(result.examples)
    dropped = n - len(outcome.examples)
    for k, example in enumerate(outcome.examples):
        turn = f", turn {k + 1} of {n}" if result.policy == "per_turn" else ""
        say(
            f"── {outcome.where}{turn}: {len(example['input_ids'])} tokens, {_targets(example)} trained "
            f"(multi_turn {result.policy})"
        )
        say(marked_text(tokenizer, example, color))
    if dropped:
        say(f"── {outcome.where}: {dropped} of its {n} rows dropped (see the summary)")


def marked_text(tokenizer: Any, example: dict, color: bool) -> str:
    """The row's text with the trained tokens marked; runs are decoded whole so multi-byte characters survive."""
    opened, closed = (GREEN, RESET) if color else ("[[", "]]")
    pieces, run, trained = [], [], None
    for token, label in zip(example["input_ids"], example["labels"]):
        now = label != -100
        if trained is not None and now != trained:
            pieces.append(_decode(tokenizer, run, trained, opened, closed))
            run = []
        run.append(token)
        trained = now
    if run:
        pieces.append(_decode(tokenizer, run, bool(trained), opened, closed))
    return "".join(pieces)


def _decode(tokenizer: Any, ids: list[int], trained: bool, opened: str, closed: str) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return f"{opened}{text}{closed}" if trained else text


def _targets(example: dict) -> int:
    return sum(1 for label in example["labels"] if label != -100)


def _take(args: list[str], name: str, default: str, kind: type, accepted: str) -> tuple[Any, list[str]]:
    """Remove ``--name VALUE`` (or ``--name=VALUE``) from args: a preview option, not a config field."""
    rest, value, i = [], default, 0
    while i < len(args):
        arg = args[i]
        if arg == f"--{name}":
            if i + 1 >= len(args):
                raise PhalanxError(f"--{name} needs a value: {accepted}")
            value, i = args[i + 1], i + 2
            continue
        if arg.startswith(f"--{name}="):
            value = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    try:
        return kind(value), rest
    except ValueError:
        raise PhalanxError(f"--{name} {value!r}: expected {accepted}") from None
