"""``python -m shardckpt ...``: the same command line as ``shardckpt ...``."""

import sys

from .cli import main

sys.exit(main())
