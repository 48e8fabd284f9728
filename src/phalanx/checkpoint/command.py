"""`phalanx export`: a from_pretrained folder from a sharded-only checkpoint (checkpoint.export), or a LoRA run's
adapter merged into its base model (models.merge).

    phalanx export OUTPUT_DIR/checkpoint-400 EXPORTED_DIR
    phalanx export OUTPUT_DIR MERGED_DIR [--model_name BASE]     # a LoRA run's adapter (or a checkpoint's)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phalanx.checkpoint.export import export_checkpoint
from phalanx.errors import PhalanxError


def main(argv: list[str]) -> int:
    from phalanx.config.flags import CommandParser
    from phalanx.models.packages import leave_out_bitsandbytes, leave_out_deepspeed

    parser = CommandParser(
        prog="phalanx export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="a checkpoint-* folder, or a LoRA run's output_dir or checkpoint")
    parser.add_argument("out", type=Path, help="the new folder to write")
    parser.add_argument(
        "--model_name",
        default=None,
        help="a LoRA adapter's base model: local folder, Hub id or embedded:NAME (default: the one its "
        "adapter_config.json names)",
    )
    try:
        args = parser.parse_args(argv)
        from phalanx.runtime.quiet import quiet_libraries

        if (args.folder / "adapter_config.json").is_file():  # a LoRA run's adapter
            leave_out_bitsandbytes()  # it is merged into the unquantized base
            leave_out_deepspeed()  # (a ZeRO-3 checkpoint's export reads it with DeepSpeed's converter)
            quiet_libraries()  # after those: it imports transformers. Its weight bars, peft's deprecation chatter
            from phalanx.models.merge import export_merged_adapter

            print("\n".join(export_merged_adapter(args.folder, args.out, args.model_name)[1]))
            return 0
        if args.model_name is not None:
            raise PhalanxError(f"--model_name is for a LoRA adapter's base; {args.folder} holds no adapter_config.json")
        quiet_libraries()
        out = export_checkpoint(args.folder, args.out)
    except PhalanxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code  # 2 for bad input, 1 for a Hub that cannot be reached (a rerun may succeed)
    print(f"exported {args.folder} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
