"""What `phalanx launcher` and `phalanx slurm` write, and what they refuse (fast: no training runs here).

The scripts themselves are executed in test_launcher_run.py, test_multinode.py and test_slurm.py.
The Windows .bat cannot run on this Linux machine, so its content is checked line by line here.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from phalanx.cli import main


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def in_project(project, monkeypatch):
    monkeypatch.chdir(project)
    return project


def bash_syntax_ok(path: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr


def test_launcher_single_node_writes_sh_and_bat(in_project, capsys, tmp_path):
    code, out, err = cli(
        capsys,
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--output",
        str(tmp_path / "gen" / "run.sh"),
        "--",
        "--max_steps",
        "3",
    )
    assert code == 0, err
    sh, bat = tmp_path / "gen" / "run.sh", tmp_path / "gen" / "run.bat"
    assert "bash" in out and str(bat) in out
    assert sh.stat().st_mode & 0o111, "the script is executable"
    bash_syntax_ok(sh)
    text = sh.read_text()
    assert "-m phalanx.launch.torchrun" in text and "-m phalanx train train.yaml --max_steps 3" in text
    assert 'NPROC_PER_NODE="${PHALANX_NPROC_PER_NODE:-2}"' in text and "--backend gloo" in text
    assert 'export CUDA_VISIBLE_DEVICES=""' in text, "CPU ranks never touch a GPU"
    assert "phalanx.launch.preflight" in text
    # The script finds the project folder relative to itself, so the two can move together.
    assert f'cd "$(dirname "${{BASH_SOURCE[0]}}")"/{os.path.relpath(in_project, sh.parent)}\n' in text
    raw = bat.read_bytes()
    assert raw.count(b"\r\n") == raw.count(b"\n"), "a .bat uses CRLF line ends"
    lines = raw.decode().splitlines()
    assert lines[0] == "@echo off"
    assert "set NPROC_PER_NODE=2" in lines and "set USE_LIBUV=0" in lines
    run = [line for line in lines if "torch.distributed.run" in line]
    assert len(run) == 1
    assert "--standalone --nnodes 1 --nproc_per_node %NPROC_PER_NODE%" in run[0]
    assert '-m phalanx train "train.yaml" --max_steps 3 --backend gloo %ARGS%' in run[0]
    assert any(line.startswith('cd /d "%~dp0') for line in lines), "runs from the project folder wherever it is"
    assert any("delims=0123456789" in line for line in lines), "a numeric first argument sets the process count"
    assert lines[-1] == "exit /b %ERRORLEVEL%"


def test_launcher_generate_runs_generation_first_and_trains_on_its_file(in_project, capsys, tmp_path):
    """Seed 001's run_distributed.sh: generate_data.py, then train_loop.py. A config with no dataset trains on the file
    the generation writes (and evaluates on its validation file); the .bat does the same. Executed in
    test_launcher_run.py."""
    (in_project / "nodata.yaml").write_text("training:\n  max_steps: 2\n")
    flags = "--num_questions 8 --batch_size 4 --val_fraction 0.25"
    code, out, err = cli(
        capsys, "launcher", "--config", "nodata.yaml", "--num_gpus_per_node", "0", "--nproc_per_node", "2",
        "--generate", flags, "--output", str(tmp_path / "seed001.sh"),
    )  # fmt: skip
    assert code == 0, err
    # Seed 001's layout: train_loop.py saved its checkpoints in data/results/traj_chat/, beside the data.
    assert f"it generates first: phalanx generate {flags}; then it trains, into data/results/traj_chat." in out
    sh = tmp_path / "seed001.sh"
    bash_syntax_ok(sh)
    text = sh.read_text()
    generate_line = '"$PYTHON" -m phalanx.launch.torchrun --standalone --nproc_per_node "$NPROC_PER_NODE"'
    assert text.index(generate_line) < text.index("-m phalanx train"), "the data first"
    assert f"    -m phalanx generate {flags}\n" in text
    train = (
        "-m phalanx train nodata.yaml --output_dir data/results/traj_chat --dataset_path data/traj_chat.jsonl "
        "--eval_dataset_path data/traj_val.jsonl"
    )
    assert train in text
    # An output_dir the config or the flags name is the run's.
    for config, extra in (
        ("training:\n  max_steps: 2\noutput_dir: runs/mine\n", []),
        (None, ["--output_dir", "runs/mine"]),
    ):
        if config:
            (in_project / "nodata.yaml").write_text(config)
        code, out, err = cli(
            capsys, "launcher", "--config", "nodata.yaml", "--num_gpus_per_node", "0", "--nproc_per_node", "2",
            "--generate", flags, "--output", str(tmp_path / "mine.sh"), "--overwrite", "--", *extra,
        )  # fmt: skip
        assert code == 0 and "then it trains, into runs/mine." in out, err
        assert "data/results" not in (tmp_path / "mine.sh").read_text()
    bat = (tmp_path / "seed001.bat").read_bytes().decode().splitlines()
    run = [line for line in bat if "torch.distributed.run" in line]
    assert len(run) == 2 and f"-m phalanx generate {flags}" in run[0] and "-m phalanx train" in run[1]
    assert bat[bat.index(run[0]) + 1] == "if errorlevel 1 exit /b %ERRORLEVEL%"


@pytest.mark.parametrize(
    "generate_flags, extra, message",
    [
        (
            "--num_question 4",
            [],
            "--generate: phalanx generate: unrecognized arguments: --num_question 4. Did you mean",
        ),
        ("--num_questions 4 --world_size 2", [], "--generate: --world_size is the script's to set"),
        ("--top_p 2", [], "--generate: --top_p must be in (0, 1]"),
        ("--num_questions 'x", [], "No closing quotation; give phalanx generate's flags as one quoted string"),
        ("", ["--num_nodes", "2", "--master_addr", "10.0.0.1"], "--generate runs on one node"),
        # train.yaml trains on data/train.jsonl: the generated file would not be used
        ("", [], "--generate writes data/traj_chat.jsonl, but the run trains on data/train.jsonl (data.dataset_path)"),
    ],
)
def test_launcher_generate_refuses_what_would_not_run_or_not_be_used(
    in_project, capsys, generate_flags, extra, message
):
    code, _, err = cli(
        capsys, "launcher", "--config", "train.yaml", "--num_gpus_per_node", "0", *extra, "--generate", generate_flags,
        "--output", "scripts/refused.sh",
    )  # fmt: skip
    assert code == 2 and message in err, err
    assert not (in_project / "scripts" / "refused.sh").exists()


def test_launcher_multi_node_and_deepspeed(in_project, capsys, tmp_path):
    out_sh = tmp_path / "node1.sh"
    code, out, err = cli(
        capsys,
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "8",
        "--num_nodes",
        "4",
        "--node_rank",
        "1",
        "--master_addr",
        "192.168.1.100",
        "--master_port",
        "29500",
        "--use_deepspeed",
        "--output",
        str(out_sh),
    )
    assert code == 0, err
    assert not out_sh.with_suffix(".bat").exists(), "the .bat is for single-node runs"
    bash_syntax_ok(out_sh)
    text = out_sh.read_text()
    for expected in (
        'NUM_NODES="${PHALANX_NUM_NODES:-4}"',
        'NODE_RANK="${PHALANX_NODE_RANK:-1}"',
        'MASTER_ADDR="${PHALANX_MASTER_ADDR:-192.168.1.100}"',
        'NPROC_PER_NODE="${PHALANX_NPROC_PER_NODE:-8}"',
        "-m phalanx.launch.deepspeed_launcher",
        "--no_ssh",
        "--no_local_rank",
        "--module phalanx train train.yaml",
        "export LOCAL_WORLD_SIZE=$NPROC_PER_NODE",
        '--hostfile "$DS_HOSTFILE"',
        '--node_rank "$NODE_RANK"',
        "slots=$NPROC_PER_NODE",
    ):
        assert expected in text, expected
    assert "CUDA_VISIBLE_DEVICES" not in text and "DS_ACCELERATOR" not in text, "GPU nodes: DeepSpeed finds CUDA itself"
    assert "SHUTDOWN_TIMEOUT" not in text, "the DeepSpeed launcher's grace after SIGTERM is its own (30 s)"
    assert "note: the DeepSpeed launcher will start the ranks, but the config trains with strategy 'ddp'" in err


def test_launcher_for_a_second_node_in_a_shared_folder_names_the_first_nodes_script(
    project, capsys, tmp_path, monkeypatch
):
    """Seed 003's commands for node 0 and node 1, run as written in a project folder the nodes share, both write
    scripts/run_training.sh: the second was refused as a file that "holds something else", pointing at --overwrite,
    which would leave node 0 to run node 1's script."""
    # A copy of the project: the launched tier's reference run writes scripts/run_training.sh into the shared one.
    in_project = tmp_path / "shared"
    shutil.copytree(project, in_project, ignore=shutil.ignore_patterns("runs", "scripts", "*.sh", "*.bat"))
    monkeypatch.chdir(in_project)
    node = ["launcher", "--config", "train.yaml", "--num_nodes", "2", "--num_gpus_per_node", "8"]
    node += ["--master_addr", "192.168.1.100", "--master_port", "29500", "--node_rank"]
    assert cli(capsys, *node, "0")[0] == 0
    script = in_project / "scripts" / "run_training.sh"
    first = script.read_text()
    code, _, err = cli(capsys, *node, "1")
    assert code == 2
    assert "scripts/run_training.sh holds node_rank 0's script of this same job" in err
    assert "PHALANX_NODE_RANK=1 bash scripts/run_training.sh" in err and "--output scripts/node1.sh" in err
    assert script.read_text() == first
    # What the message offers is node 1's script: the same lines but for comments and the node rank it defaults to.
    assert cli(capsys, *node, "1", "--output", "scripts/node1.sh")[0] == 0
    second = (in_project / "scripts" / "node1.sh").read_text()
    differ = [(a, b) for a, b in zip(first.splitlines(), second.splitlines()) if a != b]
    assert len(first.splitlines()) == len(second.splitlines())
    code_lines = [(a, b) for a, b in differ if not a.startswith("#")]
    assert code_lines == [('NODE_RANK="${PHALANX_NODE_RANK:-0}"', 'NODE_RANK="${PHALANX_NODE_RANK:-1}"')], differ
    # Another job's script there is still the user's to keep or replace, as before.
    code, _, err = cli(capsys, *node, "1", "--master_port", "29600")
    assert code == 2 and "holds something else" in err


