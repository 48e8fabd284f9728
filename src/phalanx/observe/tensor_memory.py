"""Peak bytes of live tensor storage in this process, on any device: the CPU analogue of max_memory_allocated.

`torch.cuda.max_memory_allocated` counts the bytes of the tensors alive at the worst moment;
the CPU has no such counter, and peak RSS mixes tensors with the interpreter, libraries and
what malloc keeps after a free. `TensorMemoryTracker` counts what the CUDA number counts:

  * every tensor an operator returns (a TorchDispatchMode sees each op, forward, backward and
    optimizer alike, including tensors made inside C++ such as DDP's gradient buckets),
  * tensors that existed before tracking began, once registered with `track(...)`,
  * storages resized in place (FSDP2 frees gathered parameters with `untyped_storage().resize_(0)`),

each storage counted once however many views share it, and dropped when the storage is freed
(a weak reference on the storage fires then). Tensors made without any operator (from_blob,
numpy bridges) are invisible until an operator returns them or they are registered.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor; wrapper subclasses (DTensor) are unwrapped to their local tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for name in names if isinstance(getattr(t, name), torch.Tensor) for s in _storages(getattr(t, name))]
    if t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return []


class TensorMemoryTracker(TorchDispatchMode):
    """Use as a context manager; `current`, `peak` and `peak_op` (the operator that set the peak) are bytes/names."""

    def __init__(self, device_type: Optional[str] = None):
        super().__init__()
        self.device_type = device_type  # count only storages on this device type (None: all)
        self.current = 0
        self.peak = 0
        self.peak_op = "start"
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage object) -> (weak ref, bytes counted)
        self._op = "start"
        self._resize: Any = None

    def track(self, *tensors: Any) -> "TensorMemoryTracker":
        """Count tensors that already exist (model parameters, optimizer state); nested lists and dicts are walked."""
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return self

    def track_module(self, module: torch.nn.Module) -> "TensorMemoryTracker":
        return self.track(
            [p for p in module.parameters()],
            [p.grad for p in module.parameters() if p.grad is not None],
            list(module.buffers()),
        )

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> "TensorMemoryTracker":
        return self.track([dict(s) for s in optimizer.state.values()])

    def reset_peak(self) -> None:
        self.peak, self.peak_op = self.current, self._op

    def _add(self, t: torch.Tensor) -> None:
        if self.device_type is not None and t.device.type != self.device_type and not is_traceable_wrapper_subclass(t):
            return
        for storage in _storages(t):
            key = id(storage)
            entry = self._live.get(key)
            if entry is not None and entry[0]() is storage:
                self._resized(storage)
                continue
            nbytes = storage.nbytes()
            self._live[key] = (weakref.ref(storage, lambda _, key=key: self._freed(key)), nbytes)
            self._change(nbytes)

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        entry = self._live.get(key)
        if entry is None or entry[0]() is not storage:
            return
        nbytes = storage.nbytes()
        if nbytes != entry[1]:
            self._live[key] = (entry[0], nbytes)
            self._change(nbytes - entry[1])

    def _change(self, delta: int) -> None:
        self.current += delta
        if self.current > self.peak:
            self.peak, self.peak_op = self.current, self._op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = str(func.overloadpacket.__name__)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        if func.overloadpacket in (torch.ops.aten.resize_, torch.ops.aten.set_):
            self._add(args[0])
        return out

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):  # storage resizes bypass the dispatcher
            result = original(storage, size)
            tracker._resized(storage)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)
