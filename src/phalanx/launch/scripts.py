"""Write the scripts that start training: a torchrun / DeepSpeed launcher per node, a Windows .bat, an sbatch job.

Each renderer is a pure function from a spec to text, so tests can read what a user would
get and then run it. A launcher spec and a SLURM spec hold the same Job (ranks, launcher,
training command), and both scripts check each node with the same preflight block. The
scripts are meant to be read: every non-obvious line says why. Values are baked in at
generation time and can be overridden through environment variables when the script runs,
so one script serves small experiments too.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DEFAULT_PORT = 29500
DEFAULT_RDZV_TIMEOUT = 600  # seconds a node waits for the others before it gives up, with a message
MEM_PER_GPU = "32G"  # `phalanx slurm --mem_per_gpu` on GPU nodes when neither it nor --mem is given
SIGNAL_MARGIN_S = 60  # SLURM's warning comes this long before the ranks' shutdown grace would run out at the time limit


@dataclass
class Job:
    """The run every node takes part in, whether a launcher script or SLURM starts it: ranks, launcher, training."""

    config: Optional[str]  # path as the scripts should use it (relative to project_dir, or absolute)
    python: str
    project_dir: Path  # absolute; the scripts cd here so relative paths in the config resolve
    num_gpus_per_node: int
    nproc_per_node: int
    num_nodes: int = 1
    use_deepspeed: bool = False
    max_restarts: int = 0
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT
    shutdown_timeout: int = 300  # distributed.shutdown_timeout_s: torchrun's grace between SIGTERM and SIGKILL
    train_args: list[str] = field(default_factory=list)
    command_line: str = ""
    # `phalanx generate` flags the launcher script runs first, on the same ranks (seed 001's run_distributed.sh ran
    # generate_data.py, then train_loop.py); None: the script only trains.
    generate_args: Optional[list[str]] = None

    @property
    def cpu(self) -> bool:
        return self.num_gpus_per_node == 0

    @property
    def rank_kind(self) -> str:
        return "CPU rank(s) over gloo" if self.cpu else "GPU rank(s), one per GPU"


@dataclass
class LaunchSpec:
    """What one node needs to start its share of the ranks: the job, and where this node stands in it."""

    job: Job
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT


@dataclass
class SlurmSpec:
    """An sbatch job: one torchrun per node through srun, c10d rendezvous on the first node."""

    job: Job
    master_port: int = DEFAULT_PORT
    job_name: str = "llm_finetune"
    time_limit: str = "24:00:00"
    partition: Optional[str] = None
    account: Optional[str] = None
    cpus_per_rank: int = 8
    mem_per_gpu: Optional[str] = MEM_PER_GPU
    mem: Optional[str] = None
    log: str = "slurm-%j.out"
    signal_time: int = 300 + SIGNAL_MARGIN_S
    requeue: bool = True
    setup: list[str] = field(default_factory=list)
    output_dir: str = "./phalanx-output"
    fixed_port: bool = False  # False: derive the port from the job id so jobs sharing a node do not collide


def q(value: object) -> str:
    return shlex.quote(str(value))


def relative_dir(script: Path, project_dir: Path) -> str:
    """The project folder as seen from the script's folder, so the pair can move together."""
    return os.path.relpath(project_dir, script.resolve().parent)


def _train_words(job: Job, module_flag: str = "-m") -> str:
    """`-m phalanx train CONFIG FLAGS...` as the script passes it to the launcher (DeepSpeed's spells it --module)."""
    words = [module_flag, "phalanx", "train"]
    if job.config:
        words.append(q(job.config))
    words += [q(a) for a in job.train_args]
    return " ".join(words)


def generate_lines(job: Job) -> list[str]:
    """Bash that generates the training data before the training starts (`phalanx launcher --generate`)."""
    if job.generate_args is None:
        return []
    words = " ".join(q(a) for a in job.generate_args)
    return [
        "# Seed 001's run_distributed.sh: first the training data, generated on the same ranks (`phalanx generate`,",
        "# sharded over them). A rerun continues the shards already written, and a finished generation only merges",
        "# again. torchrun --standalone takes a free port of this node for it. A status other than 0 ends the script",
        "# here (75: stopped by a signal, a rerun continues; 2: bad input).",
        '"$PYTHON" -m phalanx.launch.torchrun --standalone --nproc_per_node "$NPROC_PER_NODE" --max_restarts "$MAX_RESTARTS" \\',
        f"    -m phalanx generate {words}",
        "",
    ]