def test_the_same_command_spelled_another_way_leaves_the_scripts_unchanged(in_project, capsys):
    """`--num_gpus_per_node=0` and flags in another order write the same scripts: the rerun said they hold "something
    else". Only the "Written by" lines differ, and they are kept; another value is still refused."""
    first = ["launcher", "--config", "train.yaml", "--num_gpus_per_node", "0", "--nproc_per_node", "2"]
    assert cli(capsys, *first, "--output", "spelled.sh")[0] == 0
    sh, bat = in_project / "spelled.sh", in_project / "spelled.bat"
    written = sh.read_bytes(), bat.read_bytes()
    again = ["--nproc_per_node=2", "--output=spelled.sh", "--config=train.yaml", "--num_gpus_per_node=0"]
    code, out, err = cli(capsys, "launcher", *again)
    assert code == 0, err
    assert "wrote spelled.sh (unchanged), spelled.bat (unchanged)" in out
    assert (sh.read_bytes(), bat.read_bytes()) == written
    code, _, err = cli(capsys, "launcher", *again[1:], "--nproc_per_node=1")
    assert code == 2 and "holds something else" in err and (sh.read_bytes(), bat.read_bytes()) == written
    job = ["--config", "train.yaml", "--num_gpus_per_node", "0", "--nproc_per_node", "2", "--output", "spelled_job.sh"]
    assert cli(capsys, "slurm", *job)[0] == 0
    submitted = (in_project / "spelled_job.sh").read_bytes()
    code, out, err = cli(capsys, "slurm", *[f"{flag}={value}" for flag, value in zip(job[::2], job[1::2])])
    assert code == 0 and "wrote spelled_job.sh (unchanged)" in out, err
    assert (in_project / "spelled_job.sh").read_bytes() == submitted


