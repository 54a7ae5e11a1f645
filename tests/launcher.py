"""torchrun for the tests: its own ``main``, in a process forked from the test's, or a new interpreter.

A launcher started as ``python -m torch.distributed.run`` spends about 1.4 s of CPU importing torch before it
does anything; the suite starts about a hundred of them on two cores. The test process has torch imported
already, so :func:`popen` forks it and the child runs ``torch.distributed.run.main`` with the same arguments:
the same agent, rendezvous, restarts, signal handling and exit status as the command. Only the launcher is
forked: it starts its workers as torchrun does, each a new interpreter running the program.

The child first undoes what it inherited from the test process that a new interpreter would not have: file
descriptors (only 0, 1 and 2 stay, as the caller set them), signal handlers and mask, exit hooks, the test
runner's logging handlers, warning filters and exception hooks, the environment and the working directory.

``SHARDCKPT_TEST_EXEC_TORCHRUN=1`` starts every launcher as the command instead (a new interpreter).
"""

from __future__ import annotations

import atexit
import faulthandler
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
import warnings
from typing import Any

EXEC_ENV = "SHARDCKPT_TEST_EXEC_TORCHRUN"
MODULE = "torch.distributed.run"


def popen(cmd: list[str], **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kw)``; a ``python -m torch.distributed.run ...`` command is forked instead."""
    if list(cmd[:3]) == [sys.executable, "-m", MODULE] and os.environ.get(EXEC_ENV) != "1":
        import torch.distributed.run  # noqa: F401 - imported here once, so that no child imports it again

        return ForkedTorchrun(cmd, **kw)
    return subprocess.Popen(cmd, **kw)


def run(cmd: list[str], *, timeout: float | None = None, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)`` over :func:`popen` (on a timeout the launcher is killed, as there)."""
    with popen(cmd, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class ForkedTorchrun(subprocess.Popen):
    """A ``Popen`` whose child is this process forked, running torchrun's ``main`` on ``args[3:]``."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        argv = [str(a) for a in args][3:]
        environ = {str(k): str(v) for k, v in (os.environ if env is None else env).items()}
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed capture stream: nothing of ours in it
                pass
        pid = os.fork()
        if pid == 0:
            _child(argv, cwd, environ, p2cread, c2pwrite, errwrite, start_new_session)  # never returns
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _child(argv: list[str], cwd: Any, environ: dict[str, str], stdin: int, stdout: int, stderr: int,
           new_session: bool) -> None:
    code = 1
    try:
        if new_session:
            os.setsid()
        if stdin == -1:
            stdin = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            if fd != -1 and fd != target:
                os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        _fresh_interpreter_state()
        if cwd is not None:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        from torch.distributed import run

        sys.argv = [run.__file__, *argv]
        try:
            run.main(argv)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except KeyboardInterrupt:
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)  # as the interpreter ends on an uncaught KeyboardInterrupt
        except BaseException:  # noqa: BLE001 - reported as the interpreter reports an uncaught exception
            sys.excepthook(*sys.exc_info())
    except BaseException:  # noqa: BLE001 - the child never returns into the test's code
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what torchrun registered (the test process's hooks were cleared)
        except BaseException:  # noqa: BLE001 - reported by the hook itself; the exit status stays
            pass
        _flush()
        os._exit(code)


def _fresh_interpreter_state() -> None:
    """What a new interpreter starts with, where the test process changed it."""
    atexit._clear()  # the test runner's exit hooks are not this process's
    faulthandler.disable()
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for ignored in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(ignored, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.set_wakeup_fd(-1)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True,
                                                  write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                                  write_through=True, errors="backslashreplace")
    sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    warnings.resetwarnings()
    for action, category, module in (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
                                     ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
                                     ("ignore", ResourceWarning, None)):
        warnings.filterwarnings(action, category=category, module=module or "", append=True)
    warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]
    warnings._showwarnmsg = warnings._showwarnmsg_impl  # type: ignore[attr-defined]
    loggers = [logging.root, *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
            elif isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.stream = sys.stderr  # torch's handlers hold the stderr of the test process's import
    logging.root.setLevel(logging.WARNING)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing more can be said
            pass
