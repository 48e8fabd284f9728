"""`phalanx launcher`, `phalanx slurm` and `phalanx env`: parse the flags, check them, write or run.

The spelling follows seed 003's `scripts/distributed_setup.py launcher|slurm`. Everything after
a bare `--` is passed to `phalanx train` inside the generated script, after being checked
against the config schema here, so a typo is reported now rather than on the cluster.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from phalanx.config.flags import CommandParser, tcp_port
from phalanx.errors import ConfigError
from phalanx.launch import scripts
from phalanx.launch.scripts import (
    DEFAULT_PORT,
    DEFAULT_RDZV_TIMEOUT,
    MEM_PER_GPU,
    Job,
    LaunchSpec,
    SlurmSpec,
    results_folder_of,
)
from phalanx.runtime.durable import write_generated_files

if TYPE_CHECKING:
    from phalanx.config.schema import RunConfig


def split_train_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """('--num_nodes 2 -- --max_steps 5') -> (['--num_nodes', '2'], ['--max_steps', '5'])."""
    args = list(args)
    if "--" in args:
        i = args.index("--")
        return args[:i], args[i + 1 :]
    return args, []


def common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="the training YAML (e.g. configs/demo.yaml); checked now")
    p.add_argument(
        "--num_gpus_per_node",
        type=int,
        required=True,
        help="GPUs per node, one rank each; 0 runs CPU ranks over gloo (with --nproc_per_node)",
    )
    p.add_argument("--nproc_per_node", type=int, help="ranks per node (default: the GPU count, or 1 on CPU)")
    p.add_argument("--num_nodes", type=int, default=1)
    p.add_argument(
        "--use_deepspeed",
        action="store_true",
        help="start the ranks with the DeepSpeed launcher (GPU or CPU nodes; no --max_restarts)",
    )
    p.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="restart all ranks this many times when one fails (elastic; resumes from the newest checkpoint)",
    )
    p.add_argument(
        "--rdzv_timeout",
        type=int,
        default=DEFAULT_RDZV_TIMEOUT,
        help="seconds a node waits for the others before it stops with a message",
    )
    p.add_argument("--python", default=sys.executable, help="the Python that runs phalanx on the nodes")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing script that holds something else (by default it is left as it is and refused)",
    )


def layout(args: argparse.Namespace) -> tuple[int, int]:
    """(num_gpus_per_node, nproc_per_node), checked."""
    gpus = args.num_gpus_per_node
    if gpus < 0:
        raise ConfigError(f"--num_gpus_per_node {gpus}: give 0 (CPU ranks) or a positive number of GPUs")
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (gpus or 1)
    if nproc < 1:
        raise ConfigError(f"--nproc_per_node {nproc}: each node runs at least one rank")
    if gpus and nproc != gpus:
        raise ConfigError(
            f"--nproc_per_node {nproc} with --num_gpus_per_node {gpus}: GPU nodes run one rank per GPU. "
            "Leave --nproc_per_node out, or use --num_gpus_per_node 0 --nproc_per_node N for CPU ranks."
        )
    if args.num_nodes < 1:
        raise ConfigError(f"--num_nodes {args.num_nodes}: at least 1")
    if args.max_restarts < 0:
        raise ConfigError(f"--max_restarts {args.max_restarts}: 0 or more")
    if args.use_deepspeed and args.max_restarts:
        raise ConfigError(
            f"--max_restarts {args.max_restarts} with --use_deepspeed: the DeepSpeed launcher does not "
            "restart ranks. Leave out --use_deepspeed (torchrun restarts them, and the config's "
            "strategy deepspeed still trains with the DeepSpeed engine), or --max_restarts."
        )
    return gpus, nproc


def check_training(
    config: Optional[str],
    train_args: list[str],
    num_nodes: int,
    nproc_per_node: int,
    gpus: int,
    run_dir: Optional[Path] = None,
) -> RunConfig:
    """Load the config with the extra flags exactly as `phalanx train` will, and check it against the job's layout
    (nodes, ranks, GPUs) as the ranks would; returns the RunConfig.

    run_dir: the folder the job runs in (the script cds there). Relative paths in the config and flags (a
    --chat_template file) are checked from there when it exists here, as the ranks will read them."""
    from phalanx.config.loader import config_from_args
    from phalanx.parallel import check_before_launch

    if config is not None and not Path(config).is_file():
        what = "a folder" if Path(config).is_dir() else "no such file"
        raise ConfigError(f"--config {config}: {what} (expected a training YAML such as configs/demo.yaml)")
    config = None if config is None else str(Path(config).resolve())
    here = Path.cwd()
    elsewhere = run_dir is not None and run_dir.is_dir() and run_dir.resolve() != here.resolve()
    try:
        if elsewhere:
            os.chdir(run_dir)
        cfg = config_from_args(train_args, flags_only=True, config_path=config)[0]
        cfg.check_nodes(num_nodes)
        check_before_launch(cfg, num_nodes * nproc_per_node, on_gpu=gpus > 0)  # files it reads too (DeepSpeed JSON)
    except ConfigError as exc:
        if not elsewhere:
            raise
        raise ConfigError(f"{exc}\n  (relative paths were read from {run_dir}, the folder the job runs in)") from None
    finally:
        os.chdir(here)
    return cfg


def note_launcher_and_strategy(cfg, use_deepspeed: bool) -> None:
    """--use_deepspeed picks the launcher; the DeepSpeed engine is the config's choice (seed 003 set both)."""
    if use_deepspeed and cfg.distributed.strategy != "deepspeed":
        print(
            f"note: the DeepSpeed launcher will start the ranks, but the config trains with strategy "
            f"'{cfg.distributed.strategy}'. For the DeepSpeed engine set distributed.strategy: deepspeed "
            "(or pass -- --strategy deepspeed).",
            file=sys.stderr,
        )


