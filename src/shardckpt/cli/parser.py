"""The ``shardckpt`` argument parser: global options, then each command family's own parsers."""

from __future__ import annotations

import argparse

from shardckpt._version import __version__
from shardckpt.check_resume import diff as diff_cmd
from shardckpt.check_resume import run as check_resume
from shardckpt.cli import looking, moving


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt",
        description="Look at, verify, export, clean up and move shardckpt checkpoints, on a local directory or "
        "a remote (S3 or any fsspec URL). A step exists once its manifest (shardckpt.json) does; anything "
        "else in a checkpoint directory is ignored.",
        epilog="Exit status: 0 all good, 1 what was asked about is bad or absent, 2 the command could not run. "
        "`shardckpt COMMAND --help` explains each command.",
    )
    parser.add_argument("--version", action="version", version=f"shardckpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = sub.add_parser
    sub.add_parser = lambda *a, **kw: add_parser(*a, parents=[common], **kw)  # type: ignore[method-assign]

    looking.add_parsers(sub)
    moving.add_parsers(sub)
    check_resume.add_parser(sub)
    diff_cmd.add_parser(sub)
    return parser
