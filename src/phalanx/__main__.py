"""`python -m phalanx` is the `phalanx` command (what torchrun and the launcher start on each rank)."""

import sys

from phalanx import cli

sys.exit(cli.main())