def warn_if_restarts_start_over(cfg, restarts: bool) -> None:
    """A restarted or requeued job runs the same command; with overwrite_output_dir it would start over."""
    if restarts and cfg.overwrite_output_dir:
        print(
            "warning: the config sets overwrite_output_dir, so a restarted or requeued run starts over instead of "
            "resuming from its checkpoint; remove it (or pass -- --overwrite_output_dir false) to resume.",
            file=sys.stderr,
        )


def config_for_script(config: Optional[str], project_dir: Path) -> Optional[str]:
    """The config path as the script (which cds to the project folder) should name it."""
    if config is None:
        return None
    path = Path(config).resolve()
    try:
        return str(path.relative_to(project_dir))
    except ValueError:
        return str(path)


def command_line(name: str, args: Sequence[str]) -> str:
    return " ".join(["phalanx", name, *map(shlex.quote, args)])


@dataclass
class JobFlags:
    """`phalanx launcher|slurm` flags, parsed and their layout checked: what both commands read the same way."""

    args: argparse.Namespace
    train_args: list[str]  # after the bare `--`: for `phalanx train`
    gpus: int  # per node
    nproc: int  # ranks per node
    command_line: str


def parse_job_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> JobFlags:
    own, train_args = split_train_args(argv)
    args = parser.parse_args(own)
    gpus, nproc = layout(args)
    return JobFlags(args, train_args, gpus, nproc, command_line(parser.prog.split()[-1], argv))


def checked_job(flags: JobFlags, project_dir: Path, restarts: bool) -> tuple[Job, RunConfig]:
    """The job both scripts describe, after its training config was checked as the ranks will check it.

    restarts: whether the job may run its command again (--max_restarts, a SLURM requeue), so that a config which
    would start over instead of resuming is warned about."""
    args = flags.args
    cfg = check_training(args.config, flags.train_args, args.num_nodes, flags.nproc, flags.gpus, run_dir=project_dir)
    warn_if_restarts_start_over(cfg, restarts)
    note_launcher_and_strategy(cfg, args.use_deepspeed)
    job = Job(
        config=config_for_script(args.config, project_dir),
        python=args.python,
        project_dir=project_dir,
        num_gpus_per_node=flags.gpus,
        nproc_per_node=flags.nproc,
        num_nodes=args.num_nodes,
        use_deepspeed=args.use_deepspeed,
        max_restarts=args.max_restarts,
        rdzv_timeout=args.rdzv_timeout,
        shutdown_timeout=cfg.distributed.shutdown_timeout_s,
        train_args=flags.train_args,
        command_line=flags.command_line,
    )
    return job, cfg


# --- phalanx launcher ----------------------------------------------------------------------------