def test_deepspeed_launcher_on_cpu_nodes(in_project, capsys, tmp_path):
    """CPU ranks under the DeepSpeed launcher (executed in test_launcher_run.py and test_slurm.py): its CPU
    accelerator, gloo, and no single quote in the SLURM step (it is one single-quoted string)."""
    sh, job = tmp_path / "ds.sh", tmp_path / "ds_job.sh"
    code, _, err = cli(
        capsys,
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--use_deepspeed",
        "--output",
        str(sh),
        "--",
        "--strategy",
        "deepspeed",
    )
    assert code == 0, err
    assert "note:" not in err, "the config trains with the DeepSpeed engine"
    code, _, err = cli(
        capsys,
        "slurm",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--num_nodes",
        "2",
        "--use_deepspeed",
        "--output",
        str(job),
    )
    assert code == 0, err
    for script in (sh, job):
        bash_syntax_ok(script)
        text = script.read_text()
        for expected in (
            "export DS_ACCELERATOR=cpu",
            'export CUDA_VISIBLE_DEVICES=""',
            "-m phalanx.launch.deepspeed_launcher",
            "--no_local_rank",
            "--module phalanx train",
            "--backend gloo",
        ):
            assert expected in text, (script.name, expected)
    step = job.read_text().split("STEP='", 1)[1].split("'\n", 1)[0]
    assert 'exec "$PYTHON" -m phalanx.launch.deepspeed_launcher' in step and "slots=2" in step


