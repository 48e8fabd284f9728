"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded over ranks.

One FSDP unit per decoder layer plus the root (embeddings, final norm, head). The seed's
sharding strategy names map onto FSDP2's two knobs, the device mesh and whether a unit
frees its gathered parameters after forward:

  FULL_SHARD     1-D mesh, reshard after forward (gather again for backward)
  SHARD_GRAD_OP  1-D mesh, keep the gathered parameters until backward is done
  HYBRID_SHARD   2-D mesh (nodes x ranks per node): shard inside a node, replicate across nodes
  NO_SHARD       2-D mesh (world x 1): every rank replicates, gradients all-reduced (DDP's math)

Under LoRA with mixed precision the frozen base stays in the compute dtype it was loaded in (bf16:
2 bytes a weight, sharded) and only the adapter keeps fp32 master weights; the all-gather casts the
adapter to the compute dtype and gradients are reduced in fp32.

The final model or adapter is gathered to full tensors on rank 0 (every rank takes part);
training state for resume is written sharded with torch.distributed.checkpoint, each rank
its own part (optionally in the background), and loads on any number of ranks. Under full
fine-tuning that sharded state holds every weight, so checkpoint-{step} gathers nothing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, ContextManager, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from phalanx.checkpoint.dcp import load_state, save_state
from phalanx.checkpoint.layout import SHARDED_DIR
from phalanx.config.schema import SHARDING_STRATEGIES
from phalanx.errors import ConfigError
from phalanx.models.blocks import decoder_layers
from phalanx.parallel.base import Precision, Strategy
from phalanx.parallel.config_files import fsdp_settings
from phalanx.runtime.dist import RankInfo

if TYPE_CHECKING:
    from phalanx.config.schema import RunConfig


@functools.cache
def fsdp_allows_frozen_dtypes() -> bool:
    """Whether this torch's FSDP2 lets frozen parameters differ in dtype from trainable ones in one unit (pytorch
    PR 154103): read from its check itself, since older versions required one dtype for every parameter of a unit."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    try:
        return "requires_grad" in inspect.getsource(FSDPParamGroup._init_mp_dtypes)
    except (OSError, TypeError, AttributeError):  # no source shipped: assume the old rule
        return False


def file_param_dtype(cfg: RunConfig, precision: Precision) -> Optional[torch.dtype]:
    """The compute dtype an FSDP JSON (distributed.fsdp_config) asks for: None where it names none ("NO", "FP32"),
    and the run's own where it names that. A different one is refused, as a DeepSpeed JSON's bf16/fp16 is: the loop's
    autocast, grad scaler and banner follow the run's precision, so the file would quietly cast the weights to
    another dtype (BFLOAT16 on CPU ranks, which run fp32, or under a mixed_precision fp16 run)."""
    asked = fsdp_settings(cfg.distributed)[2]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[asked]
    if dtype is None or dtype == precision.dtype:
        return dtype
    run = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[precision.dtype]
    raise ConfigError(
        f"{cfg.distributed.fsdp_config}: fsdp_mixed_precision = {'BFLOAT16' if asked == 'bf16' else 'FP16'} "
        f"disagrees with the run, which computes in {run} (training.mixed_precision "
        f"'{cfg.training.mixed_precision}'; bf16 and fp16 need CUDA ranks). Make them equal, or write "
        '"fsdp_mixed_precision": "NO" in the JSON to take the run\'s precision.'
    )


class FSDPStrategy(Strategy):
    name = "fsdp"
    shards_state = True  # resume state is written by every rank (torch.distributed.checkpoint), not by rank 0

    def __init__(
        self,
        rank: RankInfo,
        precision: Precision,
        sharding_strategy: str = "FULL_SHARD",
        cpu_offload: bool = False,
        finetune: str = "lora",
        param_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__(rank, precision)
        # Compute dtype of gathered parameters: an FSDP config file's fsdp_mixed_precision, else the run's precision.
        self.param_dtype = param_dtype or precision.dtype
        if sharding_strategy not in SHARDING_STRATEGIES:
            raise ConfigError(
                f"distributed.sharding_strategy = {sharding_strategy!r}; accepted: {', '.join(SHARDING_STRATEGIES)}"
            )
        self.sharding_strategy = sharding_strategy
        self.cpu_offload = cpu_offload
        self.finetune = finetune
        self.reshard_after_forward = sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")
        self.units: list[nn.Module] = []

    @classmethod
    def from_config(cls, rank: RankInfo, precision: Precision, cfg: RunConfig) -> "FSDPStrategy":
        """distributed.sharding_strategy and offload_param; an FSDP JSON (`phalanx config fsdp`, distributed.fsdp_config)
        overrides the sharding strategy and the compute dtype, and can turn CPU offload on."""
        sharding, offload, _ = fsdp_settings(cfg.distributed)
        return cls(rank, precision, sharding, offload, cfg.model.finetune, file_param_dtype(cfg, precision))

    @classmethod
    def check_config(cls, cfg: RunConfig, world_size: int, precision: Precision) -> None:
        """An FSDP JSON whose fsdp_mixed_precision contradicts the run is refused before any rank starts."""
        file_param_dtype(cfg, precision)

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        world, per_node = self.rank.world_size, self.rank.local_world_size
        device_type = self.rank.device.type
        if self.sharding_strategy == "HYBRID_SHARD":
            if per_node >= world or world % per_node:
                raise ConfigError(
                    f"sharding_strategy HYBRID_SHARD needs several nodes with equal ranks each (world {world}, "
                    f"{per_node} per node). On one node use FULL_SHARD."
                )
            return init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
        if self.sharding_strategy == "NO_SHARD":
            return init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # A unit's trainable parameters must share one dtype (one reduce-scatter). A LoRA base loaded in the compute
        # dtype stays there: it never steps, so an fp32 copy would only double its memory and its all-gather input.
        # Where that cannot hold (torch too old, trainable weights in several dtypes), everything becomes fp32.
        if len({p.dtype for p in model.parameters() if p.is_floating_point()}) > 1 and not self._frozen_keep_dtype(
            model
        ):
            model = model.to(torch.float32)
        mp = (
            MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
            if self.param_dtype is not None
            else MixedPrecisionPolicy()
        )
        offload = CPUOffloadPolicy(pin_memory=self.rank.device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        kwargs = {"mesh": self._mesh(), "mp_policy": mp, "offload_policy": offload}
        layers = decoder_layers(model)
        for layer in layers:
            fully_shard(layer, reshard_after_forward=self.reshard_after_forward, **kwargs)
        # The root is used right after the last layer's backward; resharding it would only gather it again.
        fully_shard(model, reshard_after_forward=False, **kwargs)
        self.units = [*layers, model]
        return model

    def _frozen_keep_dtype(self, model: nn.Module) -> bool:
        """Frozen weights may stay in the compute dtype: trainable ones share one dtype (the fp32 master copy), every
        frozen floating-point weight is already in param_dtype (the all-gather casts nothing), and this torch's
        FSDP2 checks dtypes over trainable parameters only."""
        trainable = {p.dtype for p in model.parameters() if p.requires_grad}
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
        return (
            self.param_dtype is not None
            and len(trainable) <= 1
            and frozen <= {self.param_dtype}
            and fsdp_allows_frozen_dtypes()
        )

    def micro_step(self, sync_gradients: bool) -> ContextManager:
        self._restore_after_eval()
        # Accumulating micro-batches keep unsharded gradients and reduce-scatter only on the last one.
        self.model.set_requires_gradient_sync(sync_gradients)
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        # The mixed-precision policy casts parameters per unit; autocast on top would cast a second time.
        return contextlib.nullcontext()

    def eval_model(self) -> nn.Module:
        """Gather every unit once and keep it gathered: ranks may run different numbers of eval forwards,
        and a forward that needs no all-gather cannot wait on a rank that has finished."""
        for unit in self.units:
            unit.unshard()
            unit.set_reshard_after_forward(False)
        self._gathered_for_eval = True
        return self.model

    def _restore_after_eval(self) -> None:
        if getattr(self, "_gathered_for_eval", False):
            for unit in self.units:
                unit.reshard()
                unit.set_reshard_after_forward(self.reshard_after_forward if unit is not self.model else False)
            self._gathered_for_eval = False

    def clip_gradients(self, max_grad_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole (sharded) gradient: each rank's partial sums are reduced before clipping."""
        params = self.parameters_with_gradients()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        return norm

    # Saving ---------------------------------------------------------------------------------------------
    @property
    def sharded_state_holds_model(self) -> bool:
        """Full fine-tuning: the sharded resume state holds every weight, so an intermediate checkpoint needs no
        gathered copy (export one with `phalanx export`). LoRA's adapter is small: always gathered."""
        return self.finetune == "full"

    def model_state_for_saving(self) -> Optional[dict]:
        """Full tensors on rank 0's CPU (an empty dict on the others); every rank must call this.
        For LoRA only the trainable (adapter) weights are gathered."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._restore_after_eval()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.finetune == "lora")
        state = get_model_state_dict(self.model, options=options)
        # A weight tied to another (the head to the embeddings) appears under both names; save_pretrained is
        # handed the first only, as it would have written it from an unsharded model.
        first_names = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
        return {k: v for k, v in state.items() if k in first_names}

    def _sharded(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # The frozen base is reloaded from model_name on resume; only what trains is written.
        options = StateDictOptions(ignore_frozen_params=self.finetune == "lora")
        return get_state_dict(self.model, self.optimizer, options=options)

    def save_sharded(self, folder: Path, asynchronous: bool = False) -> Optional[Future]:
        """Weights and optimizer state, each rank writing its own shards (torch.distributed.checkpoint).

        `asynchronous`: the shards are copied to CPU memory now and written in the background (the Future)."""
        self._restore_after_eval()
        model_state, optim_state = self._sharded()
        return save_state({"model": model_state, "optimizer": optim_state}, folder / SHARDED_DIR, asynchronous)

    def load_sharded(self, folder: Path) -> None:
        """Restore what save_sharded wrote, on any number of ranks: DCP reads the pieces each rank now holds."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if not (folder / SHARDED_DIR).is_dir():
            raise ConfigError(
                f"{folder} holds no {SHARDED_DIR}/ (it was saved by another strategy); resume it with "
                "the strategy it was trained with, or start fresh with --overwrite_output_dir"
            )
        model_state, optim_state = self._sharded()
        state = {"model": model_state, "optimizer": optim_state}
        load_state(state, folder / SHARDED_DIR)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            # For LoRA the frozen base was not saved (it comes from model_name): those keys stay as loaded.
            options=StateDictOptions(strict=self.finetune != "lora"),
        )