def launcher_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="phalanx launcher",
        description="Write a script that starts training on this node "
        "(torchrun or the DeepSpeed launcher), plus a Windows .bat for single-node runs.",
        epilog="Flags after a bare -- go to `phalanx train`, e.g. -- --max_steps 100.",
    )
    common_flags(p)
    p.add_argument("--node_rank", type=int, default=0, help="this node's rank, 0 on the master node")
    p.add_argument("--master_addr", help="the master node's address (required with --num_nodes > 1)")
    p.add_argument("--master_port", type=tcp_port, default=DEFAULT_PORT)
    p.add_argument("--output", default="scripts/run_training.sh", help="where to write the script")
    p.add_argument(
        "--generate",
        metavar="'FLAGS'",
        help="seed 001's run_distributed.sh: the script first runs `phalanx generate FLAGS` (one quoted string) on "
        "the same ranks, then trains on the file it writes (single node)",
    )
    return p


def check_generation(words: str, flags: JobFlags) -> tuple[list[str], Path, Optional[Path]]:
    """`--generate 'FLAGS'`: the flags split and checked as `phalanx generate` will check them, and the training file
    and validation file (None: none) they write, relative to the folder the job runs in."""
    from phalanx.generate.args import parse_args
    from phalanx.generate.shards import val_output_of

    if flags.args.num_nodes > 1:
        raise ConfigError(
            "--generate runs on one node; for several, generate first (phalanx generate --world_size N on one of them, "
            "or torchrun -m phalanx generate) and give the nodes' scripts its output as --dataset_path"
        )
    try:
        generate_args = shlex.split(words)
    except ValueError as exc:
        raise ConfigError(f"--generate {words!r}: {exc}; give phalanx generate's flags as one quoted string") from None
    taken = [w for w in generate_args if w.partition("=")[0] in ("--world_size", "--master_port")]
    if taken:
        raise ConfigError(
            f"--generate: {taken[0]} is the script's to set (generation runs on the job's ranks); leave it out"
        )
    try:
        args = parse_args(generate_args)
    except ConfigError as exc:
        raise ConfigError(f"--generate: {exc}") from None
    output = Path(args.output)
    return generate_args, output, val_output_of(output, args.val_output, args.val_fraction)


def train_on_generated(flags: JobFlags, output: Path, val: Optional[Path]) -> None:
    """Point the training at what --generate writes when the config names no dataset (adding --dataset_path and
    --eval_dataset_path to its flags), into seed 001's results folder when it names no output_dir. A config that
    trains on another dataset is refused."""
    from phalanx.config.loader import config_from_args
    from phalanx.config.schema import BUNDLED_DATASET

    # Only the data section and output_dir are read here; checked_job then checks the whole config, these flags included.
    cfg = config_from_args(flags.train_args, flags_only=True, config_path=flags.args.config)[0]
    if "output_dir" not in cfg.model_fields_set:
        flags.train_args += ["--output_dir", str(results_folder_of(output))]
    d = cfg.data
    given = d.dataset_name if d.dataset_name and d.dataset_name != BUNDLED_DATASET else d.dataset_path
    if given and given != BUNDLED_DATASET:
        if d.dataset_path and Path(d.dataset_path).resolve() == output.resolve():
            return
        raise ConfigError(
            f"--generate writes {output}, but the run trains on {given} (data.{'dataset_name' if d.dataset_name else 'dataset_path'}): "
            f"leave the dataset out of the config and flags (the script then trains on {output}), or set it to {output}"
        )
    flags.train_args += ["--dataset_path", str(output)]
    if val is not None and not d.eval_dataset_path:
        flags.train_args += ["--eval_dataset_path", str(val)]


def refuse_another_nodes_script(script: Path, spec: LaunchSpec) -> None:
    """Seed 003's commands for the other nodes (`... --node_rank 1`), run in a project folder the nodes share, write
    each node's script to the same --output, scripts/run_training.sh: the second was refused as a file that "holds
    something else", and --overwrite, the way it named, would leave node 0 to run node 1's script. When `script` holds
    another node's script of this very job, say so, with the ways that keep both."""
    import dataclasses
    import re

    try:
        text = script.read_text()
    except (OSError, UnicodeDecodeError):
        return
    found = re.search(r'^NODE_RANK="\$\{PHALANX_NODE_RANK:-(\d+)\}"$', text, re.MULTILINE)
    if not found or int(found.group(1)) == spec.node_rank:
        return
    theirs = int(found.group(1))
    other_node = scripts.render_launcher_sh(dataclasses.replace(spec, node_rank=theirs), script)

    def without_command_line(lines: str) -> list[str]:
        return [line for line in lines.splitlines() if not line.startswith("# Written by:")]

    if without_command_line(other_node) != without_command_line(text):
        return
    raise ConfigError(
        f"--output {script}: {script} holds node_rank {theirs}'s script of this same job (a project folder the nodes "
        f"share); it is left as it is. Run that script on this node as `PHALANX_NODE_RANK={spec.node_rank} bash "
        f"{script}`, or give each node's script its own --output (--output scripts/node{spec.node_rank}.sh); "
        f"--overwrite would leave node_rank {theirs} running this node's script."
    )


