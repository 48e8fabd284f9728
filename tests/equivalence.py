"""The equivalence tier's shared parts: N ranks with batch b must train like one process with batch N*b.

The flags every equivalence run uses, a run that returns its per-step losses, and the checks on saved weights.
The dataset and the one-process references are session fixtures in tests/conftest.py (trained once, shared by
tests/train and tests/parallel).
"""

import json
from pathlib import Path

from helpers import read_metrics, run_phalanx, tiny_run

COMMON = tiny_run()


def grad_norms(out: Path) -> list[float]:
    """Pre-clip global gradient norm per step: equal norms mean clipping saw the whole (unsharded) gradient."""
    return [r["grad_norm"] for r in read_metrics(out)]


def train(dataset: Path, out: Path, world: int, batch: int, finetune: str, *extra: str) -> list[float]:
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(dataset),
        "--output_dir",
        str(out),
        "--world_size",
        str(world),
        "--batch_size",
        str(batch),
        "--finetune",
        finetune,
        *COMMON,
        *extra,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r["loss"] for r in read_metrics(out)]


def weights_file(finetune: str) -> str:
    return "adapter_model.safetensors" if finetune == "lora" else "model.safetensors"


def assert_adapter_loads_with_peft(out: Path) -> None:
    """The saved adapter loads with PeftModel.from_pretrained onto its base and holds exactly the saved tensors."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((out / "adapter_config.json").read_text())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), out)
    saved = load_file(out / "adapter_model.safetensors")
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def assert_saved_weights_match(ref_dir, out, finetune: str) -> None:
    """The saved model or adapter is whole (not empty, not a shard) and equals the one-process weights."""
    from safetensors.torch import load_file

    a, b = load_file(ref_dir / weights_file(finetune)), load_file(out / weights_file(finetune))
    assert a.keys() == b.keys() and len(b) > 0
    for key in a:
        assert a[key].shape == b[key].shape, key
        assert (a[key] - b[key]).abs().max() < 1e-4, key
    if finetune == "lora":
        assert any(k.endswith("lora_B.weight") and b[k].abs().max() > 0 for k in b), "adapter left at its zero init"
