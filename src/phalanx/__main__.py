"""`python -m phalanx` is the `phalanx` command (what torchrun and the launcher start on each rank)."""

import sys

from phalanx.cli import main

sys.exit(main())
