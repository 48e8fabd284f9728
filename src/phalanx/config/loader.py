"""Build a RunConfig from a YAML file, the seeds' flat flags and dotted overrides, with errors that point.

Precedence: schema defaults < YAML file < command-line flags. A problem is reported with
the file and line (for YAML) or the flag, the field, the value found and what is accepted.
"""

from __future__ import annotations

import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Collection, Literal, Optional, Sequence, Union

import yaml
from pydantic import BaseModel, ValidationError

from phalanx.config.flags import BareSwitch, nearest_name, split_flags
from phalanx.config.schema import RunConfig
from phalanx.errors import ConfigError

# The seeds' flat flags (and the few phalanx adds) -> the dotted field they set.
FLAT_FLAGS: dict[str, str] = {
    "model_name": "model.model_name",
    "trust_remote_code": "model.trust_remote_code",
    "finetune": "model.finetune",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "load_in_4bit": "model.load_in_4bit",
    "bnb_4bit_quant_type": "model.bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant": "model.bnb_4bit_use_double_quant",
    "bnb_4bit_compute_dtype": "model.bnb_4bit_compute_dtype",
    "lora_r": "lora.r",
    "r": "lora.r",  # seed 001's train_loop.py
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "target_modules": "lora.target_modules",
    "dataset_path": "data.dataset_path",
    "dataset_name": "data.dataset_name",
    "eval_dataset_path": "data.eval_dataset_path",
    "eval_dataset_split": "data.eval_dataset_split",
    "test_size": "data.test_size",
    "max_length": "data.max_length",
    "truncation": "data.truncation",
    "on_bad_row": "data.on_bad_row",
    "chat_template": "data.chat_template",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "multi_turn": "data.multi_turn",
    "special_token_text": "data.special_token_text",
    "packing": "data.packing",
    "num_epochs": "training.num_epochs",
    "max_steps": "training.max_steps",
    "batch_size": "training.batch_size",
    "batch_tokens": "training.batch_tokens",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "learning_rate": "training.learning_rate",
    "weight_decay": "training.weight_decay",
    "warmup_ratio": "training.warmup_ratio",
    "lr_scheduler": "training.lr_scheduler",
    "max_grad_norm": "training.max_grad_norm",
    "seed": "training.seed",
    "mixed_precision": "training.mixed_precision",
    "eval_steps": "eval.eval_steps",
    "save_steps": "checkpoint.save_steps",
    "save_total_limit": "checkpoint.save_total_limit",
    "log_steps": "logging.log_steps",
    "world_size": "distributed.world_size",
    "backend": "distributed.backend",
    "ddp_comm_hook": "distributed.ddp_comm_hook",
    "strategy": "distributed.strategy",
    "sharding_strategy": "distributed.sharding_strategy",
    "zero_stage": "distributed.zero_stage",
    "offload_optimizer": "distributed.offload_optimizer",
    "offload_param": "distributed.offload_param",
    "deepspeed_config": "distributed.deepspeed_config",
    "deepspeed": "distributed.deepspeed_config",  # seed 003's train.py --deepspeed config/ds_config.json
    "fsdp_config": "distributed.fsdp_config",
    "master_port": "distributed.master_port",
    "max_restarts": "distributed.max_restarts",
    "shutdown_timeout_s": "distributed.shutdown_timeout_s",
    "output_dir": "output_dir",
    "overwrite_output_dir": "overwrite_output_dir",
    "force": "force",
    "resume_from_checkpoint": "checkpoint.resume_from_checkpoint",
    "nan_policy": "training.nan_policy",
}


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def all_dotted_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every settable dotted path, e.g. 'training.learning_rate'."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += all_dotted_fields(ann, prefix + name + ".")
        else:
            out.append(prefix + name)
    return out


def _nearest(name: str, choices: list[str]) -> str:
    close = nearest_name(name, choices, cutoff=0.5)
    return f" Did you mean '{close}'?" if close else ""


def _in_its_section(key: str) -> str:
    """' Did you mean ...?' for a key written outside its section (a flat `max_steps:` at the top of a YAML file, as a
    flag is written, or another tool's name such as `micro_batch_size`): the dotted key it is under."""
    dotted = FLAT_FLAGS.get(key)
    if dotted is None and key in OTHER_TOOLS_FLAGS:
        flag = OTHER_TOOLS_FLAGS[key].split()[0].removeprefix("--")
        dotted = FLAT_FLAGS.get(flag, flag if "." in flag else None)
        said = OTHER_TOOLS_FLAGS[key].split(maxsplit=1)[1:]
        if dotted and said:  # bf16 -> mixed_precision bf16; warmup_steps -> warmup_ratio (a fraction ...)
            return (
                f" Did you mean '{dotted}' {said[0]}?"
                if said[0].startswith("(")
                else f" Did you mean '{dotted}: {said[0]}'?"
            )
    return f" Did you mean '{dotted}' (a key goes under its section)?" if dotted else ""


