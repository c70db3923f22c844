"""`python -m prefixrt.cli ...`: the `prefixrt` command."""

import sys

from prefixrt.cli import main

sys.exit(main())