def preflight_lines(num_gpus_per_node: int, nproc: str, node_rank: str) -> list[str]:
    """Bash that checks this node before its launcher starts and sets NET_IFNAME and LOCAL_ADDR; a failed check
    stops the script with preflight's status. No single quotes: SLURM embeds it in a quoted string."""
    return [
        "# Fail fast with a clear message where torch would wait: too few GPUs, a master address that is",
        "# not this machine or cannot be reached, a port already taken. Prints the interface and address",
        "# this node uses to reach the master.",
        f'NET=$("$PYTHON" -m phalanx.launch.preflight --num_gpus_per_node {num_gpus_per_node} --nproc_per_node {nproc} \\',
        f'    --num_nodes "$NUM_NODES" --node_rank {node_rank} --master_addr "$MASTER_ADDR" \\',
        '    --master_port "$MASTER_PORT" --timeout "$RDZV_TIMEOUT") || exit',
        'read -r NET_IFNAME LOCAL_ADDR <<< "$NET"',
        'if [ "$NUM_NODES" -gt 1 ] && [ "$NET_IFNAME" != "-" ]; then',
        "    # The host name may resolve to 127.0.0.1; gloo must advertise the address the other nodes can reach.",
        '    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NET_IFNAME}"',
        "fi",
    ]


def deepspeed_lines(node_rank: str, nproc: str, cpu: bool) -> list[str]:
    """Bash that sets DS=(...), the DeepSpeed launcher's arguments for this node (no single quotes: SLURM
    embeds it in a quoted string)."""
    lines = []
    if cpu:
        lines += [
            "# CPU ranks under the DeepSpeed launcher: the CPU accelerator of DeepSpeed (chosen here, not guessed),",
            "# which talks over gloo unless the oneCCL bindings of Intel are installed. The launcher counts the ranks",
            "# as GPUs (--num_gpus N) and gives them CUDA_VISIBLE_DEVICES=0..N-1; --backend gloo keeps them on the CPU.",
            "export DS_ACCELERATOR=cpu",
        ]
    return lines + [
        "# The DeepSpeed launcher sets RANK, LOCAL_RANK, WORLD_SIZE; phalanx also reads LOCAL_WORLD_SIZE.",
        f"export LOCAL_WORLD_SIZE={nproc}",
        'if [ "$NUM_NODES" -gt 1 ]; then',
        "    # --no_ssh: every node starts its own launcher. Its hostfile only says how many ranks each node runs",
        "    # (the names are placeholders); node_rank picks this node. It uses GPUs 0..N-1 of each node.",
        '    DS_HOSTFILE=$(mktemp "${TMPDIR:-/tmp}/phalanx-hostfile.XXXXXX")',
        f'    for i in $(seq 0 $((NUM_NODES - 1))); do echo "node$i slots={nproc}"; done > "$DS_HOSTFILE"',
        f'    DS=(--hostfile "$DS_HOSTFILE" --no_ssh --node_rank {node_rank} --num_nodes "$NUM_NODES" --num_gpus {nproc}',
        '        --master_addr "$MASTER_ADDR")',
        "else",
        f"    DS=(--num_gpus {nproc})",
        "fi",
        "# --no_local_rank: phalanx reads LOCAL_RANK from the environment, not from a --local_rank argument.",
        "# The launcher restarts nothing: a rank that fails stops the others (use torchrun for --max_restarts).",
    ]


# No single quotes: SLURM embeds them in a quoted string.
DEEPSPEED_STATUS_LINES = [
    "# The DeepSpeed launcher (its own flags) runs under phalanx.launch.deepspeed_launcher so that the status says",
    "# what the ranks did: 75 when a SIGTERM, SIGUSR1 or Ctrl-C made them save and stop (a requeue resumes), 130 after",
    "# a second Ctrl-C, 1 naming the rank that failed, 2 for bad input, 0 when done. After a SIGTERM, or once a rank",
    "# has exited, DeepSpeed gives the other ranks 30 s (its own grace, fixed) before it kills them.",
]


