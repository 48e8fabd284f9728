"""`phalanx export` of a LoRA adapter: merged into its base model (models.merge, through the command,
checkpoint.command). The sharded-checkpoint export is tested with real FSDP2 and ZeRO-3 runs in
tests/checkpoint/test_sharded_full_checkpoint.py."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from phalanx.checkpoint.command import main
from phalanx.checkpoint.layout import MARKER
from phalanx.checkpoint.resume import FINISHED, RUN_RECORD
from phalanx.models.presets import materialize_embedded_model

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def finished_lora_run(base, run, tokenizer, record: dict) -> None:
    """What `phalanx train` leaves in output_dir: an adapter with non-zero updates on `base`, the tokenizer and
    chat template it trained with, its run record, and the record that it finished."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)  # a trained adapter: the merge changes the weights
    model.save_pretrained(run)
    tokenizer.save_pretrained(run)
    (run / RUN_RECORD).write_text(json.dumps({"config": record}))
    (run / FINISHED).write_text("{}")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A bf16 base model folder and a finished LoRA run on it, with its own chat template, on the 4-bit base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("export-lora")
    embedded = materialize_embedded_model("tiny-qwen3", root / "embedded")
    base = root / "base-bf16"
    AutoModelForCausalLM.from_pretrained(embedded, dtype=torch.bfloat16).save_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(embedded)
    tokenizer.save_pretrained(base)
    tokenizer.chat_template = TEMPLATE  # the template the run trained with, not the base's
    finished_lora_run(base, root / "run", tokenizer, {"model": {"load_in_4bit": True}})
    return base, root / "run"


def test_a_lora_run_is_merged_into_its_base_in_the_bases_dtype_with_the_runs_template(lora_run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, run = lora_run
    out = tmp_path / "merged"
    assert main([str(run), str(out)]) == 0
    said = capsys.readouterr().out
    assert f"merged the LoRA adapter of {run} into {base} (bfloat16) -> {out}" in said
    assert "trained on the 4-bit quantized base (QLoRA)" in said  # the run's record says so
    assert "generation_config.json stops at" not in said  # answers end with <|im_end|>, the base's end of sequence
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # The weights: base + scale * B @ A computed in fp32 and rounded to bf16 once.
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), run)
    expected = {k: v.to(torch.bfloat16) for k, v in reference.merge_and_unload().state_dict().items()}
    merged = load_file(out / "model.safetensors")
    assert set(merged) <= set(expected) and "model.layers.0.self_attn.q_proj.weight" in merged
    assert all(torch.equal(merged[k], expected[k]) for k in merged)
    base_weights = load_file(base / "model.safetensors")
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base_weights["model.layers.0.self_attn.q_proj.weight"]
    )
    # Loads like any model, no PEFT needed.
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_export_says_what_it_did_without_the_libraries_progress_bars_and_warnings(lora_run, tmp_path):
    """Run as a user runs it: `phalanx export RUN OUT` printed transformers' 'Loading weights' and 'Writing model
    shards' bars and a FutureWarning traceback line from peft ('warnings.warn(') around its one line; quieting the
    libraries before DeepSpeed was left out imported it, which printed its accelerator '[WARNING]'."""
    from helpers import run_phalanx

    _, run = lora_run
    proc = run_phalanx("export", str(run), str(tmp_path / "merged"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("merged the LoRA adapter of"), proc.stdout  # no DeepSpeed accelerator line first
    assert proc.stderr.strip() == "", proc.stderr


def test_a_base_given_by_name_replaces_the_one_adapter_config_names(lora_run, tmp_path, capsys):
    """A copied run whose adapter_config.json names a folder that is not here: --model_name gives the base."""
    base, run = lora_run
    moved = tmp_path / "run"
    shutil.copytree(run, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/base"}))
    assert main([str(moved), str(tmp_path / "a")]) == 2
    assert "base_model_name_or_path = '/gone/base': no such folder" in capsys.readouterr().err
    assert main([str(moved), str(tmp_path / "b"), "--model_name", str(base)]) == 0
    assert (tmp_path / "b" / "model.safetensors").is_file() and not (tmp_path / "a").exists()
    # A bare PEFT adapter (no tokenizer files, no run record) takes the base's tokenizer, an embedded base's too.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(moved / name, bare / name)
    assert main([str(bare), str(tmp_path / "c"), "--model_name", "embedded:tiny-qwen3"]) == 0
    assert (tmp_path / "c" / "tokenizer_config.json").is_file() and (tmp_path / "c" / "chat_template.jinja").is_file()


def test_what_cannot_be_merged_is_refused_and_nothing_is_written(lora_run, tmp_path, capsys):
    base, run = lora_run
    unfinished = tmp_path / "unfinished"  # a run whose final save may have been cut short
    shutil.copytree(run, unfinished)
    (unfinished / FINISHED).unlink()
    uncommitted = tmp_path / "out" / "checkpoint-3"  # a checkpoint without its commit record
    shutil.copytree(run, uncommitted)
    committed = tmp_path / "out" / "checkpoint-best"
    shutil.copytree(run, committed)
    (committed / MARKER).write_text("{}")
    existing = tmp_path / "existing"
    existing.mkdir()
    cases = [
        ([str(unfinished), str(tmp_path / "x1")], f"the run has not finished (no {FINISHED})"),
        ([str(uncommitted), str(tmp_path / "x2")], "is not a committed phalanx checkpoint"),
        ([str(committed), str(existing)], "exists; choose a new folder"),
        ([str(base), str(tmp_path / "x3"), "--model_name", str(base)], "--model_name is for a LoRA adapter's base"),
        ([str(committed), str(tmp_path / "x4"), "--model_nam", str(base)], "Did you mean --model_name?"),
        # an OUT that cannot be made ended in an OSError traceback from save_pretrained's makedirs (/proc takes no
        # new entry, whoever runs this)
        ([str(run), "/proc/nope/merged"], "phalanx export OUT /proc/nope/merged: cannot create or write into /proc"),
        ([str(run), str(existing / "notes.txt" / "m")], "is a file, not a folder"),
    ]
    (existing / "notes.txt").write_text("keep me")
    for argv, expected in cases:
        assert main(argv) == 2, argv
        assert expected in capsys.readouterr().err, argv
    assert not any((tmp_path / f"x{i}").exists() for i in range(1, 5))
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]
    assert not list(tmp_path.glob(".*staging*"))
    assert main([str(committed), str(tmp_path / "from-best")]) == 0  # a committed checkpoint's adapter merges


def test_a_merged_base_model_also_stops_where_the_runs_template_ends_an_answer(tmp_path, capsys):
    """A base model that stops at <|endoftext|> only, LoRA-trained under ChatML (answers end with <|im_end|>): the
    merged model's generation_config.json lists <|im_end|> after <|endoftext|>, as full fine-tuning's saved model does
    (train/run.py); the adapter itself carries no generation config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "base"
    embedded = materialize_embedded_model("tiny-qwen3", tmp_path / "embedded")
    model = AutoModelForCausalLM.from_pretrained(embedded)
    tokenizer = AutoTokenizer.from_pretrained(embedded)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})  # id 260, inside the model's 264 embeddings
    model.generation_config.eos_token_id = model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    finished_lora_run(base, tmp_path / "run", tokenizer, {})
    assert main([str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    assert "generation_config.json stops at '<|im_end|>' (1) too" in capsys.readouterr().out
    saved = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [tokenizer.eos_token_id, 1]
