"""Choosing a strategy from the config: seed 003's YAML spellings, and combinations refused before any process starts."""

import pytest
import yaml

from helpers import run_phalanx
from phalanx.config.loader import load_config
from phalanx.errors import ConfigError
from phalanx.parallel.base import Precision


def test_seed_003_yaml_sections_are_accepted(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "distributed": {
                    "use_deepspeed": True,
                    "deepspeed_config": "config/ds_config.json",
                    "gradient_accumulation_steps": 16,
                },
                "training": {"gradient_checkpointing": True, "mixed_precision": "bf16"},
            }
        )
    )
    cfg = load_config(str(path))
    assert cfg.distributed.strategy == "deepspeed"
    assert cfg.training.gradient_accumulation_steps == 16
    assert cfg.model.gradient_checkpointing is True
    path.write_text(
        yaml.safe_dump(
            {"distributed": {"use_fsdp": True, "fsdp_config": "config/fsdp_config.json", "use_deepspeed": False}}
        )
    )
    assert load_config(str(path)).distributed.strategy == "fsdp"
    assert load_config(None, {"distributed.deepspeed_config": "ds.json"}).distributed.strategy == "deepspeed"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"distributed.offload_optimizer": True}, "CPU offload needs a sharding strategy"),
        ({"distributed.strategy": "fsdp", "distributed.offload_optimizer": True}, "use --offload_param"),
        (
            {"distributed.strategy": "deepspeed", "distributed.zero_stage": 2, "distributed.offload_param": True},
            "needs --zero_stage 3",
        ),
        ({"distributed.use_deepspeed": True, "distributed.use_fsdp": True}, "pick one strategy"),
        ({"distributed.strategy": "fsdp", "distributed.deepspeed_config": "ds.json"}, "add --strategy deepspeed"),
        ({"distributed.deepspeed_config": "ds.json", "distributed.fsdp_config": "f.json"}, "add --strategy"),
        ({"distributed.strategy": "ddp", "distributed.use_fsdp": True}, "keep one of them"),
    ],
)
def test_impossible_combinations_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_refused_before_any_rank_starts(tmp_path):
    proc = run_phalanx("train", "--world_size", "2", "--offload_param", "true", "--output_dir", str(tmp_path / "o"))
    assert proc.returncode != 0 and "CPU offload needs a sharding strategy" in proc.stderr
    assert "[rank" not in proc.stderr and "Starting distributed training" not in proc.stdout  # no worker ran


def test_user_deepspeed_json_autos_are_filled_and_unset_fields_taken_from_it(tmp_path):
    from phalanx.parallel.deepspeed import build_ds_config

    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 0.3, "bf16": {"enabled": "auto"},'
        ' "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}'
    )
    cfg = load_config(
        None,
        {
            "distributed.strategy": "deepspeed",
            "distributed.deepspeed_config": str(path),
            "training.batch_size": 2,
            "training.gradient_accumulation_steps": 4,
        },
    )
    ds = build_ds_config(cfg, world_size=2, precision=Precision(None))
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 16
    assert ds["gradient_clipping"] == 0.3  # max_grad_norm was not given: the file's value stands
    assert ds["bf16"] == {"enabled": False}
    assert ds["zero_optimization"]["stage"] == 3  # zero_stage was not given either
    cfg = load_config(
        None,
        {
            "distributed.strategy": "deepspeed",
            "distributed.deepspeed_config": str(path),
            "training.max_grad_norm": 1.0,
            "distributed.zero_stage": 2,
        },
    )
    with pytest.raises(ConfigError) as err:
        build_ds_config(cfg, world_size=2, precision=Precision(None))
    assert "gradient_clipping is 0.3 in the JSON but 1.0" in str(err.value)
    assert "zero_optimization.stage is 3 in the JSON but 2" in str(err.value)