def render_launcher_sh(spec: LaunchSpec, script: Path) -> str:
    """A bash script for node `spec.node_rank`: preflight checks, then torchrun (or the DeepSpeed launcher)."""
    job = spec.job
    rel = relative_dir(script, job.project_dir)
    nodes_word = f"node {spec.node_rank} of {job.num_nodes}" if job.num_nodes > 1 else "a single node"
    lines = [
        "#!/usr/bin/env bash",
        f"# Starts phalanx training on {nodes_word}: {job.nproc_per_node} {job.rank_kind} per node"
        + (" (DeepSpeed launcher)." if job.use_deepspeed else " (torchrun)."),
        f"# Written by: {job.command_line}" if job.command_line else "# Written by phalanx launcher.",
        "#",
        f"# Run:   bash {script.name}                  as configured",
        f"#        bash {script.name} 4                4 processes on this node (like seed 000's launch_distributed.sh 4)",
        f"#        bash {script.name} --max_steps 10   extra --flag value pairs go to `phalanx train`",
        "# Without regenerating, override with PHALANX_ + PYTHON, NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,",
        "# NPROC_PER_NODE, MAX_RESTARTS or RDZV_TIMEOUT (seconds a node waits for the others), e.g. PHALANX_NODE_RANK=1"
        + ("." if job.use_deepspeed else ";"),
        *([] if job.use_deepspeed else ["# SHUTDOWN_TIMEOUT: seconds the ranks get to save after a SIGTERM."]),
        "set -euo pipefail",
        "",
        "# The project folder: relative paths in the config resolve from here.",
        f'cd "$(dirname "${{BASH_SOURCE[0]}}")"/{q(rel)}',
        "",
        f'PYTHON="${{PHALANX_PYTHON:-{job.python}}}"',
        f'NUM_NODES="${{PHALANX_NUM_NODES:-{job.num_nodes}}}"',
        f'NODE_RANK="${{PHALANX_NODE_RANK:-{spec.node_rank}}}"',
        f'MASTER_ADDR="${{PHALANX_MASTER_ADDR:-{spec.master_addr}}}"',
        f'MASTER_PORT="${{PHALANX_MASTER_PORT:-{spec.master_port}}}"',
        f'NPROC_PER_NODE="${{PHALANX_NPROC_PER_NODE:-{job.nproc_per_node}}}"',
        f'MAX_RESTARTS="${{PHALANX_MAX_RESTARTS:-{job.max_restarts}}}"',
        f'RDZV_TIMEOUT="${{PHALANX_RDZV_TIMEOUT:-{job.rdzv_timeout}}}"',
        *(
            [f'SHUTDOWN_TIMEOUT="${{PHALANX_SHUTDOWN_TIMEOUT:-{job.shutdown_timeout}}}"']
            if not job.use_deepspeed
            else []
        ),
        'if [[ "${1:-}" =~ ^[0-9]+$ ]]; then NPROC_PER_NODE="$1"; shift; fi',
        "# Any other bare word first would reach `phalanx train` as a stray argument after the flags written here.",
        'if [[ -n "${1:-}" && "$1" != -* ]]; then',
        '    echo "error: $(basename "$0"): the first argument is the number of ranks on this node (e.g. 2) or a'
        " --flag for phalanx train; got '$1'\" >&2",
        "    exit 2",
        "fi",
        "",
    ]
    if job.cpu:
        lines += [
            "# CPU ranks: no GPU is used even where one is visible, and gloo carries the gradients.",
            'export CUDA_VISIBLE_DEVICES=""',
            "TRAIN_BACKEND=(--backend gloo)",
        ]
    else:
        lines += ["TRAIN_BACKEND=()"]
    lines += [
        "",
        *preflight_lines(job.num_gpus_per_node, '"$NPROC_PER_NODE"', '"$NODE_RANK"'),
        'echo "phalanx: node $NODE_RANK of $NUM_NODES, $NPROC_PER_NODE rank(s), master $MASTER_ADDR:$MASTER_PORT'
        ' reached from $LOCAL_ADDR ($NET_IFNAME)" >&2',
        "",
    ]
    lines += generate_lines(job)
    if job.use_deepspeed:
        lines += deepspeed_lines('"$NODE_RANK"', "$NPROC_PER_NODE", job.cpu) + [
            *DEEPSPEED_STATUS_LINES,
            'exec "$PYTHON" -m phalanx.launch.deepspeed_launcher "${DS[@]}" --master_port "$MASTER_PORT" --no_local_rank '
            f"{_train_words(job, '--module')} \\",
            '    "${TRAIN_BACKEND[@]}" "$@"',
        ]
        return "\n".join(lines) + "\n"
    lines += [
        'if [ "$MAX_RESTARTS" -gt 0 ]; then',
        "    # Elastic: a failed rank restarts every rank of every node, through a c10d rendezvous that node 0",
        "    # hosts. Each attempt gets a fresh store: torch's shared one can hand restarted ranks the",
        "    # previous attempt's addresses. Global ranks then follow the rendezvous order, not NODE_RANK.",
        "    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        '    IS_HOST=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)',
        '    RDZV=(--rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "phalanx-$MASTER_PORT"',
        '          --rdzv_conf "is_host=$IS_HOST,join_timeout=$RDZV_TIMEOUT" --local_addr "$LOCAL_ADDR"',
        '          --max_restarts "$MAX_RESTARTS" --monitor_interval 1)',
        "else",
        "    # Static rendezvous: node NODE_RANK runs global ranks NODE_RANK*NPROC_PER_NODE onwards; node 0 holds the store.",
        '    RDZV=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"',
        '          --rdzv_conf "timeout=$RDZV_TIMEOUT")',
        "fi",
        "",
        *SHUTDOWN_LINES,
        "# torchrun starts NPROC_PER_NODE ranks of `phalanx train` here, through phalanx.launch.torchrun (torchrun's",
        "# own flags) so that the status says what the ranks did: 75 when a SIGTERM, SIGUSR1 or Ctrl-C made them save",
        "# and stop (a requeue resumes), 130 after a second Ctrl-C, 1 naming the rank that crashed, 2 with the bad",
        "# input they found (a rerun repeats it), 0 when done.",
        'exec "$PYTHON" -m phalanx.launch.torchrun --nnodes "$NUM_NODES" --nproc_per_node "$NPROC_PER_NODE" "${RDZV[@]}" \\',
        f'    {_train_words(job)} "${{TRAIN_BACKEND[@]}}" "$@"',
    ]
    return "\n".join(lines) + "\n"


