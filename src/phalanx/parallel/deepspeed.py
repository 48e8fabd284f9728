"""DeepSpeed ZeRO through the real engine: stages 1-3, CPU offload, bf16/fp16.

The engine owns what ZeRO changes: the backward pass (partitioned gradient buckets),
accumulation (we mark the last micro-batch as the boundary, so a short last group is right),
gradient clipping (`gradient_clipping` in its config) and the optimizer step. The loop's
loss is already normalised by the global batch's target tokens, so backward does not divide
by the accumulation count again (`scale_wrt_gas=False`).

Our config becomes a DeepSpeed config (see `build_ds_config`); a user's own JSON is merged
in: its "auto" values are filled from ours, and a value that contradicts a setting given
explicitly in our config is reported instead of one silently winning.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import nn

from phalanx.checkpoint.layout import DS_DIR, DS_TAG
from phalanx.checkpoint.safe_load import use_safe_loading
from phalanx.config.loader import read_json_mapping
from phalanx.errors import ConfigError
from phalanx.parallel.base import Precision, Strategy, place_on_device
from phalanx.runtime.dist import RankInfo

if TYPE_CHECKING:
    from phalanx.config.schema import RunConfig

# DeepSpeed would otherwise print a throughput line every 10 steps.
QUIET = {"steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
# DeepSpeed's default reduce bucket, in elements (deepspeed.runtime.zero.config).
DS_REDUCE_BUCKET = 500_000_000


# DeepSpeed's shared-memory all-reduce for CPU ranks (deepspeed.comm.torch.build_shm_op).
SHM_ALL_REDUCE_OP = "deepspeed_shm_comm"


@contextlib.contextmanager
def without_inference_all_reduce_op() -> Iterator[None]:
    """DeepSpeed's communication backend, as it starts, loads its shared-memory all-reduce op on CPU ranks: C++ that
    it compiles on first use (a minute of both cores on a 2-core machine, a compiler needed, then again whenever the
    environment's path changes). Only inference's tensor-parallel all-reduce calls it; ZeRO's collectives go through
    torch.distributed. So it is marked incompatible while the engine starts (DeepSpeed's own switch: an op marked so
    is not built, and that all-reduce falls back to torch.distributed's), and restored after."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    before = compatible.get(SHM_ALL_REDUCE_OP)
    compatible[SHM_ALL_REDUCE_OP] = False
    try:
        yield
    finally:
        if before is None:
            compatible.pop(SHM_ALL_REDUCE_OP, None)
        else:
            compatible[SHM_ALL_REDUCE_OP] = before


def reduce_bucket_elements(ds_config: dict, trainable: int) -> int:
    """The reduce bucket a run gets: the JSON's number when it gives one, else DeepSpeed's default cut to what trains.

    ZeRO allocates its gradient reduce bucket whole, reduce_bucket_size elements (1-2 GB by default), whatever the
    model; a LoRA run of a 1.5B model trains ~18M parameters, so a bucket that holds all of them is the same number
    of reductions in 1/27 of the memory. A bucket never needs to hold more than everything that trains."""
    given = (ds_config.get("zero_optimization") or {}).get("reduce_bucket_size", "auto")
    if isinstance(given, (int, float)) and not isinstance(given, bool):
        return int(given)
    return max(1, min(DS_REDUCE_BUCKET, trainable))


def build_ds_config(cfg: RunConfig, world_size: int, precision: Precision) -> dict:
    """The DeepSpeed config this run implies, merged with the user's deepspeed_config JSON (if any)."""
    t, d = cfg.training, cfg.distributed
    ours: dict = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": t.batch_size * t.gradient_accumulation_steps * world_size,
        "gradient_clipping": t.max_grad_norm,
        "zero_allow_untested_optimizer": True,  # our AdamW (torch's), not DeepSpeed's fused one
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": precision.dtype == torch.bfloat16},
        "fp16": {"enabled": precision.dtype == torch.float16},
        "zero_optimization": {"stage": d.zero_stage},
    }
    zero = ours["zero_optimization"]
    if d.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": precision.dtype is not None}
    if d.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": precision.dtype is not None}
    if not d.deepspeed_config:
        return {**ours, **QUIET}
    path = Path(d.deepspeed_config)
    user = read_json_mapping(d.deepspeed_config, "distributed.deepspeed_config")
    refuse_wrong_types(user, path)
    explicit = explicit_fields(cfg)
    merged, conflicts = merge(user, ours, explicit, prefix="")
    if conflicts:
        raise ConfigError(
            f"{path} disagrees with the run config: "
            + "; ".join(conflicts)
            + '. Make them equal, write "auto" in the JSON to take the run\'s value, or drop the setting from the run config.'
        )
    return {**QUIET, **merged}


# Which run-config field decides each DeepSpeed key; a key whose field was not given explicitly takes the JSON's value.
DECIDED_BY = {
    "train_micro_batch_size_per_gpu": "training.batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "train_batch_size": "training.batch_size",
    "gradient_clipping": "training.max_grad_norm",
    "bf16.enabled": "training.mixed_precision",
    "fp16.enabled": "training.mixed_precision",
    "zero_optimization.stage": "distributed.zero_stage",
    "zero_optimization.offload_optimizer": "distributed.offload_optimizer",
    "zero_optimization.offload_param": "distributed.offload_param",
}
# The loop groups micro-batches itself, and its autocast and the banner follow the run's precision (mixed_precision
# auto resolved on this device: fp32 on CPU), so these must agree with the run even when the run only has defaults.
BINDING = {
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "bf16.enabled",
    "fp16.enabled",
}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# What the keys phalanx fills or checks accept in a user's JSON ("auto" aside). A value of another type would reach
# DeepSpeed, which fails inside every rank at start-up or at the first step with no word of the file
# ("invalid literal for int()", "'>' not supported between 'str' and 'float'"), so it is refused by name first.
ACCEPTED_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "train_micro_batch_size_per_gpu": (_positive_int, "a positive integer"),
    "gradient_accumulation_steps": (_positive_int, "a positive integer"),
    "train_batch_size": (_positive_int, "a positive integer"),
    "gradient_clipping": (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
        "a number, 0 or more (0: no clipping)",
    ),
    "bf16.enabled": (lambda v: isinstance(v, bool), "true or false"),
    "fp16.enabled": (lambda v: isinstance(v, bool), "true or false"),
    "zero_optimization.stage": (lambda v: v in (0, 1, 2, 3) and not isinstance(v, bool), "0, 1, 2 or 3"),
}