WRITTEN_BY = ("# Written by:", "REM Written by:")


def same_but_for_the_command(files: dict[Path, str]) -> dict[Path, str]:
    """The files, each as it already is where it differs only in its "Written by" line: the same command spelled
    another way (`--num_gpus_per_node=0`, the flags in another order) writes the same script, and a rerun was refused
    as a file that "holds something else"."""

    def body(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith(WRITTEN_BY)]

    kept = {}
    for path, text in files.items():
        try:
            existing = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            existing = None
        same = existing is not None and existing != text and body(existing) == body(text)
        kept[path] = existing if same and existing.count("\r\n") == text.count("\r\n") else text
    return kept


def launcher_main(argv: Sequence[str]) -> int:
    flags = parse_job_flags(launcher_parser(), argv)
    args, nproc = flags.args, flags.nproc
    if not 0 <= args.node_rank < args.num_nodes:
        raise ConfigError(
            f"--node_rank {args.node_rank} is outside 0..{args.num_nodes - 1} for --num_nodes {args.num_nodes}"
        )
    master = args.master_addr or "127.0.0.1"
    if args.num_nodes > 1:
        from phalanx.launch.preflight import refuse_loopback_master

        if args.master_addr is None:
            raise ConfigError(
                f"--num_nodes {args.num_nodes} needs --master_addr: the master node's address, the same on every node"
            )
        refuse_loopback_master(master, args.num_nodes)
    generate_args = None
    if args.generate is not None:
        generate_args, output, val = check_generation(args.generate, flags)
        train_on_generated(flags, output, val)
    job, cfg = checked_job(flags, Path.cwd().resolve(), restarts=args.max_restarts > 0)
    job.generate_args = generate_args
    out = Path(args.output)
    spec = LaunchSpec(job, node_rank=args.node_rank, master_addr=master, master_port=args.master_port)
    if args.num_nodes > 1 and not args.overwrite:
        refuse_another_nodes_script(out, spec)
    files = {out: scripts.render_launcher_sh(spec, out)}
    if args.num_nodes == 1 and not args.use_deepspeed:
        bat = out.with_suffix(".bat")
        files[bat] = scripts.render_launcher_bat(spec, bat)
    written = list(files)
    outcomes = write_generated_files(
        same_but_for_the_command(files), args.overwrite, f"--output {out}", executable=True
    )
    where = f"node {args.node_rank} of {args.num_nodes}" if args.num_nodes > 1 else "this machine"
    said = ", ".join(f"{path}{' (unchanged)' if how == 'unchanged' else ''}" for path, how in zip(written, outcomes))
    print(f"wrote {said}: {nproc} rank(s) on {where}.")
    if job.generate_args is not None:
        print(
            f"it generates first: phalanx generate {' '.join(map(shlex.quote, job.generate_args))}; then it trains, "
            f"into {cfg.output_dir}."
        )
    print(f"run it with: bash {out}" + (f"   (on Windows: {written[1]})" if len(written) > 1 else ""))
    if args.num_nodes > 1:
        print(
            f"start the script for every node_rank 0..{args.num_nodes - 1} at about the same time; "
            f"each waits up to {args.rdzv_timeout} s for the others."
        )
    return 0


# --- phalanx slurm -------------------------------------------------------------------------------

TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def check_time_limit(value: str) -> str:
    days, _, rest = value.rpartition("-") if "-" in value else ("", "", value)
    parts = rest.split(":")
    ok = (not days or days.isdigit()) and all(p.isdigit() for p in parts) and 1 <= len(parts) <= 3
    if not ok or (days and len(parts) > 3):
        raise ConfigError(f"--time_limit {value!r} is not a SLURM time; accepted: {TIME_FORMATS} (e.g. 48:00:00)")
    return value


