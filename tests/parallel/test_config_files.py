"""`phalanx config deepspeed|fsdp` write seed 003's files; DeepSpeed's parser and `phalanx train` accept them."""

import json

import pytest
import torch

from equivalence import COMMON
from helpers import read_metrics, run_phalanx
from phalanx.config.schema import RunConfig
from phalanx.parallel.base import Precision
from phalanx.parallel.config_files import config_main, read_fsdp_config


def test_deepspeed_file_has_seed_003_shape(tmp_path):
    out = tmp_path / "config" / "ds_config.json"
    assert (
        config_main(
            [
                "deepspeed",
                "--zero_stage",
                "2",
                "--offload_optimizer",
                "--bf16",
                "--gradient_accumulation_steps",
                "16",
                "--gradient_clipping",
                "0.3",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    config = json.loads(out.read_text())
    assert config["train_micro_batch_size_per_gpu"] == "auto"
    assert config["gradient_accumulation_steps"] == 16 and config["gradient_clipping"] == 0.3
    assert config["zero_allow_untested_optimizer"] is True and config["zero_force_ds_cpu_optimizer"] is False
    assert config["bf16"] == {"enabled": True}
    zero = config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    for key in ("contiguous_gradients", "overlap_comm", "reduce_scatter"):
        assert zero[key] is True
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 5e8


@pytest.mark.parametrize(
    "flags",
    [
        ["--zero_stage", "1"],
        ["--zero_stage", "2", "--offload_optimizer", "--bf16"],
        ["--zero_stage", "3", "--offload_param", "--offload_optimizer", "--fp16"],
    ],
)
def test_deepspeed_parser_accepts_the_file_once_autos_are_filled(tmp_path, flags):
    """DeepSpeed's own DeepSpeedConfig parses the file after phalanx fills its "auto" values from a run config."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from phalanx.parallel.deepspeed import build_ds_config

    out = tmp_path / "ds.json"
    assert config_main(["deepspeed", *flags, "--output", str(out)]) == 0
    cfg = RunConfig.model_validate({"distributed": {"deepspeed_config": str(out)}, "training": {"batch_size": 2}})
    # The run's precision matches the file's (a file that disagrees with the run is refused, as tested elsewhere).
    dtype = torch.bfloat16 if "--bf16" in flags else torch.float16 if "--fp16" in flags else None
    merged = build_ds_config(cfg, world_size=1, precision=Precision(dtype))
    parsed = DeepSpeedConfig(merged)
    assert parsed.train_micro_batch_size_per_gpu == 2
    assert parsed.zero_optimization_stage == int(flags[1])


def test_offload_param_below_stage_3_is_refused():
    from phalanx.errors import ConfigError

    with pytest.raises(ConfigError, match="needs --zero_stage 3"):
        config_main(["deepspeed", "--zero_stage", "2", "--offload_param"])


def test_fsdp_file_has_seed_003_fields(tmp_path):
    out = tmp_path / "fsdp_config.json"
    assert (
        config_main(
            ["fsdp", "--sharding_strategy", "FULL_SHARD", "--mixed_precision", "BFLOAT16", "--output", str(out)]
        )
        == 0
    )
    config = json.loads(out.read_text())
    assert config["fsdp_sharding_strategy"] == "FULL_SHARD" and config["fsdp_mixed_precision"] == "BFLOAT16"
    for key in (
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_state_dict_type",
        "fsdp_cuda_graphs",
        "fsdp_auto_wrap_policy",
        "fsdp_sync_module_states",
        "fsdp_use_orig_params",
        "fsdp_backward_prefetch_policy",
        "fsdp_forward_prefetch",
        "fsdp_cpu_ram_efficient_loading",
    ):
        assert key in config, key
    assert read_fsdp_config(str(out)) == {
        "sharding_strategy": "FULL_SHARD",
        "mixed_precision": "bf16",
        "cpu_offload": False,
    }


@pytest.mark.parametrize(
    "given, written", [("bf16", "BFLOAT16"), ("fp16", "FP16"), ("no", "NO"), ("Bfloat16", "BFLOAT16")]
)
def test_fsdp_precision_takes_trainings_spellings(tmp_path, given, written):
    """`--mixed_precision bf16`, as training.mixed_precision spells it, was an invalid choice; any case is taken."""
    out = tmp_path / "fsdp_config.json"
    assert (
        config_main(["fsdp", "--mixed_precision", given, "--sharding_strategy", "shard_grad_op", "--output", str(out)])
        == 0
    )
    config = json.loads(out.read_text())
    assert config["fsdp_mixed_precision"] == written and config["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"


@pytest.mark.distributed
def test_train_runs_with_generated_files(equivalence_data, tmp_path):
    ds, fsdp = tmp_path / "ds.json", tmp_path / "fsdp.json"
    assert config_main(["deepspeed", "--zero_stage", "2", "--offload_optimizer", "--output", str(ds)]) == 0
    assert (
        config_main(["fsdp", "--sharding_strategy", "SHARD_GRAD_OP", "--mixed_precision", "NO", "--output", str(fsdp)])
        == 0
    )
    for name, flags in (
        ("ds", ["--strategy", "deepspeed", "--deepspeed_config", str(ds)]),
        ("fsdp", ["--strategy", "fsdp", "--fsdp_config", str(fsdp)]),
    ):
        out = tmp_path / name
        proc = run_phalanx(
            "train",
            "--dataset_path",
            str(equivalence_data),
            "--output_dir",
            str(out),
            "--world_size",
            "2",
            "--batch_size",
            "2",
            *COMMON,
            "--max_steps",
            "2",
            *flags,
        )
        assert proc.returncode == 0, name + proc.stderr[-3000:]
        assert len(read_metrics(out)) == 2
        assert (out / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["deepspeed", "--zero-stag", "2"],
            "phalanx config deepspeed: unrecognized arguments: --zero-stag 2. Did you mean --zero_stage?",
        ),
        (["fsdp", "--mixed_precision", "BF8"], "phalanx config fsdp: argument --mixed_precision: invalid choice"),
        ([], "phalanx config: the following arguments are required: deepspeed|fsdp"),
    ],
)
def test_a_mistyped_flag_is_one_line_naming_the_nearest(argv, said):
    """As `phalanx train` and `launcher` answer a typo: one line with the nearest flag, exit 2, no usage dump."""
    from phalanx.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        config_main(argv)
    assert str(refused.value).startswith(said) and refused.value.exit_code == 2
