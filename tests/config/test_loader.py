"""The config loader: YAML + flags + dotted overrides, and errors that point at the problem."""

import re
from pathlib import Path

import pytest

from phalanx.config.flags import split_flags
from phalanx.config.loader import FLAT_FLAGS, all_dotted_fields, load_config, overrides_from_flags, parse_value
from phalanx.errors import ConfigError, PhalanxError

SEED_FLAGS = [
    "model_name",
    "dataset_path",
    "dataset_name",
    "output_dir",
    "num_epochs",
    "batch_size",
    "learning_rate",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "eval_steps",
    "save_steps",
    "log_steps",
    "world_size",
    "max_length",
    "r",
    "max_steps",
    "seed",
    "warmup_ratio",
    "lr_scheduler",
    "finetune",
    "test_size",
    "eval_dataset_path",
]


def test_every_seed_flag_maps_to_a_real_field():
    fields = set(all_dotted_fields())
    for flag in SEED_FLAGS:
        assert flag in FLAT_FLAGS, flag
        assert FLAT_FLAGS[flag] in fields, flag


def test_flags_override_yaml(tmp_path: Path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("training:\n  learning_rate: 1.0e-4\n  batch_size: 2\nlora:\n  r: 8\n")
    cfg = load_config(
        str(cfg_file), overrides_from_flags([("learning_rate", "5e-5"), ("r", "32"), ("training.seed", "7")])
    )
    assert cfg.training.learning_rate == 5e-5
    assert cfg.training.batch_size == 2
    assert cfg.lora.r == 32
    assert cfg.training.seed == 7


def test_parse_value_reads_numbers_people_write():
    assert parse_value("5e-5") == 5e-5
    assert parse_value("3") == 3
    assert parse_value("true") is True
    assert parse_value("[q_proj, v_proj]") == ["q_proj", "v_proj"]
    assert parse_value("./data") == "./data"


def test_unknown_yaml_key_names_line_and_nearest(tmp_path: Path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("training:\n  batch_size: 2\n  learnig_rate: 1.0e-4\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg_file))
    msg = str(err.value)
    assert f"{cfg_file} line 3" in msg
    assert "training.learnig_rate" in msg and "Did you mean 'learning_rate'" in msg


def test_a_key_outside_its_section_is_answered_with_its_dotted_name(tmp_path: Path):
    """A flat `max_steps:` at the top of a YAML file (as the flag is written), or another tool's key there: the key it
    is under is named; before, only the section names were listed."""
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("max_steps: 1\nmicro_batch_size: 4\nbf16: true\nwarmup_steps: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg_file))
    msg = str(err.value)
    assert f"{cfg_file} line 1: unknown key 'max_steps'. Did you mean 'training.max_steps' (a key goes under" in msg
    assert "line 2: unknown key 'micro_batch_size'. Did you mean 'training.batch_size'" in msg
    assert "line 3: unknown key 'bf16'. Did you mean 'training.mixed_precision: bf16'?" in msg
    assert "line 4: unknown key 'warmup_steps'. Did you mean 'training.warmup_ratio' (a fraction of the run's" in msg


def test_a_dataset_split_without_a_dataset_name_is_refused_not_left_unread(tmp_path: Path):
    """--dataset_split test with a --dataset_path trained on the path's rows (a save_to_disk DatasetDict's 'train')
    without a word; it names dataset_name as the way to pick a split."""
    with pytest.raises(ConfigError) as err:
        load_config(None, {"data.dataset_path": str(tmp_path / "saved"), "data.dataset_split": "test"})
    msg = str(err.value)
    assert "dataset_split 'test' names a split of dataset_name, which is not set" in msg, msg
    assert f"give {tmp_path / 'saved'} as dataset_name" in msg, msg
    assert load_config(None, {"data.dataset_path": str(tmp_path / "saved"), "data.dataset_split": "train"})
    assert load_config(None, {"data.dataset_name": str(tmp_path / "saved"), "data.dataset_split": "test"})


def test_another_tools_flag_is_answered_with_phalanxs_name():
    """`--lr` (Axolotl), `--num_train_epochs`, `--bf16` (Trainer): named as phalanx spells them, where the nearest
    spelling would mislead (`--lr` is closest to lr_scheduler)."""
    from phalanx.config.flags import split_flags
    from phalanx.config.loader import OTHER_TOOLS_FLAGS, overrides_from_flags

    for flag, ours in (("lr", "--learning_rate"), ("num_train_epochs", "--num_epochs"), ("bf16", "--mixed_precision")):
        with pytest.raises(ConfigError, match=f"unknown flag --{flag}. phalanx calls it {ours}"):
            overrides_from_flags(split_flags([f"--{flag}", "1"])[1])
    for name in OTHER_TOOLS_FLAGS.values():  # every answer is a flag phalanx takes
        flag, _, value = name.split(" (")[0].removeprefix("--").partition(" ")
        overrides_from_flags(split_flags([f"--{flag}", value or ("0.1" if "ratio" in flag else "2")])[1])


def test_wrong_type_names_field_and_value(tmp_path: Path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("training:\n  batch_size: lots\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg_file))
    assert "line 2" in str(err.value) and "training.batch_size" in str(err.value) and "'lots'" in str(err.value)


def test_target_modules_take_the_comma_separated_names_people_write(tmp_path: Path):
    """`--target_modules q_proj,v_proj` and `--target_modules q_proj` were refused with one line per union member
    ("lora.target_modules.literal['all-linear']", "lora.target_modules.list[str]"); only a YAML list worked."""
    for raw, names in (
        ("q_proj,v_proj", ["q_proj", "v_proj"]),
        ("q_proj", ["q_proj"]),
        ("[k_proj, o_proj]", ["k_proj", "o_proj"]),
    ):
        assert load_config(None, overrides_from_flags([("target_modules", raw)])).lora.target_modules == names
    assert (
        load_config(None, overrides_from_flags([("target_modules", "all-linear")])).lora.target_modules == "all-linear"
    )
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("lora:\n  target_modules: q_proj, v_proj\n")
    assert load_config(str(cfg_file)).lora.target_modules == ["q_proj", "v_proj"]
    # What fits no member of the union: one line, what the field accepts, where it was written.
    cfg_file.write_text("lora:\n  r: 4\n  target_modules: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg_file))
    assert str(err.value).splitlines()[1:] == [
        f"  {cfg_file} line 3: field 'lora.target_modules' = 3: accepted: 'all-linear' or a list such as [a, b]"
    ]


def test_a_second_value_after_a_flag_is_named_with_the_one_value_form():
    """`--target_modules q_proj v_proj` (argparse's nargs habit) read v_proj as the config file: "config file v_proj
    does not exist". A config file by its extension is still taken anywhere."""
    with pytest.raises(
        PhalanxError,
        match=r"unexpected argument 'v_proj' after --target_modules q_proj: .*"
        r"--target_modules q_proj,v_proj",
    ):
        split_flags(["--target_modules", "q_proj", "v_proj"])
    assert split_flags(["--max_steps", "3", "run.yaml"]) == ("run.yaml", [("max_steps", "3")])
    assert split_flags(["run.yaml", "--max_steps", "3"]) == ("run.yaml", [("max_steps", "3")])


def test_batch_size_zero_is_refused_from_the_command_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides_from_flags([("batch_size", "0")]))
    assert (
        "command line" in str(err.value)
        and "training.batch_size" in str(err.value)
        and "greater than 0" in str(err.value)
    )


def test_retention_below_two_checkpoints_is_refused_with_the_reason(tmp_path: Path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("checkpoint:\n  save_steps: 10\n  save_total_limit: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg_file))
    msg = str(err.value)
    assert f"{cfg_file} line 3" in msg and "checkpoint.save_total_limit" in msg
    assert "at least 2 (got 1)" in msg and "Value error" not in msg
    assert load_config(None, overrides_from_flags([("save_total_limit", "2")])).checkpoint.save_total_limit == 2


def test_unknown_flag_suggests_nearest():
    with pytest.raises(ConfigError) as err:
        overrides_from_flags([("learning_rat", "1")])
    assert "--learning_rat" in str(err.value) and "learning_rate" in str(err.value)


def test_flag_without_value_is_refused_unless_it_is_a_switch():
    _, pairs = split_flags(["--overwrite_output_dir", "--learning_rate"])
    with pytest.raises(ConfigError) as err:
        overrides_from_flags(pairs)
    assert "--learning_rate was given no value" in str(err.value) and "takes a number" in str(err.value)
    _, pairs = split_flags(["--mixed_precision", "--overwrite_output_dir"])
    with pytest.raises(ConfigError, match="one of 'auto', 'no', 'fp16', 'bf16'"):
        overrides_from_flags(pairs)
    # A switch at the end of the line, or before another flag, is on; a typed 'true' still reaches a text field.
    _, pairs = split_flags(["--overwrite_output_dir", "--seed", "3"])
    assert overrides_from_flags(pairs) == {"overwrite_output_dir": True, "training.seed": 3}
    assert overrides_from_flags([("dataset_name", "true")])["data.dataset_name"] == "true"


def test_chat_template_kwargs_take_the_templates_own_variables_only():
    flags = overrides_from_flags([("chat_template_kwargs", "{enable_thinking: false, reasoning_effort: low}")])
    cfg = load_config(None, flags)
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides_from_flags([("chat_template_kwargs", "{add_generation_prompt: true}")]))
    assert "data.chat_template_kwargs" in str(err.value) and "add_generation_prompt: set by phalanx" in str(err.value)


def test_missing_config_file_is_named(tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path / "nope.yaml"))
    assert "nope.yaml does not exist" in str(err.value)


def test_a_config_path_that_is_a_folder_or_not_text_is_named_for_what_it_is(tmp_path: Path):
    with pytest.raises(ConfigError, match="is a folder, not a file .expected a YAML file"):
        load_config(str(tmp_path))
    binary = tmp_path / "model.yaml"
    binary.write_bytes(b"training:\n  seed: 1\n\xf0\x28\x8c\x28\n")
    with pytest.raises(ConfigError, match=r"model.yaml: not a UTF-8 text file \(byte 20\); expected a YAML file"):
        load_config(str(binary))


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "model:\n  lora_r: [1, 2\ntraining:\n  seed: 1\n",
            "bad.yaml line 3, column 9: not valid YAML: expected ',' or ']', but got ':' (while parsing a flow "
            "sequence that starts at line 2)\n    training:\n            ^",
        ),
        ("model:\n  finetune: lora\n\tseed: 1\n", "bad.yaml line 3, column 1: not valid YAML: found character '\\t'"),
    ],
)
def test_yaml_syntax_errors_name_the_file_line_and_column(tmp_path: Path, text, message):
    """PyYAML alone names the stream "<unicode string>"; the user needs the file, the line and a caret."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert message in str(err.value) and "<unicode string>" not in str(err.value)
    if "\t" in text:
        assert "YAML indents with spaces only" in str(err.value)


def test_checks_across_fields_name_the_lines_of_the_keys_they_mention(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text("distributed:\n  strategy: deepspeed\n  zero_stage: 2\n  offload_param: true\n")
    with pytest.raises(ConfigError, match="run.yaml lines 3, 4: --offload_param needs --zero_stage 3"):
        load_config(str(path))
    path.write_text("training:\n  seed: 1\ndistributed:\n  use_deepspeed: true\n  use_fsdp: true\n")
    with pytest.raises(ConfigError, match="run.yaml lines 4, 5: distributed.use_deepspeed and distributed.use_fsdp"):
        load_config(str(path))


@pytest.mark.parametrize("field", ["deepspeed_config", "fsdp_config"])
def test_a_strategy_json_that_is_missing_malformed_or_not_an_object_is_named(tmp_path: Path, field: str):
    import torch

    from phalanx.parallel.base import Precision
    from phalanx.parallel.config_files import read_fsdp_config
    from phalanx.parallel.deepspeed import build_ds_config

    def read(path: Path):
        cfg = load_config(None, {f"distributed.{field}": str(path)})
        if field == "fsdp_config":
            return read_fsdp_config(str(path))
        return build_ds_config(cfg, 1, Precision.choose("no", torch.device("cpu")))

    where = f"distributed.{field} = '{tmp_path}"
    with pytest.raises(ConfigError, match=re.escape(f"{where}/nope.json' does not exist (expected a JSON file)")):
        read(tmp_path / "nope.json")
    path = tmp_path / "s.json"
    path.write_text('{"a": 1,\n "b": }')
    with pytest.raises(ConfigError) as err:
        read(path)
    assert f'{where}/s.json\': not valid JSON at line 2, column 7: Expecting value\n     "b": }}\n          ^' in str(
        err.value
    )
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="the top level must be a JSON object .*found list"):
        read(path)


def test_both_dataset_sources_refused():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"data.dataset_path": "a.jsonl", "data.dataset_name": "org/ds"})
    assert "dataset_path or dataset_name" in str(err.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"data.eval_dataset_split": "test"}, "eval_dataset_split 'test' names a split of dataset_name, which is not"),
        (  # seed 000's ./health-agent-dataset, a DatasetDict with its own test split, given as dataset_path
            {"data.dataset_path": "./health-agent-dataset", "data.eval_dataset_split": "test"},
            "for a split of the save_to_disk DatasetDict at dataset_path, give ./health-agent-dataset as dataset_name",
        ),
        (
            {"data.dataset_name": "org/ds", "data.eval_dataset_split": "test", "data.eval_dataset_path": "v.jsonl"},
            "set eval_dataset_split or eval_dataset_path, not both",
        ),
        (
            {"data.dataset_name": "org/ds", "data.eval_dataset_split": "train"},
            "eval_dataset_split 'train' is the split the run trains on",
        ),
    ],
)
def test_an_eval_split_needs_a_dataset_name_and_another_split(data, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, data)
    assert load_config(None, {"data.dataset_name": "org/ds", "data.eval_dataset_split": "test"}).data.eval_dataset_split


def test_text_fields_get_the_text_typed_and_bool_fields_keep_yes_no(tmp_path: Path):
    """YAML 1.1 reads no/off/yes/on as booleans: a string or choice field gets the characters, from flags and files."""
    flags = overrides_from_flags(
        [
            ("mixed_precision", "no"),
            ("output_dir", "on"),
            ("logging.tensorboard", "off"),
            ("overwrite_output_dir", "yes"),
            ("target_modules", "[q_proj, no]"),
            ("model_name", "1.10"),
            ("resume_from_checkpoint", "null"),
        ]
    )
    cfg = load_config(None, flags)
    assert (cfg.training.mixed_precision, cfg.output_dir, cfg.model.model_name) == ("no", "on", "1.10")
    assert cfg.logging.tensorboard is False and cfg.overwrite_output_dir is True
    assert cfg.lora.target_modules == ["q_proj", "no"] and cfg.checkpoint.resume_from_checkpoint is None
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("output_dir: off\ntraining:\n  mixed_precision: no\nlogging:\n  progress_bar: on\n")
    cfg = load_config(str(cfg_file))
    assert (cfg.output_dir, cfg.training.mixed_precision, cfg.logging.progress_bar) == ("off", "no", True)
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides_from_flags([("mixed_precision", "No")]))
    assert "'No'" in str(err.value) and "'auto', 'no', 'fp16' or 'bf16'" in str(err.value)
    with pytest.raises(ConfigError, match=r"field 'training.max_steps' = 'yes': Input should be a valid integer"):
        load_config(None, overrides_from_flags([("max_steps", "yes")]))  # not silently 1


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "training:\n  learning_rate: 1e-4\ntraining:\n  batch_size: 2\n",
            "line 3: 'training' is given twice (first at line 1)",
        ),
        (
            "training:\n  learning_rate: 1e-4\n  learning_rate: 2e-4\n",
            "line 3: 'training.learning_rate' is given twice",
        ),
    ],
    ids=["section-twice", "key-twice"],
)
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path, text, message):
    """YAML keeps the last of two equal keys: a section written twice would silently lose the first one's settings."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(path))


def test_a_check_across_fields_names_no_empty_field_and_prints_no_config_dump():
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides_from_flags([("world_size", "3"), ("offload_optimizer", "true")]))
    text = str(err.value)
    assert "command line: CPU offload needs a sharding strategy" in text
    assert "field ''" not in text and "{'" not in text


def test_seed_003s_config_and_deepspeed_flags_name_the_file_and_the_deepspeed_json(tmp_path: Path):
    """Seed 003's train.py ran as `--config config.yaml --deepspeed config/ds_config.json`."""
    from phalanx.config.loader import config_from_args

    path = tmp_path / "config.yaml"
    path.write_text("lora:\n  r: 2\n")
    cfg, config_path, pairs = config_from_args(["--config", str(path), "--deepspeed", "ds.json", "--seed", "3"])
    assert config_path == str(path) and pairs == [("deepspeed", "ds.json"), ("seed", "3")]
    assert (cfg.lora.r, cfg.distributed.deepspeed_config, cfg.distributed.strategy) == (2, "ds.json", "deepspeed")
    for args in ([str(path), "--config", str(path)], ["--config", "a.yaml", "--config", "b.yaml"], ["--config"]):
        with pytest.raises(ConfigError, match="give the config file as CONFIG.yaml or --config CONFIG.yaml, once"):
            config_from_args(args)
    with pytest.raises(ConfigError, match="give the config file as the launcher's --config"):
        config_from_args(["--config", "b.yaml"], flags_only=True, config_path=str(path))


def test_seed_003s_report_to_sets_tensorboard(tmp_path: Path):
    """Seed 003: 'Enable with `report_to: "tensorboard"` in config'."""
    path = tmp_path / "config.yaml"
    for text, tensorboard in [
        ('report_to: "tensorboard"\n', True),
        ("report_to: none\n", False),
        ("report_to: []\n", False),
    ]:
        path.write_text(f"logging:\n  log_steps: 5\n{text}")
        assert load_config(str(path)).logging.tensorboard is tensorboard, text
    path.write_text("report_to: wandb\n")
    with pytest.raises(
        ConfigError, match=r"config.yaml line 1: report_to \['wandb'\]: .*accepted: 'tensorboard', 'none'"
    ):
        load_config(str(path))
    path.write_text("report_to: tensorboard\nlogging:\n  tensorboard: false\n")
    with pytest.raises(ConfigError, match="lines 1, 3: report_to 'tensorboard' but logging.tensorboard is False; keep"):
        load_config(str(path))


def test_a_json_file_saved_with_a_byte_order_mark_is_read(tmp_path):
    """Windows editors start UTF-8 files with a byte-order mark, which json refuses ("Unexpected UTF-8 BOM")."""
    from phalanx.config.loader import read_json_mapping

    ds = tmp_path / "ds.json"
    ds.write_bytes(b'\xef\xbb\xbf{"zero_optimization": {"stage": 2}}')
    assert read_json_mapping(str(ds), "distributed.deepspeed_config") == {"zero_optimization": {"stage": 2}}


def test_dashes_in_a_flag_are_underscores_dotted_or_not():
    """`--max-steps` and `--training.max-steps` both set training.max_steps (argparse's habit, as torchrun's flags)."""
    from phalanx.config.flags import split_flags
    from phalanx.config.loader import overrides_from_flags

    for flag in ("--max-steps", "--training.max-steps"):
        assert overrides_from_flags(split_flags([flag, "7"])[1]) == {"training.max_steps": 7}


def test_a_home_relative_path_in_a_yaml_file_is_expanded_as_the_shell_would(tmp_path, monkeypatch):
    """No shell reads a YAML file: `output_dir: ~/runs/a` made a folder named '~' in the current one, and
    `dataset_path: ~/chats.jsonl` was 'no such file'. Each path field expands it; the model name already did."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ds.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(
        "output_dir: ~/runs/a\n"
        "data:\n  dataset_path: ~/chats.jsonl\n  eval_dataset_path: ~/val.jsonl\n"
        "checkpoint:\n  resume_from_checkpoint: ~/runs/a/checkpoint-4\n"
        "distributed:\n  strategy: deepspeed\n  deepspeed_config: ~/ds.json\n"
    )
    cfg = load_config(str(config))
    assert cfg.output_dir == f"{tmp_path}/runs/a"
    assert (cfg.data.dataset_path, cfg.data.eval_dataset_path) == (f"{tmp_path}/chats.jsonl", f"{tmp_path}/val.jsonl")
    assert cfg.checkpoint.resume_from_checkpoint == f"{tmp_path}/runs/a/checkpoint-4"
    assert cfg.distributed.deepspeed_config == f"{tmp_path}/ds.json"
    assert load_config(None, {"output_dir": "runs/~a"}).output_dir == "runs/~a"  # only a leading ~ is the home


def test_a_relative_path_found_only_beside_the_config_names_both_folders(tmp_path, monkeypatch):
    """`phalanx train project/run.yaml` from another folder: relative paths are read from where phalanx runs, so
    `dataset_path: chats.jsonl` beside the config was 'no such file' with no word of where it was looked for."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "config").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "chats.jsonl").write_text("{}\n")
    (project / "config" / "fsdp.json").write_text("{}")
    config = project / "run.yaml"
    config.write_text("data:\n  dataset_path: chats.jsonl\n")
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError) as err:
        load_config(str(config))
    message = str(err.value)
    assert (
        f"{config} line 2: data.dataset_path = 'chats.jsonl' is read from the folder phalanx runs in, {elsewhere},"
        in (message)
    )
    assert f"the config's folder has it ({project / 'chats.jsonl'}). Run phalanx from {project}" in message
    config.write_text("distributed:\n  strategy: fsdp\n  fsdp_config: config/fsdp.json\n")
    with pytest.raises(ConfigError, match="distributed.fsdp_config = 'config/fsdp.json' is read from the folder"):
        load_config(str(config))
    # from the project folder, or given on the command line (the shell's folder), it is what it always was
    load_config(str(config), {"distributed.fsdp_config": str(project / "config" / "fsdp.json")})
    monkeypatch.chdir(project)
    assert load_config(str(config)).distributed.fsdp_config == "config/fsdp.json"


def test_a_mapping_flag_that_does_not_parse_says_what_yaml_found():
    """--chat_template_kwargs '{enable_thinking: false' (the brace left out) was answered "Input should be a valid
    dictionary", about a value the user wrote as one."""
    with pytest.raises(ConfigError) as err:
        overrides_from_flags([("chat_template_kwargs", "{enable_thinking: false")])
    message = str(err.value)
    assert (
        "data.chat_template_kwargs = '{enable_thinking: false' is not a YAML or JSON mapping (expected ','" in message
    )
    assert "e.g. --chat_template_kwargs '{enable_thinking: false}'" in message
    assert overrides_from_flags([("chat_template_kwargs", "{enable_thinking: false}")]) == {
        "data.chat_template_kwargs": {"enable_thinking": False}
    }
