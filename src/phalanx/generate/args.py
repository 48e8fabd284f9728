"""`phalanx generate`'s flags: parsed and checked without loading a model, so that a command that starts a
generation later (`phalanx launcher --generate`) checks them the same way, now."""

from __future__ import annotations

import argparse
import math
from typing import Sequence

from phalanx.config.flags import tcp_port
from phalanx.errors import ConfigError

DEFAULT_OUTPUT = "data/traj_chat.jsonl"


DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _bool(value: str) -> bool:
    lowered = str(value).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    from phalanx.config.flags import CommandParser

    parser = CommandParser(
        prog="phalanx generate",
        allow_abbrev=False,
        description="Answer every prompt num_sequences_per_question times, sharded over ranks and resumable; "
        "the records are chat rows that `phalanx train --dataset_path` reads as they are.",
    )

    def add(name: str, **kwargs) -> None:
        parser.add_argument(f"--{name}", dest=name, **kwargs)  # --model-name too: CommandParser.underscored

    add(
        "model_name",
        default=None,
        help="Local folder, Hub id or embedded:tiny-qwen3 (default: the adapter's base "
        "model, else embedded:tiny-qwen3).",
    )
    add("adapter", default=None, help="A LoRA adapter folder written by `phalanx train`, merged into the model.")
    add(
        "chat_template",
        default=None,
        help="Render chat prompts with this template: a jinja file or a name phalanx "
        "ships (default: the template saved with --adapter, else the model's own).",
    )
    add(
        "chat_template_kwargs",
        default=None,
        help="Template variables as a YAML/JSON mapping, e.g. '{enable_thinking: false}' (default: what the "
        "--adapter's run trained with, data.chat_template_kwargs, else none).",
    )
    add(
        "prompts",
        default="bundled:health-agent",
        help="jsonl / folder / save_to_disk / .txt of prompts (default: the bundled health-agent chats).",
    )
    add("num_questions", type=int, default=None, help="Use the first N prompts (default: all).")
    add("num_sequences_per_question", type=int, default=1, help="Sequences sampled per prompt.")
    add("batch_size", type=int, default=16, help="Sequences per forward pass on each rank (halved on out-of-memory).")
    add("max_new_tokens", type=int, default=256, help="Longest answer, in tokens.")
    add("temperature", type=float, default=0.7, help="Sampling temperature; 0 is greedy.")
    add("top_p", type=float, default=1.0, help="Nucleus sampling mass in (0, 1].")
    add("top_k", type=int, default=0, help="Keep the k most likely tokens; 0 keeps all.")
    add("seed", type=int, default=42, help="Seeds every (prompt, sequence) stream and the validation split.")
    add(
        "val_fraction",
        type=float,
        default=0.1,
        help="Fraction of the prompts (all their sequences) written to the validation file; 0 writes none.",
    )
    add("output", default=DEFAULT_OUTPUT, help="Training records (jsonl).")
    add(
        "val_output",
        default=None,
        help="Validation records (default: NAME_chat.jsonl -> NAME_val.jsonl, as traj_chat -> traj_val; else NAME_val.jsonl).",
    )
    add(
        "dtype",
        default="auto",
        type=lambda name: DTYPE_ALIASES.get(name, name),  # train's spellings (mixed_precision) work here too
        choices=["auto", "float32", "bfloat16", "float16"],
        help="Model weights; auto is bfloat16 (or float16) on CUDA, float32 on CPU (fp32, bf16, fp16 also read).",
    )
    add(
        "kv_cache",
        default="auto",
        choices=["auto", "fixed", "growing"],
        help="Decoding cache. fixed: preallocated, and on CUDA each decoding step is one CUDA graph replay; "
        "growing: rows that finish leave the batch at once; auto (default): fixed on CUDA where the model "
        "allows it (sdpa or eager attention; a sliding window only if prompt + answer fit in it), growing otherwise. A job resumes only with the cache it started with.",
    )
    add("world_size", type=int, default=1, help="Ranks to start on this machine (ignored under torchrun).")
    add("master_port", type=tcp_port, default=None, help="Rendezvous port for --world_size (default: a free one).")
    add("timeout_minutes", type=float, default=30.0, help="How long a rank waits for the others at the end.")
    add(
        "shutdown_timeout_s",
        type=int,
        default=300,
        help="--world_size: after a SIGTERM, how long the launcher "
        "lets the ranks finish and commit their batch before it kills them.",
    )
    add(
        "overwrite",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="Discard earlier records of --output and start over (default: resume them).",
    )
    add(
        "trust_remote_code",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="Run model code shipped with the checkpoint.",
    )
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    checks = [
        (args.num_sequences_per_question >= 1, "--num_sequences_per_question must be at least 1"),
        (
            args.num_questions is None or args.num_questions >= 1,
            "--num_questions must be at least 1 (or left out for all prompts)",
        ),
        (args.batch_size >= 1, "--batch_size must be at least 1"),
        (args.max_new_tokens >= 1, "--max_new_tokens must be at least 1"),
        (0 <= args.temperature < math.inf, "--temperature must be 0 (greedy) or a finite number above it"),
        (0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
        (args.top_k >= 0, "--top_k must be 0 (off) or more"),
        (0 <= args.val_fraction < 1, "--val_fraction must be in [0, 1)"),
        (args.world_size >= 1, "--world_size must be at least 1"),
        (args.timeout_minutes > 0, "--timeout_minutes must be positive"),
        (args.shutdown_timeout_s >= 1, "--shutdown_timeout_s must be at least 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if args.chat_template_kwargs is not None:
        import yaml

        from phalanx.config.chat_templates import template_variables_problem

        try:
            args.chat_template_kwargs = yaml.safe_load(args.chat_template_kwargs)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--chat_template_kwargs: not YAML/JSON ({exc})") from None
        problem = template_variables_problem(args.chat_template_kwargs)
        if problem:
            raise ConfigError(f"--chat_template_kwargs: {problem}")
    if args.chat_template is not None:
        from phalanx.config.chat_templates import ChatTemplateError, resolve_chat_template

        try:
            resolve_chat_template(args.chat_template)
        except ChatTemplateError as exc:
            raise ConfigError(f"--chat_template {args.chat_template}: {exc.reason}") from None
    return args