def render_launcher_bat(spec: LaunchSpec, script: Path) -> str:
    """A single-node Windows launcher (seed 002 ships launch_distributed_hub.bat N)."""
    job = spec.job
    rel = relative_dir(script, job.project_dir).replace("/", "\\")
    python = job.python if os.name == "nt" else "python"
    config = (
        (job.config or "").replace("/", "\\") if job.config and not os.path.isabs(job.config) else (job.config or "")
    )
    train = ["-m", "phalanx", "train"] + ([f'"{config}"'] if config else []) + [_bat_word(a) for a in job.train_args]
    lines = [
        "@echo off",
        f"REM Starts phalanx training on this Windows machine: {job.nproc_per_node} rank(s) over gloo (torchrun).",
        f"REM Written by: {job.command_line}" if job.command_line else "REM Written by phalanx launcher.",
        f"REM Run:   {script.stem}.bat                  as configured",
        f"REM        {script.stem}.bat 2                2 processes (like seed 002's launch_distributed_hub.bat 2)",
        f"REM        {script.stem}.bat --max_steps 10   extra --flag value pairs go to `phalanx train`",
        "REM Single node only: multi-node runs use the .sh scripts on Linux. Override PHALANX_PYTHON to pick Python.",
        "setlocal",
        "REM The project folder: relative paths in the config resolve from here.",
        f'cd /d "%~dp0{rel}"',
        f'if "%PHALANX_PYTHON%"=="" (set "PYTHON={python}") else (set "PYTHON=%PHALANX_PYTHON%")',
        f"set NPROC_PER_NODE={job.nproc_per_node}",
        "REM torch on Windows has neither NCCL nor the libuv TCP store: gloo ranks and the classic store.",
        "set USE_LIBUV=0",
        "REM A first argument made only of digits is the number of processes.",
        'set "FIRSTARG=%~1"',
        'set "NOTNUMBER="',
        'for /f "delims=0123456789" %%c in ("%FIRSTARG%") do set "NOTNUMBER=1"',
        'if not "%FIRSTARG%"=="" if not defined NOTNUMBER (set "NPROC_PER_NODE=%FIRSTARG%" & shift)',
        'set "ARGS="',
        ":collect",
        'if "%~1"=="" goto run',
        "set ARGS=%ARGS% %1",
        "shift",
        "goto collect",
        ":run",
        *(
            [
                "REM First the training data (seed 001's run_distributed.sh), on the same ranks; a rerun continues it.",
                '"%PYTHON%" -m torch.distributed.run --standalone --nnodes 1 --nproc_per_node %NPROC_PER_NODE% '
                + " ".join(["-m", "phalanx", "generate", *map(_bat_word, job.generate_args)]),
                "if errorlevel 1 exit /b %ERRORLEVEL%",
            ]
            if job.generate_args is not None
            else []
        ),
        '"%PYTHON%" -m torch.distributed.run --standalone --nnodes 1 --nproc_per_node %NPROC_PER_NODE% '
        + " ".join(train)
        + " --backend gloo %ARGS%",
        "exit /b %ERRORLEVEL%",
    ]
    return "\r\n".join(lines) + "\r\n"


