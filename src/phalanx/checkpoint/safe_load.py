"""Reading training state without running code from it.

Checkpoint files that hold Python objects are pickles, and a pickle can run any code while it loads: a tampered
or foreign checkpoint in an output_dir would run as soon as a requeued job resumed from it. phalanx reads every
such file with a restricted unpickler that builds tensors, plain values and a short, explicit list of named
classes, and refuses anything else with the file's name (UnsafeCheckpointError). Weights are safetensors (no
code by design).

- phalanx's own state (optimizer.pt, scheduler.pt, precision.pt, rng_state_*.pt, ema.pt):
  torch.load(weights_only=True), nothing added to torch's allowlist.
- DeepSpeed's checkpoint (deepspeed/state/*.pt): torch.load(weights_only=True) plus DEEPSPEED_STATE_CLASSES
  (loss scalers, the ZeRO stage enum, fragment addresses). DeepSpeed itself loads them with
  weights_only=False; `use_safe_loading(engine)` swaps in a checkpoint engine that does not, and `phalanx
  export` opens each file this way before DeepSpeed's zero_to_fp32 reads it.
- DCP's .metadata (FSDP2's sharded state): pickle protocol 4, which torch's restricted unpickler does not
  read; a pickle.Unpickler whose find_class admits only DCP_METADATA_GLOBALS checks it before DCP loads it.

A pickle that a restricted unpickler accepts references no other names, so reading it again with the full
unpickler (what DeepSpeed and DCP then do) can call nothing else.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Iterable

import torch

from phalanx.errors import PhalanxError

# (module, name) pairs DCP's metadata refers to: its own dataclasses, shapes, dtypes, a layout lookup, paths.
DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(PhalanxError):
    def __init__(self, path: Path, what: str):
        super().__init__(
            f"{path} holds {what}, so it is not loaded: phalanx reads training state with a restricted unpickler "
            "(tensors, plain values and a few named classes) and never runs code from a checkpoint. phalanx does "
            "not write such files; this checkpoint was altered or comes from another tool. Resume from another "
            "checkpoint (--resume_from_checkpoint PATH) or start fresh (--overwrite_output_dir)."
        )


def deepspeed_state_classes() -> list[type]:
    """The classes DeepSpeed pickles into its ZeRO checkpoints besides tensors and plain values."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_state_file(path: Path, map_location: Any = "cpu", allow: Iterable[type] = (), mmap: bool = False) -> Any:
    """torch.load(weights_only=True), with the classes in `allow` added to torch's allowlist for this call only."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        detail = str(exc).strip().splitlines()
        raise UnsafeCheckpointError(
            Path(path), f"objects other than tensors and plain values ({detail[-1] if detail else exc!r})"
        ) from None


def check_deepspeed_checkpoint(folder: Path) -> None:
    """Open every file of a DeepSpeed checkpoint folder with the restricted loader (memory-mapped: cheap)."""
    classes = deepspeed_state_classes()
    for path in sorted(Path(folder).rglob("*.pt")):
        load_state_file(path, allow=classes, mmap=True)


def use_safe_loading(engine: Any) -> None:
    """Make a DeepSpeed engine read its checkpoints through load_state_file instead of its weights_only=False."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class RestrictedCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return load_state_file(Path(path), map_location, allow=deepspeed_state_classes())

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise PhalanxError(
            f"DeepSpeed chose the checkpoint engine {type(engine.checkpoint_engine).__name__}; phalanx "
            "reads checkpoints only through the torch one it can restrict. Remove the checkpoint "
            "engine settings from the DeepSpeed config."
        )
    safe = RestrictedCheckpointEngine.__new__(RestrictedCheckpointEngine)
    safe.__dict__.update(engine.checkpoint_engine.__dict__)  # same settings (serialization format, name)
    engine.checkpoint_engine = safe


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")


def check_dcp_metadata(folder: Path) -> None:
    """Refuse a DCP folder whose .metadata pickle refers to anything but DCP's own metadata classes."""
    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(path, f"a pickle that is not DCP metadata ({exc})") from None


def dcp_reader(folder: Path):
    """DCP's file reader for `folder`, after its metadata passed check_dcp_metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    check_dcp_metadata(folder)
    return FileSystemReader(str(folder))
