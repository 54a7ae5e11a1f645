"""``python -m shardckpt.cli``: the ``shardckpt`` command, as ``python -m shardckpt`` runs it."""

import sys

from shardckpt.cli import main

sys.exit(main())