def _bat_word(arg: str) -> str:
    return f'"{arg}"' if any(c in arg for c in ' &|<>^%"') else arg


SHUTDOWN_LINES = [
    "# After a SIGTERM, torchrun gives the ranks this long to save a checkpoint before it kills them (torch's",
    "# default is 30 s; distributed.shutdown_timeout_s). A torch too old to know this variable keeps 30 s.",
    'export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$SHUTDOWN_TIMEOUT"',
]

SLURM_NCCL = [
    "# NCCL: report errors instead of hanging, say what went wrong, and keep off loopback and docker",
    "# bridges. Each can be overridden from the submitting shell (sbatch passes the environment on).",
    "export CUDA_DEVICE_MAX_CONNECTIONS=1",
    "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
    'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"',
    'export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"',
    'export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"',
]


def directive_value(value: object) -> str:
    """A value as an `#SBATCH` line takes it: sbatch splits a directive at blank space, so one that holds any (a
    project folder named "proj a", a job name "my job") goes in double quotes, which sbatch reads as one value."""
    text = str(value)
    if '"' in text or "\n" in text:
        raise ValueError(f"{text!r}: an #SBATCH value cannot hold a double quote or a line break")
    return f'"{text}"' if any(c.isspace() for c in text) else text


def render_slurm(spec: SlurmSpec, script: Path) -> str:
    """An sbatch script like seed 003's, with one launcher per node and preemption handled."""
    job = spec.job
    ranks = job.nproc_per_node
    q = directive_value
    sbatch = [
        f"#SBATCH --job-name={q(spec.job_name)}",
        f"#SBATCH --nodes={job.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if not job.cpu:
        sbatch.append(f"#SBATCH --gres=gpu:{job.num_gpus_per_node}")
    sbatch.append(f"#SBATCH --cpus-per-task={spec.cpus_per_rank * ranks}")
    if spec.mem:
        sbatch.append(f"#SBATCH --mem={spec.mem}")
    elif spec.mem_per_gpu and not job.cpu:
        sbatch.append(f"#SBATCH --mem-per-gpu={spec.mem_per_gpu}")
    sbatch.append(f"#SBATCH --time={spec.time_limit}")
    if spec.partition:
        sbatch.append(f"#SBATCH --partition={q(spec.partition)}")
    if spec.account:
        sbatch.append(f"#SBATCH --account={q(spec.account)}")
    sbatch += [
        f"#SBATCH --output={q(spec.log)}",
        f"#SBATCH --error={q(spec.log)}",
        f"#SBATCH --chdir={q(job.project_dir)}",
    ]
    if spec.requeue:
        sbatch += [
            f"#SBATCH --signal=B:USR1@{spec.signal_time}",
            "#SBATCH --requeue",
            "#SBATCH --open-mode=append",
        ]
    launcher_name = "the DeepSpeed launcher" if job.use_deepspeed else "torchrun"
    lines = [
        "#!/bin/bash",
        f"# phalanx training on {job.num_nodes} node(s) x {ranks} {job.rank_kind}; submit with: sbatch {script.name}",
        f"# Written by: {job.command_line}" if job.command_line else "# Written by phalanx slurm.",
        f"# One task per node (--ntasks-per-node=1): that task is {launcher_name}, and it starts the node's ranks.",
        f"# --cpus-per-task is {spec.cpus_per_rank} CPU(s) for each of the {ranks} rank(s) of a node.",
        *(
            [
                f"# {spec.signal_time} s before the time limit SLURM sends USR1 to this script: it asks the ranks to save",
                "# a checkpoint and stop, then requeues the job, which resumes from that checkpoint when it starts again.",
            ]
            if spec.requeue
            else []
        ),
        f"# Extra --flag value pairs after the script name go to `phalanx train`: sbatch {script.name} --max_steps 100",
        *sbatch,
        "",
        "set -uo pipefail",
        "# Run with bash instead of sbatch, it would fail on the first SLURM variable, after scontrol's own errors.",
        'if [ -z "${SLURM_JOB_ID:-}" ]; then',
        f'    echo "error: $(basename "$0") is a SLURM batch script: submit it with sbatch {script.name} (on one'
        ' machine without SLURM, phalanx launcher writes a script to run with bash)" >&2',
        "    exit 2",
        "fi",
        "",
    ]
    if spec.setup:
        # Without `set -u`: seed 003's `source activate llm_finetuning` (conda's activate and activate.d scripts, some
        # `module` versions) reads variables a batch shell never set (PS1, ...), and under -u the job ended there.
        lines += ["# Environment set-up (--setup), as the seed's script ran it: unset variables allowed", "set +u"]
        lines += [*spec.setup, "set -u", ""]
    lines += [
        f'PYTHON="${{PHALANX_PYTHON:-{job.python}}}"',
        f'OUTPUT_DIR="${{PHALANX_OUTPUT_DIR:-{spec.output_dir}}}"',
        f'RDZV_TIMEOUT="${{PHALANX_RDZV_TIMEOUT:-{job.rdzv_timeout}}}"',
        *(
            [f'SHUTDOWN_TIMEOUT="${{PHALANX_SHUTDOWN_TIMEOUT:-{job.shutdown_timeout}}}"', *SHUTDOWN_LINES]
            if not job.use_deepspeed
            else []
        ),
        f"export OMP_NUM_THREADS={spec.cpus_per_rank}",
        "",
        *SLURM_NCCL,
    ]
    if job.cpu:
        lines += [
            "# CPU ranks: no GPU is used even where one is visible, and gloo carries the gradients.",
            'export CUDA_VISIBLE_DEVICES=""',
        ]
    port = (
        f'MASTER_PORT="${{PHALANX_MASTER_PORT:-{spec.master_port}}}"'
        if spec.fixed_port
        else 'MASTER_PORT="${PHALANX_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"  # per job: jobs sharing a node do not collide'
    )
    lines += [
        "",
        "# The first node of the allocation hosts the c10d rendezvous (its address as SLURM knows it).",
        'MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_ADDR=$(scontrol show node \"$MASTER_NODE\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)",
        'export MASTER_ADDR="${MASTER_ADDR:-$MASTER_NODE}"',
        f"export {port}",
        'export NUM_NODES="$SLURM_JOB_NUM_NODES" RDZV_TIMEOUT PYTHON',
        "# Each elastic attempt gets a fresh store (torch's shared one can hand restarted ranks stale addresses).",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        'echo "phalanx: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST,'
        ' master $MASTER_ADDR:$MASTER_PORT, $(date -u +%FT%TZ)"',
        "",
    ]
    if spec.requeue:
        if job.max_restarts:
            # torchrun would restart ranks that stop to save (they exit 75), so stop torchrun itself; it passes
            # SIGTERM on to the ranks and gives them SHUTDOWN_TIMEOUT seconds before it kills them.
            stop = [
                "    # torchrun restarts ranks that stop (--max_restarts); SIGTERM stops torchrun and, through it, the ranks.",
                '    scancel --signal=TERM "$SLURM_JOB_ID"',
            ]
        else:
            stop = (
                [
                    "    # Steps only (not this script): every process of the steps gets it; torchrun ignores it (below),",
                    "    # so the ranks take the time they need to save, then exit and end the step.",
                ]
                if not job.use_deepspeed
                else [
                    "    # Steps only (not this script): every process of the steps gets it; the DeepSpeed launcher passes it",
                    "    # on too (a rank takes it once), so the ranks take the time they need to save, then exit and end the step.",
                ]
            ) + ['    scancel --signal=USR1 "$SLURM_JOB_ID"']
        lines += [
            "PREEMPTED=0",
            "on_usr1() {",
            "    PREEMPTED=1",
            '    echo "phalanx: time limit near: asking the ranks to save a checkpoint and stop, $(date -u +%FT%TZ)"',
            *stop,
            "}",
            "trap on_usr1 USR1",
            "",
        ]
    # Per node: preflight (devices, port on the master, master reachable), then the launcher.
    step = [
        "# Runs once per node. torchrun ignores USR1 so that the ranks (which save on it) decide when to stop."
        if not job.use_deepspeed
        else "# Runs once per node; USR1 is ignored until the DeepSpeed launcher below takes it and passes it on.",
        'STEP=\'trap "" USR1',
        *preflight_lines(job.num_gpus_per_node, str(ranks), '"$SLURM_NODEID"'),
        'echo "phalanx: node $SLURM_NODEID of $NUM_NODES ($(hostname)), master $MASTER_ADDR:$MASTER_PORT reached from $LOCAL_ADDR ($NET_IFNAME)"',
        'IS_HOST=$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0)',
    ]
    if job.use_deepspeed:
        step += deepspeed_lines('"$SLURM_NODEID"', str(ranks), job.cpu) + [
            *DEEPSPEED_STATUS_LINES,
            'exec "$PYTHON" -m phalanx.launch.deepspeed_launcher "${DS[@]}" --master_port "$MASTER_PORT" --no_local_rank \\',
            '    --module phalanx train "$@"\'',
        ]
    else:
        step += [
            'exec "$PYTHON" -m torch.distributed.run --nnodes "$NUM_NODES" --nproc_per_node ' + str(ranks) + " \\",
            '    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "phalanx-$SLURM_JOB_ID" \\',
            '    --rdzv_conf "is_host=$IS_HOST,join_timeout=$RDZV_TIMEOUT" --local_addr "$LOCAL_ADDR" \\',
            f'    --max_restarts {job.max_restarts} --monitor_interval 1 -m phalanx train "$@"\'',
        ]
    train_args = ([q(job.config)] if job.config else []) + [q(a) for a in job.train_args]
    train_args += ['--output_dir "$OUTPUT_DIR"']
    if job.cpu:
        train_args.append("--backend gloo")
    lines += step + [
        "",
        "# srun starts one step task per node; --kill-on-bad-exit stops every node when one fails.",
        'srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$STEP" phalanx-step \\',
        f'    {" ".join(train_args)} "$@" &',
        "SRUN_PID=$!",
        "# wait returns early when a signal is trapped; keep waiting until srun itself has ended.",
        'while true; do wait "$SRUN_PID"; RC=$?; kill -0 "$SRUN_PID" 2>/dev/null || break; done',
        'echo "phalanx: training step ended with exit code $RC, $(date -u +%FT%TZ)"',
    ]
    if spec.requeue:
        lines += [
            'if [ "$PREEMPTED" = 1 ] && [ ! -f "$OUTPUT_DIR/final_training_info.json" ]; then',
            "    # phalanx train resumes from the newest committed checkpoint in OUTPUT_DIR when the config is unchanged.",
            '    echo "phalanx: requeueing job $SLURM_JOB_ID; it resumes from the newest checkpoint"',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "    exit 0",
            "fi",
        ]
    lines += [
        "# To diagnose a hang, check every rank can talk to every other first (versions, devices, bus bandwidth):",
        '#   srun --ntasks-per-node=1 bash -c \'exec "$PYTHON" -m torch.distributed.run --nnodes "$NUM_NODES" '
        f'--nproc_per_node {ranks} --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" -m phalanx env\'',
        'exit "$RC"',
    ]
    return "\n".join(lines) + "\n"


def results_folder_of(generated: Path) -> Path:
    """Where seed 001's train_loop.py saved its checkpoints, beside the data it trained on: data/traj_chat.jsonl ->
    data/results/traj_chat/."""
    return generated.parent / "results" / generated.stem