# Flags of Hugging Face Trainer, TRL and Axolotl that people type out of habit: what phalanx names them (the spelling
# is too far off for a nearest-name guess: `--lr` reads as lr_scheduler).
OTHER_TOOLS_FLAGS = {
    "lr": "--learning_rate",
    "epochs": "--num_epochs",
    "num_train_epochs": "--num_epochs",
    "per_device_train_batch_size": "--batch_size",
    "micro_batch_size": "--batch_size",
    "per_device_eval_batch_size": "--eval.eval_batch_size",
    "max_seq_length": "--max_length",
    "sequence_len": "--max_length",
    "model_name_or_path": "--model_name",
    "base_model": "--model_name",
    "bf16": "--mixed_precision bf16",
    "fp16": "--mixed_precision fp16",
    "logging_steps": "--log_steps",
    "lora_rank": "--lora_r",
    "warmup_steps": "--warmup_ratio (a fraction of the run's steps)",
}


def _yaml_lines(text: str) -> dict[tuple, int]:
    """Map each key path in a YAML document to its 1-based line, for error messages."""
    lines: dict[tuple, int] = {}

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                p = path + (key.value,)
                lines[p] = key.start_mark.line + 1
                walk(value, p)

    try:
        walk(yaml.compose(text), ())
    except yaml.YAMLError:
        pass
    return lines


def _refuse_duplicate_keys(text: str, path: str) -> None:
    """A key given twice in one mapping (a section written twice, say) would silently keep only the last one."""

    def walk(node: Any, where: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                line = key.start_mark.line + 1
                name = ".".join((*where, str(key.value)))
                if key.value in first:
                    raise ConfigError(
                        f"{path} line {line}: '{name}' is given twice (first at line {first[key.value]}); YAML "
                        "would keep only the second one. Merge them into one."
                    )
                first[key.value] = line
                walk(value, (*where, str(key.value)))
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item, where)

    walk(yaml.compose(text), ())


def yaml_error_message(path: str, text: str, exc: yaml.YAMLError) -> str:
    """PyYAML's error, told as `file line N, column C: problem` with the offending line (it names "<unicode string>")."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return f"{path}: not valid YAML: {problem}"
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    where = f"{path} line {mark.line + 1}, column {mark.column + 1}"
    context = getattr(exc, "context", None)
    context_mark = getattr(exc, "context_mark", None)
    if context and context_mark is not None and context_mark.line != mark.line:
        problem += f" ({context} that starts at line {context_mark.line + 1})"
    elif context:
        problem += f" ({context})"
    hint = ""
    if "\t" in line[: mark.column + 1] or "'\\t'" in problem:
        hint = "\nYAML indents with spaces only: replace the tab with spaces."
    return f"{where}: not valid YAML: {problem}\n    {line}\n    {' ' * mark.column}^{hint}"


def read_text_file(path: str, label: str, expected: str) -> str:
    """The text of a file the user named, or a ConfigError that says what `path` is instead (`label`: how to name it)."""
    file = Path(path)
    if not file.is_file():
        what = "is a folder, not a file" if file.is_dir() else "does not exist"
        raise ConfigError(f"{label} {what} (expected {expected})")
    try:
        return file.read_text(encoding="utf-8-sig")  # a leading byte-order mark (Windows editors) is not text
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label}: not a UTF-8 text file (byte {exc.start}); expected {expected}") from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot be read ({exc.strerror}); expected {expected}") from None


def read_json_mapping(path: str, field: str) -> dict:
    """A JSON object read from `path` for config `field` (a DeepSpeed or FSDP file); errors name both and the line."""
    text = read_text_file(path, f"{field} = {path!r}", "a JSON file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        lines = text.splitlines()
        line = lines[exc.lineno - 1] if exc.lineno <= len(lines) else ""
        raise ConfigError(
            f"{field} = {path!r}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}\n"
            f"    {line}\n    {' ' * (exc.colno - 1)}^"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{field} = {path!r}: the top level must be a JSON object {{...}}, found {type(data).__name__}"
        )
    return data


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{'.'.join(parts[:-1])}' is a section; it cannot also be given a value")
        node = child
    node[parts[-1]] = value


def parse_value(text: str) -> Any:
    """Command-line values are YAML scalars: '5e-5' -> float, 'true' -> bool, '[a, b]' -> list."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML reads 5e-5 as a string (it wants 5.0e-5); numbers are what people mean.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return value


