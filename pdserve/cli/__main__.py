"""``python -m pdserve.cli``: the ``pdserve`` command (how the launcher and the tests start processes)."""

import sys

from pdserve.cli import main

sys.exit(main())
