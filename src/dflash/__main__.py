"""`python -m dflash ...` (and `torchrun --nproc-per-node N -m dflash train ...`) is the `dflash` command."""

import sys

from .cli import main

sys.exit(main())
