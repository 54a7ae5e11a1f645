"""The ``shardckpt`` command line (also ``python -m shardckpt``).

Looking at checkpoints, on either tier (a local directory or a remote URL)::

    shardckpt ls SRC [--json]                       committed steps: size, world size, live or abandoned
    shardckpt inspect SRC [--step N] [--keys] [--values] [--json]   one step's manifest (saved keys, plain values)
    shardckpt verify SRC [--step N | --all] [--json]     check every file against its manifest
    shardckpt export SRC OUT [--step N] [--format torch|safetensors] [--optimizer]
    shardckpt gc SRC --keep-last N [--keep-every K] [--keep-abandoned] [--dry-run]
    shardckpt status DIR [--json]                   the node's uploader, peer and memory tiers
    shardckpt adopt DCP_DIR --into DIR --step N     commit a copy of a stock DCP checkpoint
    shardckpt check-resume [--steps N] [--kill-after STEP] -- COMMAND   a script resumes exactly? (check_resume/run.py)
    shardckpt diff A [B] [--step N] [--step M] [--json]   two steps, key by key (check_resume/diff.py)

Moving steps between tiers::

    shardckpt sync --local DIR --remote URL         the per-node uploader (sidecar / by hand)
    shardckpt push --local DIR --remote URL [--step N]   upload now; check and repair the remote copy
    shardckpt pull --remote URL --local DIR [--step N]   fetch; check and repair the local copy

Exit status: 0 all good; 1 what was asked about is bad or absent (a file
fails verification, nothing is committed, a step is not committed remotely
yet); 2 the command could not run (bad arguments, no such directory, the
remote unreachable). Errors are one line with the remedy; ``--debug`` adds
the traceback. ``ls``, ``inspect`` (without ``--keys`` / ``--values``), ``verify``, ``gc``,
``status``, ``sync``, ``push``, ``pull`` and ``check-resume`` do not import torch.
"""


from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from shardckpt.cli.common import BAD, ERROR, OK, Problem, open_location  # noqa: F401 - open_location: for the tests
from shardckpt.cli.parser import build_parser
from shardckpt.errors import ShardckptError
from shardckpt.stores import redact


def _setup_logging() -> None:
    """The library's INFO lines (progress of long transfers, what was repaired) go to stderr."""
    logger = logging.getLogger("shardckpt")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(os.environ.get("SHARDCKPT_LOG_LEVEL", "INFO").upper())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "keep_last", None) is not None and args.keep_last < 1:
        parser.error("--keep-last must be >= 1")
    _setup_logging()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("shardckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shardckpt ls DIR | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except Exception as exc:  # noqa: BLE001 - one readable line, the traceback with --debug
        if args.debug:
            raise
        return _report(exc)


def _report(exc: BaseException) -> int:
    code = BAD if isinstance(exc, Problem) else ERROR
    text = redact(str(exc)) if isinstance(exc, ShardckptError) else redact(f"{type(exc).__name__}: {exc}")
    hint = "" if isinstance(exc, ShardckptError) else " (run with --debug for the traceback)"
    print(f"shardckpt: error: {text}{hint}", file=sys.stderr)
    return code