def test_launcher_elastic_uses_c10d_with_fresh_stores(in_project, capsys, tmp_path):
    code, _, err = cli(
        capsys,
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "3",
        "--output",
        str(tmp_path / "e.sh"),
    )
    assert code == 0, err
    text = (tmp_path / "e.sh").read_text()
    assert 'MAX_RESTARTS="${PHALANX_MAX_RESTARTS:-3}"' in text
    assert (
        "--rdzv_backend c10d" in text and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text and "is_host=$IS_HOST" in text
    )
    # torchrun's grace between SIGTERM and SIGKILL (torch's default 30 s) is distributed.shutdown_timeout_s.
    assert 'SHUTDOWN_TIMEOUT="${PHALANX_SHUTDOWN_TIMEOUT:-300}"' in text
    assert text.index('export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$SHUTDOWN_TIMEOUT"') < text.index(
        "-m phalanx.launch.torchrun"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--num_gpus_per_node", "0", "--num_nodes", "2", "--node_rank", "2", "--master_addr", "10.0.0.1"],
            "--node_rank 2 is outside 0..1",
        ),
        (["--num_gpus_per_node", "0", "--num_nodes", "2"], "needs --master_addr"),
        (["--num_gpus_per_node", "0", "--num_nodes", "2", "--master_addr", "127.0.0.1"], "loopback"),
        (["--num_gpus_per_node", "4", "--nproc_per_node", "2"], "one rank per GPU"),
        (
            ["--num_gpus_per_node", "2", "--use_deepspeed", "--max_restarts", "1"],
            "the DeepSpeed launcher does not restart ranks",
        ),
        (["--num_gpus_per_node", "-1"], "--num_gpus_per_node -1"),
        (
            ["--num_gpus_per_node", "0", "--master_port", "70000"],
            "argument --master_port: 70000 is not a TCP port; give 1..65535",
        ),
        (["--nproc_per_node", "2"], "--num_gpus_per_node"),
        (["--num_gpus_per_node", "0", "--config", "missing.yaml"], "missing.yaml: no such file"),
        (["--num_gpus_per_node", "0", "--config", "."], "--config .: a folder (expected a training YAML"),
        (
            ["--num_gpu_per_node", "2"],
            "required: --num_gpus_per_node. --num_gpu_per_node is not a flag of phalanx launcher: did you mean "
            "--num_gpus_per_node?",
        ),
        (["--num_gpus_per_node", "0", "--", "--max_stepz", "3"], "unknown flag --max_stepz. Did you mean 'max_steps'?"),
        (["--num_gpus_per_node", "0", "--", "--learning_rate", "-1"], "learning_rate"),
        (["--num_gpus_per_node", "0", "--bogus", "1"], "unrecognized arguments: --bogus"),
        # What the ranks would refuse, found while writing the script: precision CPU ranks cannot run, a DeepSpeed
        # JSON that contradicts the run (its "auto" values are filled; explicit ones must agree).
        (["--num_gpus_per_node", "0", "--", "--mixed_precision", "bf16"], "'bf16' needs a CUDA device"),
        (
            [
                "--num_gpus_per_node",
                "0",
                "--use_deepspeed",
                "--",
                "--strategy",
                "deepspeed",
                "--zero_stage",
                "2",
                "--deepspeed_config",
                "{stage3_json}",
            ],
            "zero_optimization.stage is 3 in the JSON but 2",
        ),
    ],
)
def test_launcher_refuses_bad_input_with_a_clear_message(in_project, capsys, tmp_path, args, message):
    stage3 = tmp_path / "ds_stage3.json"
    stage3.write_text('{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}')
    args = [a.replace("{stage3_json}", str(stage3)) for a in args]
    split = args.index("--") if "--" in args else len(args)  # flags after `--` go to `phalanx train`
    code, _, err = cli(capsys, "launcher", *args[:split], "--output", str(tmp_path / "x.sh"), *args[split:])
    assert code == 2
    assert message in err
    assert not (tmp_path / "x.sh").exists(), "nothing is written for bad input"