def _union_args(annotation: Any) -> tuple:
    """Optional[X] / X | Y -> their members; any other annotation -> itself alone."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _takes_as_is(annotation: Any, value: Any) -> bool:
    """Whether a field of type `annotation` accepts the bool or number YAML made, without turning it into text."""
    for member in _union_args(annotation):
        if typing.get_origin(member) is Literal:
            if any(type(choice) is type(value) and choice == value for choice in typing.get_args(member)):
                return True
        elif member is bool:
            if isinstance(value, bool):
                return True
        elif member in (int, float):
            if not isinstance(value, bool):
                return True
        elif member in (str, Path) or member is type(None):
            continue
        else:
            return True  # a type this check does not know (a list, a section): pydantic judges the value
    return False


def _takes_text(annotation: Any) -> bool:
    for member in _union_args(annotation):
        if member in (str, Path):
            return True
        if typing.get_origin(member) is Literal and any(isinstance(c, str) for c in typing.get_args(member)):
            return True
    return False


def _accepted(annotation: Any) -> str:
    """What a field takes, in words, for an error about a missing value."""
    kinds: list[str] = []
    for member in _union_args(annotation):
        if typing.get_origin(member) is Literal:
            choices = typing.get_args(member)
            kinds.append(("one of " if len(choices) > 1 else "") + ", ".join(repr(c) for c in choices))
        elif member in (int, float):
            kinds.append("a number")
        elif member is Path:
            kinds.append("a path")
        elif member is str:
            kinds.append("a text")
        elif typing.get_origin(member) is list:
            kinds.append("a list such as [a, b]")
        elif member is not type(None):
            kinds.append(getattr(member, "__name__", str(member)))
    return " or ".join(dict.fromkeys(kinds)) or "a value"


def _list_item(annotation: Any) -> Any:
    for member in _union_args(annotation):
        if typing.get_origin(member) is list and typing.get_args(member):
            return typing.get_args(member)[0]
    return None


def _section(annotation: Any) -> Optional[type[BaseModel]]:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def keep_typed_text(value: Any, node: Optional[yaml.Node], annotation: Any) -> Any:
    """`value` as YAML read it from `node`, with each unquoted scalar that a text field receives put back as typed.

    YAML 1.1 reads no/off/yes/on as booleans and 1.10 as the number 1.1, so `mixed_precision: no` (or the flag
    `--mixed_precision no`) would reach the schema as False. A field whose type takes text but not the bool or
    number gets the characters the user wrote; bool fields keep their yes/no/true/false; null stays null. Driven
    by the schema's annotations, so every string and choice field is covered, today's and tomorrow's."""
    if isinstance(node, yaml.ScalarNode):
        # A number field given yes/no gets the text too, so it is refused by name instead of becoming 1 or 0.
        if (
            isinstance(value, (bool, int, float))
            and node.style is None
            and not _takes_as_is(annotation, value)
            and (_takes_text(annotation) or isinstance(value, bool))
        ):
            return node.value
        return value
    if isinstance(node, yaml.SequenceNode) and isinstance(value, list) and len(node.value) == len(value):
        item = _list_item(annotation)
        if item is not None:
            return [keep_typed_text(v, n, item) for v, n in zip(value, node.value)]
        return value
    section = _section(annotation)
    if isinstance(node, yaml.MappingNode) and isinstance(value, dict) and section is not None:
        for key_node, value_node in node.value:
            key = key_node.value
            if key in value and key in section.model_fields:
                value[key] = keep_typed_text(value[key], value_node, section.model_fields[key].annotation)
    return value


def field_annotation(dotted: str) -> Any:
    """The type annotation of a dotted field such as 'training.mixed_precision' (None when there is no such field)."""
    annotation: Any = RunConfig
    for part in dotted.split("."):
        section = _section(annotation)
        if section is None or part not in section.model_fields:
            return None
        annotation = section.model_fields[part].annotation
    return annotation


def _field_summary(dotted: str) -> str:
    """The first sentence of a field's description."""
    section: Any = RunConfig
    *parents, name = dotted.split(".")
    for part in parents:
        section = section.model_fields[part].annotation
    description = section.model_fields[name].description or dotted
    return description.split(". ")[0].rstrip(".")


