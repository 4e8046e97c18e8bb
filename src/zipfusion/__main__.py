"""``python -m zipfusion`` = the ``zipfusion`` command."""

import sys

from .cli import main

sys.exit(main())