def test_slurm_directives_with_blank_space_are_one_value_to_sbatch(sbatch, project, capsys, tmp_path, monkeypatch):
    """A project folder "proj a", a job name "my job", a log folder "logs dir": sbatch splits an #SBATCH line at blank
    space (it refused "Invalid directive found in batch script: a"), so such values are quoted. Read back by sbatch's
    own parser (-vv prints the options it took; it then fails to reach a controller, which is not run here)."""
    import shutil

    spaced = tmp_path / "proj a"
    shutil.copytree(project, spaced)
    monkeypatch.chdir(spaced)
    script = spaced / "scripts" / "job.sh"
    flags = ("--num_gpus_per_node", "0", "--nproc_per_node", "2", "--job_name", "my job")
    code, _, err = cli(
        capsys, "slurm", "--config", "train.yaml", *flags, "--log", "logs dir/x-%j.out", "--output", str(script)
    )
    assert code == 0, err
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=2\nPartitionName=p Nodes=localhost\n"
    )
    parsed = subprocess.run(
        [sbatch, "-vv", str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "SLURM_CONF": str(conf)},
        timeout=60,
    ).stderr
    assert "Invalid directive" not in parsed, parsed
    said = {
        k.strip(): v.strip()
        for k, _, v in (line.removeprefix("sbatch: ").partition(":") for line in parsed.splitlines())
    }
    assert said["chdir"] == str(spaced) and said["job-name"] == "my job", parsed
    assert said["output"] == str(spaced / "logs dir" / "x-%j.out"), parsed


