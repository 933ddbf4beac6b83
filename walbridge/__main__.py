"""``python -m walbridge``: the same as the ``walbridge`` command."""

import sys

from walbridge.cli import main

sys.exit(main())
