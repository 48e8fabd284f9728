"""Optional packages: a `phalanx` process that quantizes nothing leaves bitsandbytes out; a library caller keeps it.

QLoRA itself, in CLI processes where bitsandbytes is loaded, is tests/test_cli_qlora.py and test_quantized.py."""

import subprocess
import sys

from helpers import phalanx_env, tiny_run

PROBE = """
import sys
from phalanx.models import packages
packages.command_owns_process()  # what cli.main does in the `phalanx` program
from phalanx.cli import run_command
code = run_command(["train", "--output_dir", sys.argv[2], *sys.argv[3:]])
import peft, transformers.utils
loaded = sys.modules.get("bitsandbytes", "never imported")
print(code, "hidden" if loaded is None else "loaded" if loaded != "never imported" else loaded,
      peft.import_utils.is_bnb_available(), transformers.utils.is_bitsandbytes_available(),
      "deepspeed hidden" if sys.modules.get("deepspeed", "absent") is None else "deepspeed loaded")
"""


def probe(tmp_path, mode: str) -> str:
    flags = tiny_run({"max_steps": 1})
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(tmp_path / mode), *flags],
        capture_output=True,
        text=True,
        env=phalanx_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_run_without_a_4bit_base_leaves_bitsandbytes_out_of_its_process(tmp_path):
    """About a second per rank: bitsandbytes compiles kernels with torch.compile as it imports, and peft imports it
    whenever it is installed. The run trains as without it installed; peft and transformers both see it absent."""
    assert probe(tmp_path, "program") == "0 hidden False False deepspeed hidden"  # a DDP run: no DeepSpeed either


def test_a_library_caller_keeps_bitsandbytes_for_a_later_qlora_run(monkeypatch):
    """Only the `phalanx` program decides for its process (cli.main): in a script that calls phalanx (this test
    process is one) and may quantize later, bitsandbytes stays as installed."""
    import sys

    from phalanx.models import packages

    for name in ("bitsandbytes", "peft", "transformers", "accelerate"):  # as before anything imported them (restored)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(packages, "_COMMAND_OWNS_PROCESS", False)
    packages.leave_out_bitsandbytes()
    assert "bitsandbytes" not in sys.modules  # nothing hidden: an import finds it
    monkeypatch.setattr(packages, "_COMMAND_OWNS_PROCESS", True)  # the program, by contrast
    try:
        packages.leave_out_bitsandbytes()
        assert sys.modules["bitsandbytes"] is None
    finally:
        del sys.modules["bitsandbytes"]  # this process's later QLoRA tests import it (monkeypatch restores the rest)