def test_slurm_script_like_seed_003(in_project, capsys, tmp_path):
    """The seed's example: 4 nodes x 8 GPUs, DeepSpeed, 48 hours; plus the preemption handling it lacked."""
    script = tmp_path / "slurm_job.sh"
    code, out, err = cli(
        capsys,
        "slurm",
        "--config",
        "train.yaml",
        "--num_nodes",
        "4",
        "--num_gpus_per_node",
        "8",
        "--use_deepspeed",
        "--time_limit",
        "48:00:00",
        "--partition",
        "gpu",
        "--account",
        "proj42",
        "--cpus_per_task",
        "8",
        "--mem_per_gpu",
        "32G",
        "--job_name",
        "llm_finetune",
        "--setup",
        "module load cuda/12.2",
        "--output",
        str(script),
    )
    assert code == 0, err
    assert f"sbatch {script}" in out
    bash_syntax_ok(script)
    text = script.read_text()
    for expected in (
        "#SBATCH --job-name=llm_finetune",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --mem-per-gpu=32G",
        "#SBATCH --time=48:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --signal=B:USR1@360",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={in_project}",
        "module load cuda/12.2",
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1',
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        'NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"',
        "NCCL_IB_DISABLE",
        "NCCL_DEBUG",
        "export OMP_NUM_THREADS=8",
        "-m phalanx.launch.deepspeed_launcher",
        "--no_ssh",
        '--node_rank "$SLURM_NODEID"',
        "slots=8",
        "scontrol requeue",
        'scancel --signal=USR1 "$SLURM_JOB_ID"',
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1",
        "that task is the DeepSpeed launcher, and it starts the node's ranks",
    ):
        assert expected in text, expected
    assert "torchrun" not in text.split("#SBATCH")[0], "the header names the launcher the job runs"
    # Every #SBATCH line comes before the first command, or sbatch ignores it.
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))


