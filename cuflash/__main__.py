"""``python -m cuflash``: the command line (cuflash.cli.main)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