def slurm_memory(flag: str) -> Callable[[str], str]:
    """The argparse type of a SLURM memory size (--mem_per_gpu, --mem): a whole number with an optional unit K, M, G
    or T. SLURM reads a number without a unit as megabytes, so one below 1024 (`--mem_per_gpu 32`, meant as 32G)
    is refused: a rank given 32 MB is killed as soon as it loads a model."""

    def check(value: str) -> str:
        number, unit = (value[:-1], value[-1].upper()) if value[-1:].isalpha() else (value, "")
        if not number.isdigit() or unit not in ("", "K", "M", "G", "T"):
            raise ConfigError(
                f"{flag} {value!r} is not a SLURM memory size; accepted: a whole number with K, M, G or T"
            )
        if not unit and int(number) < 1024:
            raise ConfigError(
                f"{flag} {value}: SLURM reads a number without a unit as megabytes ({value} MB); write {value}G "
                f"for gigabytes, or {value}M if megabytes are meant"
            )
        return value

    return check


def slurm_time_seconds(value: str) -> int:
    """Seconds in a SLURM time (checked by check_time_limit): a lone number is minutes, two fields are MM:SS, three
    HH:MM:SS; after a day count, fields are hours, then minutes, then seconds."""
    days, _, rest = value.rpartition("-") if "-" in value else ("", "", value)
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def slurm_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="phalanx slurm",
        description="Write an sbatch script: one torchrun per node through srun, "
        "c10d rendezvous on the first node, NCCL settings, and save-then-requeue before the time limit.",
        epilog="Flags after a bare -- go to `phalanx train`, e.g. -- --max_steps 100.",
    )
    common_flags(p)
    p.add_argument("--time_limit", default="24:00:00", type=check_time_limit, help=f"job time limit ({TIME_FORMATS})")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--cpus_per_task", type=int, help="CPUs per rank (default 8 on GPU nodes, 1 for CPU ranks)")
    p.add_argument(
        "--mem_per_gpu", type=slurm_memory("--mem_per_gpu"), help=f"memory per GPU (GPU nodes; default {MEM_PER_GPU})"
    )
    p.add_argument(
        "--mem", type=slurm_memory("--mem"), help="memory per node, e.g. 64G (instead of --mem_per_gpu; CPU nodes)"
    )
    p.add_argument("--job_name", default="llm_finetune")
    p.add_argument("--log", default="slurm-%j.out", help="the job's log file (SLURM's --output)")
    p.add_argument("--master_port", type=tcp_port, help="rendezvous port (default: derived from the job id)")
    p.add_argument(
        "--signal_time",
        type=int,
        default=None,
        help="seconds before the time limit at which the job saves a checkpoint and requeues itself "
        f"(default: the config's distributed.shutdown_timeout_s + {scripts.SIGNAL_MARGIN_S})",
    )
    p.add_argument("--no_requeue", action="store_true", help="let the job end at its time limit instead")
    p.add_argument(
        "--setup",
        action="append",
        default=[],
        help="a shell line to run first, e.g. 'module load cuda/12.2' (repeatable)",
    )
    p.add_argument("--chdir", help="the folder the job runs in (default: this one)")
    p.add_argument("--output", default="scripts/slurm_job.sh", help="where to write the sbatch script")
    return p


