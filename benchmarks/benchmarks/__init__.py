"""asv benchmark suites for cuflash (see ../asv.conf.json).

asv's "existing" environment runs them in the current interpreter without installing the project,
so a checkout whose cuflash is not installed is found through the repository root.
"""

import os
import sys

try:
    import cuflash  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
