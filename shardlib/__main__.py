"""``python -m shardlib`` is the ``shardlib`` command."""

import sys

from shardlib.cli import main

sys.exit(main())
