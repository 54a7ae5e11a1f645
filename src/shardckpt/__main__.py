"""``python -m shardckpt ...``: the same command line as ``shardckpt ...``."""

import sys

from shardckpt.cli import main

sys.exit(main())