def slurm_main(argv: Sequence[str]) -> int:
    flags = parse_job_flags(slurm_parser(), argv)
    args, gpus, nproc = flags.args, flags.gpus, flags.nproc
    if args.signal_time is not None and args.signal_time < 1:
        raise ConfigError(f"--signal_time {args.signal_time}: seconds before the time limit, at least 1")
    cpus = args.cpus_per_task if args.cpus_per_task is not None else (8 if gpus else 1)
    if cpus < 1:
        raise ConfigError(f"--cpus_per_task {cpus}: at least 1")
    # sbatch refuses both (they are exclusive), and a CPU job has no GPU to size: each was dropped without a word.
    if args.mem and args.mem_per_gpu:
        raise ConfigError(
            f"--mem {args.mem} and --mem_per_gpu {args.mem_per_gpu}: SLURM takes one of them; give --mem (memory per "
            "node) or --mem_per_gpu (memory per GPU)"
        )
    if args.mem_per_gpu and not gpus:
        raise ConfigError(
            f"--mem_per_gpu {args.mem_per_gpu}: this job runs CPU ranks, with no GPU to size; give --mem, the "
            "memory per node"
        )
    requeue = not args.no_requeue
    job, cfg = checked_job(flags, Path(args.chdir or Path.cwd()).resolve(), restarts=requeue or args.max_restarts > 0)
    out = Path(args.output)
    grace = cfg.distributed.shutdown_timeout_s
    signal_time = args.signal_time if args.signal_time is not None else grace + scripts.SIGNAL_MARGIN_S
    limit_s = slurm_time_seconds(args.time_limit)
    if requeue and 0 < limit_s <= signal_time:  # SLURM reads a time limit of 0 as none
        # SLURM would send the warning as the job starts: it saves and requeues at once, again and again.
        raise ConfigError(
            f"--time_limit {args.time_limit} is {limit_s} s, but the job saves and requeues {signal_time} s before "
            f"its limit (--signal_time, by default distributed.shutdown_timeout_s {grace} + "
            f"{scripts.SIGNAL_MARGIN_S}): it would requeue itself as soon as it starts. Give a longer --time_limit "
            "(HH:MM:SS; a lone number is minutes), a smaller --signal_time or shutdown_timeout_s, or --no_requeue."
        )
    if requeue and signal_time < grace:
        print(
            f"warning: --signal_time {signal_time}: SLURM ends the job {signal_time} s after its warning, sooner "
            f"than the {grace} s distributed.shutdown_timeout_s gives the ranks to save; a save that takes that "
            "long is cut off. Raise --signal_time or lower shutdown_timeout_s.",
            file=sys.stderr,
        )
    spec = SlurmSpec(
        job,
        master_port=args.master_port or DEFAULT_PORT,
        fixed_port=args.master_port is not None,
        job_name=args.job_name,
        time_limit=args.time_limit,
        partition=args.partition,
        account=args.account,
        cpus_per_rank=cpus,
        mem_per_gpu=args.mem_per_gpu or (MEM_PER_GPU if gpus else None),
        mem=args.mem,
        log=args.log,
        signal_time=signal_time,
        requeue=requeue,
        setup=args.setup,
        output_dir=cfg.output_dir,
    )
    try:
        text = scripts.render_slurm(spec, out)
    except ValueError as exc:  # a value sbatch cannot take in a directive
        raise ConfigError(f"phalanx slurm: {exc}") from None
    (outcome,) = write_generated_files(same_but_for_the_command({out: text}), args.overwrite, f"--output {out}", True)
    kind = f"{gpus} GPU(s)" if gpus else f"{nproc} CPU rank(s)"
    print(
        f"wrote {out}{' (unchanged)' if outcome == 'unchanged' else ''}: {args.num_nodes} node(s) x {kind}, "
        f"time limit {args.time_limit}" + (f", saves and requeues {signal_time} s before it." if requeue else ".")
    )
    print(f"submit it with: sbatch {out}")
    return 0


# --- phalanx env ---------------------------------------------------------------------------------


def env_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="phalanx env",
        description="Print versions, devices, backends and the rendezvous/NCCL/gloo "
        "environment; on several ranks, check an all-reduce across them and report bus bandwidth.",
    )
    p.add_argument("--world_size", type=int, default=1, help="start this many local ranks and check across them")
    p.add_argument("--sizes_mb", default="0.25,1,4,16", help="all-reduce sizes in MiB, comma-separated")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces per size")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--timeout", type=float, default=120, help="seconds to wait for the other ranks before giving up")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    return p


def env_main(argv: Sequence[str]) -> int:
    from phalanx.launch.envcheck import env
    from phalanx.runtime.dist import launched_by_torchrun

    args = env_parser().parse_args(list(argv))
    try:
        sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(
            f"--sizes_mb {args.sizes_mb!r}: give sizes in MiB separated by commas, e.g. 1,16,64"
        ) from None
    if not sizes or any(s <= 0 for s in sizes) or args.iters < 1 or args.world_size < 1 or args.timeout <= 0:
        raise ConfigError("phalanx env: --sizes_mb, --iters, --world_size and --timeout must be positive")
    if args.world_size > 1 and not launched_by_torchrun():
        from phalanx.launch.local import launch_local

        rest = list(argv)
        i = rest.index("--world_size") if "--world_size" in rest else None
        rest = [a for j, a in enumerate(rest) if i is None or j not in (i, i + 1)]
        rest = [a for a in rest if not a.startswith("--world_size=")]
        return launch_local(["env", *rest], args.world_size) or 0
    return env(sizes, args.iters, args.backend, args.timeout, args.json)


# --- phalanx config ------------------------------------------------------------------------------