def parse_flag_value(dotted: str, text: str) -> Any:
    """A flag's value as YAML reads it (parse_value), except that a text or choice field gets the text as typed."""
    value = parse_value(text)
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        # A mapping that does not parse ('{enable_thinking: false' without its brace) reached validation as text,
        # answered only "Input should be a valid dictionary"; say what YAML found. A field that takes text keeps it.
        members = _union_args(field_annotation(dotted))
        if str not in members and any(typing.get_origin(m) is dict for m in members):
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"command line: {dotted} = {text!r} is not a YAML or JSON mapping ({problem}); write it as "
                "'{name: value, ...}', e.g. --chat_template_kwargs '{enable_thinking: false}'"
            ) from None
        return value
    return keep_typed_text(value, node, field_annotation(dotted))


def load_config(path: Optional[str] = None, overrides: Optional[dict[str, Any]] = None) -> RunConfig:
    """Read the YAML at `path` (optional), apply dotted `overrides`, validate, and return a RunConfig."""
    tree: dict = {}
    lines: dict[tuple, int] = {}
    source = "command line"
    if path is not None:
        text = read_text_file(path, f"config file {path}", "a YAML file such as configs/demo.yaml")
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(yaml_error_message(path, text, exc)) from None
        _refuse_duplicate_keys(text, path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of sections (model:, data:, training: ...), found {type(loaded).__name__}"
            )
        tree = keep_typed_text(loaded, yaml.compose(text), RunConfig)
        lines = _yaml_lines(text)
        source = path
    from_cli: set[tuple] = set()
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
        from_cli.add(tuple(dotted.split(".")))
    if path is not None:
        _refuse_paths_meant_beside_the_config(tree, path, lines, from_cli)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source, lines, from_cli)) from None


# The fields that name a file or folder to read: what a config written beside its data names relatively.
READ_PATH_FIELDS = (
    ("model", "model_name"),
    ("data", "dataset_path"),
    ("data", "eval_dataset_path"),
    ("data", "chat_template"),
    ("checkpoint", "resume_from_checkpoint"),
    ("distributed", "deepspeed_config"),
    ("distributed", "fsdp_config"),
)


def _refuse_paths_meant_beside_the_config(tree: dict, path: str, lines: dict[tuple, int], from_cli: set[tuple]) -> None:
    """Relative paths in a config are read from the folder phalanx runs in, as the seeds' scripts read theirs. Run
    from elsewhere (`phalanx train project/run.yaml`), a file that sits beside the config was reported missing with no
    word of where it was looked for, or a model folder was looked up on the Hub: name both places."""
    here, beside = Path.cwd(), Path(path).resolve().parent
    if beside == here.resolve():
        return
    for key in READ_PATH_FIELDS:
        value = tree.get(key[0], {}).get(key[1]) if isinstance(tree.get(key[0]), dict) else None
        if key in from_cli or not isinstance(value, str) or not value or Path(value).is_absolute():
            continue
        if value.startswith("~") or (here / value).exists() or not (beside / value).exists():
            continue
        raise ConfigError(
            f"{path} line {lines.get(key, '?')}: {'.'.join(key)} = {value!r} is read from the folder phalanx runs in, "
            f"{here}, which has no {value}; the config's folder has it ({beside / value}). Run phalanx from "
            f"{beside}, or write the path from where it runs (or in full)"
        )


def _explain(exc: ValidationError, source: str, lines: dict[tuple, int], from_cli: set[tuple]) -> str:
    problems = []
    union_fields_done: set[tuple] = set()
    fields = set(all_dotted_fields())
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        union_field = _union_field(loc, fields)
        if union_field is not None:
            # pydantic says why the value fits no member of a union, one line per member under names such as
            # "literal['all-linear']" and "list[str]": one line saying what the field accepts reads better.
            if union_field in union_fields_done:
                continue
            union_fields_done.add(union_field)
            loc, err = union_field, {**err, "msg": f"accepted: {_accepted(field_annotation('.'.join(union_field)))}"}
        dotted = ".".join(loc)
        if tuple(loc) in from_cli:
            where = "command line"
        elif tuple(loc) in lines:
            where = f"{source} line {lines[tuple(loc)]}"
        else:
            where = source
        if err["type"] == "extra_forbidden":
            section_model = _section_model(loc[:-1])
            choices = _field_names(section_model) if section_model else []
            hint = _nearest(loc[-1], choices) or _in_its_section(loc[-1])
            accepted = ", ".join(choices)
            problems.append(f"{where}: unknown key '{dotted}'.{hint} Keys accepted here: {accepted}")
        else:
            value = err.get("input")
            # A validator's own message needs no "Value error, " in front (pydantic's wording for ValueError).
            message = err["msg"].removeprefix("Value error, ")
            if isinstance(value, dict):  # a check across fields (of the section `dotted`, or of the whole config)
                if where == source:
                    where = _lines_named(message, source, lines)
                problems.append(f"{where}: {f'{dotted}: ' if dotted else ''}{message}")
            else:
                problems.append(f"{where}: field '{dotted}' = {value!r}: {message}")
    return "invalid configuration:\n  " + "\n  ".join(problems)