def test_slurm_setup_lines_run_as_the_seeds_script_ran_them(in_project, capsys, tmp_path):
    """Seed 003's job ran `source activate llm_finetuning`; conda's activate reads PS1, which a batch shell has not
    set, and the script's `set -u` ended the job on that line. A stand-in activate script that reads PS1 runs here
    (and then ends the script, as SLURM is not here to go on)."""
    (in_project / "activate").write_text('echo "env ${PS1}llm_finetuning" > activated.txt\nexit 0\n')
    script = tmp_path / "slurm_job.sh"
    code, _, err = cli(
        capsys, "slurm", "--config", "train.yaml", "--num_nodes", "1", "--num_gpus_per_node", "0",
        "--nproc_per_node", "1", "--setup", "source ./activate", "--output", str(script),
    )  # fmt: skip
    assert code == 0, err
    env = {k: v for k, v in os.environ.items() if k != "PS1"}
    run = subprocess.run(
        ["bash", str(script)], cwd=in_project, env={**env, "SLURM_JOB_ID": "7"}, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (in_project / "activated.txt").read_text() == "env llm_finetuning\n"
    lines = script.read_text().splitlines()
    assert lines[lines.index("source ./activate") + 1] == "set -u", "the rest of the script keeps its checks"


def test_slurm_cpu_nodes_request_no_gpus(in_project, capsys, tmp_path):
    script = tmp_path / "cpu.sh"
    code, _, err = cli(
        capsys,
        "slurm",
        "--config",
        "train.yaml",
        "--num_nodes",
        "2",
        "--num_gpus_per_node",
        "0",
        "--nproc_per_node",
        "4",
        "--cpus_per_task",
        "2",
        "--mem",
        "16G",
        "--max_restarts",
        "2",
        "--output",
        str(script),
    )
    assert code == 0, err
    text = script.read_text()
    assert "--gres" not in text and "--mem-per-gpu" not in text
    assert "#SBATCH --cpus-per-task=8" in text and "#SBATCH --mem=16G" in text
    assert "--nproc_per_node 4" in text and "--rdzv_backend c10d" in text and "--max_restarts 2" in text
    assert "--backend gloo" in text and 'export CUDA_VISIBLE_DEVICES=""' in text
    assert "that task is torchrun, and it starts the node's ranks" in text
    # With elastic restarts torchrun would restart ranks that stop to save; the job stops torchrun instead, which
    # gives the ranks distributed.shutdown_timeout_s to save; SLURM warns that long before the limit, plus a margin.
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in text
    assert 'SHUTDOWN_TIMEOUT="${PHALANX_SHUTDOWN_TIMEOUT:-300}"' in text and "#SBATCH --signal=B:USR1@360" in text
    assert text.index('export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$SHUTDOWN_TIMEOUT"') < text.index(
        "srun --ntasks-per-node=1"
    )
    code, _, err = cli(
        capsys,
        "slurm",
        "--config",
        "train.yaml",
        "--num_nodes",
        "2",
        "--num_gpus_per_node",
        "0",
        "--output",
        str(script),
        "--overwrite",  # the same script with other flags: replaced on purpose
        "--",
        "--shutdown_timeout_s",
        "900",
    )
    assert (
        code == 0
        and "#SBATCH --signal=B:USR1@960" in script.read_text()
        and "PHALANX_SHUTDOWN_TIMEOUT:-900" in script.read_text()
    )
    code, _, err = cli(
        capsys,
        "slurm",
        "--config",
        "train.yaml",
        "--num_nodes",
        "2",
        "--num_gpus_per_node",
        "0",
        "--signal_time",
        "120",
        "--output",
        str(script),
        "--overwrite",  # the same script with other flags: replaced on purpose
    )
    assert code == 0 and "#SBATCH --signal=B:USR1@120" in script.read_text()
    assert "warning: --signal_time 120: SLURM ends the job 120 s after its warning, sooner than the 300 s" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_gpus_per_node", "8", "--time_limit", "48h"], "--time_limit '48h' is not a SLURM time"),
        (["--num_gpus_per_node", "8", "--signal_time", "0"], "--signal_time 0"),
        (["--num_gpus_per_node", "0", "--cpus_per_task", "0"], "--cpus_per_task 0"),
        (
            ["--num_gpus_per_node", "0", "--master_port", "0"],
            "argument --master_port: 0 is not a TCP port; give 1..65535",
        ),
        (["--num_nodes", "2"], "--num_gpus_per_node"),
        # 5 minutes, warned 360 s before the limit: SLURM would signal at start, and the job requeue itself forever.
        (
            ["--num_gpus_per_node", "8", "--time_limit", "5"],
            "--time_limit 5 is 300 s, but the job saves and requeues 360 s before its limit",
        ),
        (["--num_gpus_per_node", "8", "--time_limit", "0:30", "--signal_time", "30"], "--time_limit 0:30 is 30 s"),
        # SLURM reads a bare number as megabytes: 32 MB per GPU was meant as the seed's 32G.
        (["--num_gpus_per_node", "8", "--mem_per_gpu", "32"], "--mem_per_gpu 32: SLURM reads a number without a unit"),
        (["--num_gpus_per_node", "0", "--mem", "64"], "write 64G for gigabytes, or 64M if megabytes are meant"),
        (["--num_gpus_per_node", "0", "--mem", "64GB"], "--mem '64GB' is not a SLURM memory size; accepted:"),
        # sbatch takes one of them (and a CPU job has no GPU to size): the other was dropped without a word.
        (
            ["--num_gpus_per_node", "8", "--mem", "512G", "--mem_per_gpu", "64G"],
            "--mem 512G and --mem_per_gpu 64G: SLURM takes one of them",
        ),
        (["--num_gpus_per_node", "0", "--mem_per_gpu", "64G"], "--mem_per_gpu 64G: this job runs CPU ranks"),
    ],
)
def test_slurm_refuses_bad_input(in_project, capsys, tmp_path, args, message):
    code, _, err = cli(capsys, "slurm", "--config", "train.yaml", *args, "--output", str(tmp_path / "x.sh"))
    assert code == 2 and message in err
    assert not (tmp_path / "x.sh").exists()