def test_a_deepspeed_json_whose_precision_differs_from_the_runs_is_refused(tmp_path):
    """Seed 003's `phalanx config deepspeed --bf16` JSON on CPU ranks, mixed_precision left at auto (fp32 there): the
    engine would train bf16 while the loop and banner say fp32. Refused by name; "auto" takes the run's value."""
    from phalanx.parallel.deepspeed import build_ds_config

    path = tmp_path / "ds.json"
    path.write_text('{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}')
    cfg = load_config(None, {"distributed.strategy": "deepspeed", "distributed.deepspeed_config": str(path)})
    with pytest.raises(ConfigError, match="bf16.enabled is True in the JSON but False from training.mixed_precision"):
        build_ds_config(cfg, world_size=1, precision=Precision(None))
    path.write_text('{"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}')
    assert build_ds_config(cfg, world_size=1, precision=Precision(None))["bf16"] == {"enabled": False}


def test_each_configured_strategy_name_builds_its_class_from_the_config(tmp_path):
    """make_strategy is a lookup: every `distributed.strategy` value has a registered class, built by from_config."""
    import typing

    import torch

    from phalanx.config.schema import SHARDING_STRATEGIES, DistributedConfig
    from phalanx.parallel import STRATEGIES, check_before_launch, make_strategy
    from phalanx.parallel.config_files import config_main
    from phalanx.parallel.ddp import DDPStrategy
    from phalanx.parallel.deepspeed import DeepSpeedStrategy
    from phalanx.parallel.fsdp import FSDPStrategy
    from phalanx.runtime.dist import RankInfo

    assert set(STRATEGIES) == set(typing.get_args(DistributedConfig.model_fields["strategy"].annotation))
    assert set(SHARDING_STRATEGIES) == set(
        typing.get_args(DistributedConfig.model_fields["sharding_strategy"].annotation)
    )
    one, two = (RankInfo(0, n, 0, n, torch.device("cpu")) for n in (1, 2))
    fp32 = Precision(None)
    assert type(make_strategy(one, fp32, cfg=load_config(None, {}))).name == "single"  # one process under DDP: plain
    ddp = make_strategy(two, fp32, cfg=load_config(None, {"distributed.ddp_comm_hook": "bf16"}))
    assert isinstance(ddp, DDPStrategy) and ddp.comm_hook == "bf16"
    assert make_strategy(two, fp32, "fp16", cfg=load_config(None, {})).comm_hook == "fp16"  # an explicit hook stands in
    fsdp = make_strategy(
        one,
        fp32,
        cfg=load_config(
            None,
            {
                "distributed.strategy": "fsdp",
                "model.finetune": "full",
                "distributed.sharding_strategy": "SHARD_GRAD_OP",
            },
        ),
    )
    assert isinstance(fsdp, FSDPStrategy) and (fsdp.sharding_strategy, fsdp.finetune, fsdp.param_dtype) == (
        "SHARD_GRAD_OP",
        "full",
        None,
    )
    file = tmp_path / "fsdp.json"
    assert (
        config_main(
            [
                "fsdp",
                "--sharding_strategy",
                "NO_SHARD",
                "--mixed_precision",
                "BFLOAT16",
                "--cpu_offload",
                "--output",
                str(file),
            ]
        )
        == 0
    )
    from_file = load_config(None, {"distributed.strategy": "fsdp", "distributed.fsdp_config": str(file)})
    fsdp = make_strategy(two, Precision(torch.bfloat16), cfg=from_file)
    assert (fsdp.sharding_strategy, fsdp.cpu_offload, fsdp.param_dtype) == ("NO_SHARD", True, torch.bfloat16)
    # The file's BFLOAT16 on an fp32 run (CPU ranks) would cast the weights behind the banner's back: refused by name,
    # as a DeepSpeed JSON's bf16 is, in the ranks and before they start.
    for refuse in (lambda: make_strategy(two, fp32, cfg=from_file), lambda: check_before_launch(from_file, 2, False)):
        with pytest.raises(ConfigError) as refused:
            refuse()
        assert f"{file}: fsdp_mixed_precision = BFLOAT16 disagrees with the run, which computes in fp32" in str(
            refused.value
        ) and '"fsdp_mixed_precision": "NO"' in str(refused.value)
    file.write_text(file.read_text().replace('"BFLOAT16"', '"NO"'))
    assert make_strategy(two, fp32, cfg=from_file).param_dtype is None, "NO takes the run's precision"
    ds = make_strategy(
        two, fp32, cfg=load_config(None, {"distributed.strategy": "deepspeed", "distributed.zero_stage": 3})
    )
    assert isinstance(ds, DeepSpeedStrategy) and ds.zero_stage == 3