def _union_field(loc: tuple, fields: set[str]) -> Optional[tuple]:
    """The field a union-member error is about (('lora', 'target_modules') for its loc plus "list[str]"), else None."""
    for end in range(len(loc) - 1, 0, -1):
        if ".".join(loc[:end]) in fields:
            members = [m for m in _union_args(field_annotation(".".join(loc[:end]))) if m is not type(None)]
            return loc[:end] if len(members) > 1 and not loc[end].isdigit() else None
    return None


def _lines_named(message: str, source: str, lines: dict[tuple, int]) -> str:
    """`source lines 3, 9` for the keys a cross-field message names (as `a.b` or `--b`), so each can be found."""
    named = set()
    for path, line in lines.items():
        spellings = [re.escape(".".join(path)), "--" + re.escape(path[-1])]
        if any(re.search(rf"(?<![\w.-]){spelling}(?![\w.])", message) for spelling in spellings):
            named.add(line)
    if not named:
        return source
    return f"{source} line{'s' if len(named) > 1 else ''} {', '.join(map(str, sorted(named)))}"


def _section_model(loc: tuple) -> Optional[type[BaseModel]]:
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def overrides_from_flags(pairs: list[tuple[str, str]], own_flags: Collection[str] = ()) -> dict[str, Any]:
    """Turn ('lora_r', '8') or ('training.seed', '3') into dotted overrides; unknown flags name the nearest, the
    command's own flags (`own_flags`: plan's --device) among the candidates."""
    dotted_fields = all_dotted_fields()
    out: dict[str, Any] = {}
    for flag, raw in pairs:
        dotted = FLAT_FLAGS.get(flag, flag if flag in dotted_fields else None)
        if dotted is not None:
            if isinstance(raw, BareSwitch) and bool not in _union_args(field_annotation(dotted)):
                raise ConfigError(
                    f"--{flag} was given no value: it sets {dotted}, which takes {_accepted(field_annotation(dotted))} "
                    f"({_field_summary(dotted)}); write --{flag} VALUE"
                )
            out[dotted] = parse_flag_value(dotted, raw)
        else:
            hint = (
                f" phalanx calls it {OTHER_TOOLS_FLAGS[flag]}."
                if flag in OTHER_TOOLS_FLAGS
                else _nearest(flag, list(FLAT_FLAGS) + dotted_fields + list(own_flags))
            )
            raise ConfigError(
                f"unknown flag --{flag}.{hint} Flags are the seeds' names (--{', --'.join(sorted(FLAT_FLAGS)[:6])} ...) "
                "or any dotted config field such as --training.learning_rate; `phalanx train --help` lists them."
            )
    return out


def config_from_args(
    args: Sequence[str], own_flags: Collection[str] = (), flags_only: bool = False, config_path: Optional[str] = None
) -> tuple[RunConfig, Optional[str], list[tuple[str, str]]]:
    """`[CONFIG.yaml] --flag value ...` read as `phalanx train` reads it -> (the RunConfig, the config path, every
    flag pair), so that every command that takes a run config takes it the same way.

    own_flags: the command's own flags (plan's --device); they stay in the pairs and do not reach the config.
    flags_only: `args` are what a launcher passes on to `phalanx train` after its `--`; the file is `config_path`
    (the launcher's --config), and a file among `args` is refused."""
    path, pairs = split_flags(args)
    named = [value for name, value in pairs if name == "config"]
    if named:  # seed 003's train.py took `--config config.yaml`: the same file as the positional CONFIG.yaml
        if flags_only or path is not None or len(named) > 1 or isinstance(named[0], BareSwitch):
            where = "the launcher's --config" if flags_only else "CONFIG.yaml or --config CONFIG.yaml, once"
            raise ConfigError(f"give the config file as {where}; found {[path, *named] if path else named}")
        path, pairs = named[0], [(name, value) for name, value in pairs if name != "config"]
    if flags_only:
        if path is not None:
            raise ConfigError(
                f"after `--` give --flag value pairs for `phalanx train`, not a file ({path}); use --config"
            )
        path = config_path
    mine = [(name, value) for name, value in pairs if name not in own_flags]
    cfg = load_config(path, overrides_from_flags(mine, own_flags))
    return cfg, path, pairs
