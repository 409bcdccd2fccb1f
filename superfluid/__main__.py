"""`python -m superfluid`: the same as the `superfluid` command."""

import sys

from superfluid.cli.main import main

sys.exit(main())