def test_slurm_accepts_every_slurm_time_format_and_memory_size(in_project, capsys, tmp_path):
    from phalanx.launch.command import slurm_time_seconds

    seconds = {"7": 420, "30": 1800, "30:00": 1800, "48:00:00": 172800, "2-12": 216000, "2-12:30": 217800}
    assert {value: slurm_time_seconds(value) for value in seconds} == seconds
    assert slurm_time_seconds("2-12:30:05") == 217805 and slurm_time_seconds("0") == 0
    for value in ("30", "30:00", "48:00:00", "2-12", "2-12:30", "2-12:30:00", "0"):
        code, _, err = cli(
            capsys,
            "slurm",
            "--num_gpus_per_node",
            "1",
            "--time_limit",
            value,
            "--output",
            str(tmp_path / f"t{value}.sh"),
        )
        assert code == 0, (value, err)
        assert f"#SBATCH --time={value}" in (tmp_path / f"t{value}.sh").read_text()
    for value in ("32G", "4096", "512M", "1T"):
        code, _, err = cli(
            capsys,
            "slurm",
            "--num_gpus_per_node",
            "1",
            "--mem_per_gpu",
            value,
            "--output",
            str(tmp_path / f"m{value}.sh"),
        )
        assert code == 0 and f"#SBATCH --mem-per-gpu={value}" in (tmp_path / f"m{value}.sh").read_text(), (value, err)


def test_restarts_that_would_start_over_are_pointed_out(in_project, capsys, tmp_path):
    """configs/demo.yaml sets overwrite_output_dir: a requeued job would train from the start again."""
    code, _, err = cli(
        capsys,
        "slurm",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--output",
        str(tmp_path / "s.sh"),
        "--",
        "--overwrite_output_dir",
        "true",
    )
    assert code == 0 and "a restarted or requeued run starts over" in err
    code, _, err = cli(
        capsys,
        "launcher",
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--output",
        str(tmp_path / "l.sh"),
        "--",
        "--overwrite_output_dir",
        "true",
    )
    assert code == 0 and "starts over" not in err, "no restarts, nothing to warn about"


@pytest.mark.parametrize("command", ["launcher", "slurm"])
def test_hybrid_shard_needs_several_nodes(command, in_project, capsys, tmp_path):
    """HYBRID_SHARD shards within a node and replicates across nodes: refused for one node, written for two."""
    hybrid = ["--", "--strategy", "fsdp", "--sharding_strategy", "HYBRID_SHARD"]
    nodes2 = ["--num_nodes", "2"] + (["--master_addr", "10.0.0.1"] if command == "launcher" else [])
    code, _, err = cli(
        capsys,
        command,
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        "--output",
        str(tmp_path / "one.sh"),
        *hybrid,
    )
    assert code == 2 and "this job runs on one node. Use FULL_SHARD" in err
    assert not (tmp_path / "one.sh").exists()
    code, _, err = cli(
        capsys,
        command,
        "--config",
        "train.yaml",
        "--num_gpus_per_node",
        "0",
        *nodes2,
        "--output",
        str(tmp_path / "two.sh"),
        *hybrid,
    )
    assert code == 0, err
    assert "HYBRID_SHARD" in (tmp_path / "two.sh").read_text()


def test_slurm_checks_relative_paths_from_the_folder_the_job_runs_in(in_project, capsys, tmp_path):
    """With --chdir the ranks read a relative --chat_template from that folder: it is checked there, not here."""
    job_dir = tmp_path / "job"
    (job_dir / "data").mkdir(parents=True)
    # the config's data/train.jsonl is read from there too (a job folder without it is refused when written)
    (job_dir / "data" / "train.jsonl").write_bytes((in_project / "data" / "train.jsonl").read_bytes())
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (job_dir / "mine.jinja").write_text(template)
    (in_project / "only_here.jinja").write_text(template)
    config = str(in_project / "train.yaml")
    common = ["slurm", "--config", config, "--num_gpus_per_node", "0", "--chdir", str(job_dir)]
    code, _, err = cli(capsys, *common, "--output", str(tmp_path / "a.sh"), "--", "--chat_template", "mine.jinja")
    assert code == 0, err
    assert "--chat_template mine.jinja" in (tmp_path / "a.sh").read_text()
    code, _, err = cli(capsys, *common, "--output", str(tmp_path / "b.sh"), "--", "--chat_template", "only_here.jinja")
    assert code == 2 and "data.chat_template" in err and "only_here.jinja" in err, err
    assert f"relative paths were read from {job_dir}" in err, err
    assert not (tmp_path / "b.sh").exists() and Path.cwd() == in_project
