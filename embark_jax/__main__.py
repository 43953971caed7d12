"""`python -m embark_jax <command>` (see `embark_jax.cli.main`)."""

import sys

from embark_jax.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
