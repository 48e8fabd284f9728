"""The DeepSpeed / FSDP config files: `phalanx config deepspeed|fsdp` writes them (as seed 003's
distributed_setup.py did), and the FSDP strategy reads the one `--fsdp_config` names.

    phalanx config deepspeed --zero_stage 2 --offload_optimizer --bf16 --output config/ds_config.json
    phalanx config fsdp --sharding_strategy FULL_SHARD --mixed_precision BFLOAT16 --output config/fsdp_config.json

The DeepSpeed file leaves the batch size "auto" (filled from the run config by `phalanx train`,
see deepspeed.build_ds_config); the FSDP file carries the fields seed 003 shows, of which
`phalanx train --fsdp_config FILE` reads the sharding strategy, mixed precision and CPU offload.
No torch import here: `phalanx config` answers without loading it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from phalanx.config.flags import CommandParser
from phalanx.config.loader import read_json_mapping
from phalanx.config.schema import SHARDING_STRATEGIES, DistributedConfig
from phalanx.errors import ConfigError
from phalanx.runtime.durable import write_generated_files

FSDP_MIXED_PRECISION = ("NO", "FP16", "BFLOAT16", "FP32")
DEFAULT_LAYER_CLASSES = [
    "LlamaDecoderLayer",
    "MistralDecoderLayer",
    "GemmaDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",
]


def deepspeed_config(
    zero_stage: int = 2,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    bf16: bool = False,
    fp16: bool = False,
    gradient_accumulation_steps: Optional[int] = None,
    gradient_clipping: Optional[float] = None,
    reduce_bucket_size: float = 5e8,
    allgather_bucket_size: float = 5e8,
) -> dict:
    if bf16 and fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other; pick one")
    if offload_param and zero_stage != 3:
        raise ConfigError(
            f"--offload_param needs --zero_stage 3 (parameters are only partitioned there); got stage {zero_stage}"
        )
    zero: dict = {"stage": zero_stage, "contiguous_gradients": True, "overlap_comm": True}
    if zero_stage in (1, 2):
        zero.update(
            {
                "reduce_scatter": True,
                "reduce_bucket_size": reduce_bucket_size,
                "allgather_bucket_size": allgather_bucket_size,
            }
        )
    elif zero_stage == 3:
        zero.update({"reduce_bucket_size": reduce_bucket_size, "stage3_gather_16bit_weights_on_model_save": True})
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": gradient_accumulation_steps
        if gradient_accumulation_steps is not None
        else "auto",
        "gradient_clipping": gradient_clipping if gradient_clipping is not None else "auto",
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if fp16:
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    config["zero_optimization"] = zero
    return config


def fsdp_config(
    sharding_strategy: str = "FULL_SHARD",
    mixed_precision: str = "BFLOAT16",
    cpu_offload: bool = False,
    layer_classes: Optional[list[str]] = None,
) -> dict:
    return {
        "fsdp_transformer_layer_cls_to_wrap": layer_classes or DEFAULT_LAYER_CLASSES,
        "fsdp_sharding_strategy": sharding_strategy,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cuda_graphs": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_sync_module_states": True,
        "fsdp_use_orig_params": False,
        "fsdp_backward_prefetch_policy": "BACKWARD_PRE",
        "fsdp_forward_prefetch": False,
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": cpu_offload,
        "fsdp_mixed_precision": mixed_precision,
    }


def fsdp_precision_name(value: str) -> str:
    """accelerate's name for a precision given either way: `bf16` (as training.mixed_precision spells it) is
    BFLOAT16; a name it does not know is left for argparse to list the choices."""
    upper = value.upper()
    return {"BF16": "BFLOAT16"}.get(upper, upper)


def read_fsdp_config(path: str) -> dict:
    """The settings `phalanx train` takes from an FSDP JSON: sharding strategy, mixed precision, CPU offload. The
    other fields are accelerate's; fsdp_transformer_layer_cls_to_wrap in particular is not needed, since phalanx
    shards each decoder layer it finds in the model (models.blocks.decoder_layers)."""
    data = read_json_mapping(path, "distributed.fsdp_config")
    sharding = data.get("fsdp_sharding_strategy", "FULL_SHARD")
    precision = str(data.get("fsdp_mixed_precision", "NO")).upper()
    if sharding not in SHARDING_STRATEGIES:
        raise ConfigError(f"{path}: fsdp_sharding_strategy = {sharding!r}; accepted: {', '.join(SHARDING_STRATEGIES)}")
    if precision not in FSDP_MIXED_PRECISION:
        raise ConfigError(f"{path}: fsdp_mixed_precision = {precision!r}; accepted: {', '.join(FSDP_MIXED_PRECISION)}")
    return {
        "sharding_strategy": sharding,
        "mixed_precision": {"NO": None, "FP32": None, "FP16": "fp16", "BFLOAT16": "bf16"}[precision],
        "cpu_offload": bool(data.get("fsdp_offload_params", False)),
    }


def fsdp_settings(d: DistributedConfig) -> tuple[str, bool, Optional[str]]:
    """The sharding strategy, CPU offload and FSDP mixed precision ('bf16', 'fp16' or None) a run takes: the
    distributed section's, where an FSDP JSON (distributed.fsdp_config) overrides the first and third and can turn
    offload on. `phalanx train` and `phalanx plan` both read them here."""
    if not d.fsdp_config:
        return d.sharding_strategy, d.offload_param, None
    file = read_fsdp_config(d.fsdp_config)
    return file["sharding_strategy"], file["cpu_offload"] or d.offload_param, file["mixed_precision"]


def _write(config: dict, output: Optional[str], overwrite: bool) -> None:
    text = json.dumps(config, indent=2) + "\n"
    if output is None:
        print(text, end="")
        return
    path = Path(output)
    (outcome,) = write_generated_files({path: text}, overwrite, f"--output {path}")
    print(f"wrote {path}{' (unchanged)' if outcome == 'unchanged' else ''}")


def config_main(argv: Sequence[str]) -> int:
    parser = CommandParser(prog="phalanx config", description="Write a DeepSpeed or FSDP config file (seed 003).")
    sub = parser.add_subparsers(dest="kind", required=True, metavar="deepspeed|fsdp", parser_class=CommandParser)
    ds = sub.add_parser("deepspeed", help="a DeepSpeed ZeRO config")
    ds.add_argument("--zero_stage", type=int, choices=[0, 1, 2, 3], default=2)
    ds.add_argument("--offload_optimizer", action="store_true", help="optimizer state and step on the CPU")
    ds.add_argument("--offload_param", action="store_true", help="parameters on the CPU (ZeRO-3)")
    ds.add_argument("--bf16", action="store_true")
    ds.add_argument("--fp16", action="store_true")
    ds.add_argument(
        "--gradient_accumulation_steps", type=int, default=None, help='default: "auto" (from the run config)'
    )
    ds.add_argument("--gradient_clipping", type=float, default=None, help='default: "auto" (training.max_grad_norm)')
    ds.add_argument("--reduce_bucket_size", type=float, default=5e8)
    ds.add_argument("--allgather_bucket_size", type=float, default=5e8)
    ds.add_argument("--output", default=None, help="file to write; standard output when unset")
    ds.add_argument("--overwrite", action="store_true", help="replace an existing --output that holds something else")
    fs = sub.add_parser("fsdp", help="an FSDP config")
    fs.add_argument("--sharding_strategy", type=str.upper, choices=SHARDING_STRATEGIES, default="FULL_SHARD")
    fs.add_argument(
        "--mixed_precision",
        type=fsdp_precision_name,
        choices=FSDP_MIXED_PRECISION,
        default="BFLOAT16",
        help="BFLOAT16, FP16, FP32 or NO (training's spellings bf16, fp16, fp32 and no are taken too)",
    )
    fs.add_argument(
        "--cpu_offload", action="store_true", help="parameters, gradients and the optimizer step on the CPU"
    )
    fs.add_argument(
        "--layer_cls",
        nargs="+",
        default=None,
        help="fsdp_transformer_layer_cls_to_wrap, for tools that read it (accelerate); phalanx train wraps each of "
        "the model's own decoder layers whatever the file lists",
    )
    fs.add_argument("--output", default=None, help="file to write; standard output when unset")
    fs.add_argument("--overwrite", action="store_true", help="replace an existing --output that holds something else")
    try:
        args, unknown = parser.parse_known_args(list(argv))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if unknown:  # told by the subcommand's parser, which knows its flags and names the nearest (--zero-stage)
        {"deepspeed": ds, "fsdp": fs}[args.kind].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.kind == "deepspeed":
        config = deepspeed_config(
            args.zero_stage,
            args.offload_optimizer,
            args.offload_param,
            args.bf16,
            args.fp16,
            args.gradient_accumulation_steps,
            args.gradient_clipping,
            args.reduce_bucket_size,
            args.allgather_bucket_size,
        )
    else:
        config = fsdp_config(args.sharding_strategy, args.mixed_precision, args.cpu_offload, args.layer_cls)
    _write(config, args.output, args.overwrite)
    return 0