def refuse_wrong_types(user: dict, path: Path) -> None:
    """Raise ConfigError naming the file, the key and what it accepts for the first value of ACCEPTED_VALUES's keys
    that has the wrong type or range, or for one of their sections that is not an object."""
    for section in ("bf16", "fp16", "zero_optimization"):
        if section in user and not isinstance(user[section], dict):
            example = '{"stage": 2}' if section == "zero_optimization" else '{"enabled": "auto"}'
            raise ConfigError(f"{path}: {section} = {json.dumps(user[section])}; accepted: an object such as {example}")
    for dotted, (accepts, what) in ACCEPTED_VALUES.items():
        section, _, key = dotted.rpartition(".")
        holder = user.get(section) if section else user
        if not isinstance(holder, dict) or key not in holder or holder[key] == "auto":
            continue
        if not accepts(holder[key]):
            raise ConfigError(
                f'{path}: {dotted} = {json.dumps(holder[key])}; accepted: {what}, or "auto" (the run\'s value)'
            )


def explicit_fields(cfg: RunConfig) -> set[str]:
    out = set()
    for section in ("training", "distributed"):
        out |= {f"{section}.{name}" for name in getattr(cfg, section).model_fields_set}
    return out


def merge(user: dict, ours: dict, explicit: set[str], prefix: str) -> tuple[dict, list[str]]:
    merged, conflicts = dict(user), []
    for key, value in ours.items():
        dotted = prefix + key
        if isinstance(value, dict) and isinstance(user.get(key), dict):
            merged[key], sub = merge(user[key], value, explicit, dotted + ".")
            conflicts += sub
            continue
        if key not in user or user[key] == "auto":
            merged[key] = value
            continue
        theirs = user[key]
        if isinstance(value, dict) or isinstance(theirs, dict):
            same = (theirs.get("device", "none") if isinstance(theirs, dict) else theirs) == (
                value.get("device", "none") if isinstance(value, dict) else value
            )
        else:
            same = theirs == value
        if same:
            continue
        field = DECIDED_BY.get(dotted)
        if dotted in BINDING or (field in explicit):
            conflicts.append(f"{dotted} is {theirs!r} in the JSON but {value!r} from {field or 'the run config'}")
    # Offload asked for in the run config but absent from the JSON's zero_optimization block is added above.
    return merged, conflicts


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    shards_state = True  # DeepSpeed's own checkpoint: every rank writes its optimizer partition

    def __init__(self, rank: RankInfo, precision: Precision, cfg: RunConfig, finetune: str = "lora"):
        super().__init__(rank, precision)
        self.scaler = None  # fp16 loss scaling is the engine's
        self.finetune = finetune
        self.ds_config = build_ds_config(cfg, rank.world_size, precision)
        self.zero_stage = int(self.ds_config.get("zero_optimization", {}).get("stage", 0))
        self.engine: Any = None
        self._eval_gather: Any = None

    @classmethod
    def from_config(cls, rank: RankInfo, precision: Precision, cfg: RunConfig) -> "DeepSpeedStrategy":
        return cls(rank, precision, cfg, cfg.model.finetune)

    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, precision: Precision) -> None:
        """A deepspeed_config JSON that contradicts the run is refused before any rank starts."""
        if cfg.distributed.deepspeed_config:
            build_ds_config(cfg, world_size, precision)

    def prepare(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
        import deepspeed

        model = place_on_device(model, self.rank.device)
        client = make_optimizer(model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        zero = self.ds_config.setdefault("zero_optimization", {})
        zero["reduce_bucket_size"] = reduce_bucket_elements(self.ds_config, trainable)
        with without_inference_all_reduce_op():
            self.engine, _, _, _ = deepspeed.initialize(
                model=model, optimizer=client, config=self.ds_config, dist_init_required=False
            )
        use_safe_loading(self.engine)  # resume never unpickles code (DeepSpeed's own loader would)
        self.model = self.engine
        # The scheduler drives the learning rate of the optimizer we made; the engine's wrapper steps through it.
        self.optimizer = client
        return self.model, self.optimizer

    def unwrap(self) -> nn.Module:
        assert self.engine is not None, "prepare() first"
        return self.engine.module

    def micro_step(self, sync_gradients: bool) -> ContextManager:
        self._release_after_eval()
        self.engine.set_gradient_accumulation_boundary(sync_gradients)
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        return contextlib.nullcontext()  # the engine holds the model in bf16/fp16 itself

    def eval_model(self) -> nn.Module:
        """Under ZeRO-3 a forward gathers each layer from every rank, and ranks may run different numbers of eval
        forwards: so every weight is gathered once, here (all ranks evaluate together), and pinned as
        persistent until the next training step, which releases it. Stages 1-2 hold whole weights."""
        if self.zero_stage == 3 and self._eval_gather is None:
            import deepspeed

            params = list(self.engine.module.parameters())
            self._eval_gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
            self._eval_gather.__enter__()
            for param in params:
                param.ds_persist = True
        return self.engine.module

    def _release_after_eval(self) -> None:
        if self._eval_gather is not None:
            for param in self.engine.module.parameters():
                param.ds_persist = False
            self._eval_gather.__exit__(None, None, None)
            self._eval_gather = None

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, max_grad_norm: float) -> float:
        self.engine.step()  # reduces, clips to gradient_clipping, steps and zeroes
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def discard_gradients(self) -> None:
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.engine.zero_grad()

    # Saving ---------------------------------------------------------------------------------------------
    @property
    def sharded_state_holds_model(self) -> bool:
        """ZeRO-3 full fine-tuning: DeepSpeed's checkpoint holds every weight (fp32, partitioned), so intermediate
        checkpoints skip the gather to rank 0 (`phalanx export` consolidates one). Stages 1-2 hold whole weights
        on every rank and LoRA's adapter is small: those are written as from_pretrained files as before."""
        return self.zero_stage == 3 and self.finetune == "full"

    def model_state_for_saving(self) -> Optional[dict]:
        """Under ZeRO-3 each rank holds a slice of every weight: gather them, one parameter at a time, to rank 0.
        For LoRA only the adapter is gathered. Stages 1-2 keep whole weights on every rank: nothing to do."""
        self._release_after_eval()
        if self.zero_stage < 3:
            return None
        import deepspeed

        module, state = self.unwrap(), {}
        for name, param in module.named_parameters():
            if self.finetune == "lora" and not param.requires_grad:
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if self.rank.is_main:
                    state[name] = param.detach().to("cpu", copy=True)
        if self.rank.is_main and self.finetune != "lora":
            state.update({k: v.detach().cpu() for k, v in module.named_buffers() if k in module.state_dict()})
        return state if self.rank.is_main else {}

    def save_sharded(self, folder: Path, asynchronous: bool = False) -> None:
        """DeepSpeed's own checkpoint, every rank its partition; written before this returns (DeepSpeed's
        engine offers no background write through this call, so `asynchronous` changes nothing here)."""
        self._release_after_eval()
        self.engine.save_checkpoint(
            str(folder / DS_DIR), tag=DS_TAG, save_latest=False, exclude_frozen_parameters=self.finetune == "lora"
        )

    def _check_loadable(self, folder: Path, saved: tuple[str, int]) -> None:
        """DeepSpeed's own refusals of a checkpoint from another number of ranks or another ZeRO stage are a
        traceback (a ZeRORuntimeException, or a bare AssertionError from stage 3's loader): exit 1, a crash that a
        requeue or --max_restarts only repeats. Named here, with bad input's status and the way on."""
        family, ranks = saved
        here = ZERO_FAMILIES[self.zero_stage]
        if family != here:
            raise ConfigError(
                f"{folder} holds a DeepSpeed checkpoint of {family}, and this run uses {here} "
                f"(zero_stage {self.zero_stage}): DeepSpeed loads its state only into the stages that "
                "wrote it. Resume it with the zero_stage it was trained with, or start fresh with --overwrite_output_dir"
            )
        if ranks and ranks != self.rank.world_size:
            raise ConfigError(
                f"{folder} holds DeepSpeed ZeRO state partitioned over {ranks} ranks, and this run has "
                f"{self.rank.world_size}: DeepSpeed cannot re-partition it. Resume it on {ranks} ranks "
                f"(--world_size {ranks}), or start fresh with --overwrite_output_dir"
            )

    def load_sharded(self, folder: Path) -> None:
        if not (folder / DS_DIR / DS_TAG).is_dir():
            raise ConfigError(
                f"{folder} holds no {DS_DIR}/ checkpoint (it was saved by another strategy); resume it "
                "with the strategy it was trained with, or start fresh with --overwrite_output_dir"
            )
        self._check_loadable(folder, saved_zero_layout(folder / DS_DIR / DS_TAG))
        path, _ = self.engine.load_checkpoint(
            str(folder / DS_DIR), tag=DS_TAG, load_lr_scheduler_states=False, load_module_strict=self.finetune != "lora"
        )
        if path is None:
            raise ConfigError(f"DeepSpeed could not load its checkpoint from {folder / DS_DIR}")


# What each family of ZeRO stages writes; DeepSpeed loads a checkpoint only into the family that wrote it.
ZERO_FAMILIES = {0: "no ZeRO (stage 0)", 1: "ZeRO stage 1 or 2", 2: "ZeRO stage 1 or 2", 3: "ZeRO stage 3"}


def saved_zero_layout(state_dir: Path) -> tuple[str, int]:
    """The ZeRO family (ZERO_FAMILIES' words) and the number of data-parallel ranks of a DeepSpeed checkpoint, from
    its file names: every rank writes `[bf16_]zero_pp_rank_{rank}_mp_rank_00_optim_states.pt` under ZeRO, and under
    stage 3 its `zero_pp_rank_{rank}_mp_rank_00_model_states.pt` too (stages 1-2 write one `mp_rank_00_model_states.pt`,
    stage 0 only that)."""
    names = os.listdir(state_dir)
    ranks = {name.split("zero_pp_rank_")[1].split("_")[0] for name in names if "zero_pp_rank_" in name}
    zero3 = any("zero_pp_rank_" in name and name.endswith("_model_states.pt") for name in names)
    return ZERO_FAMILIES[3 if zero3 else 1 if ranks else 0], len(ranks)
