"""`python -m api`: the same as the `fp4serve` command."""

import sys

from api.cli import main

sys.exit(main())
