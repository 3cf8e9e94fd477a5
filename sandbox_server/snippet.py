"""Run one model-written snippet the way `execute_python_code_with_standard_io` promises (SPEC section 2).

Runs inside the forked, already confined call process: the source executes as `__main__`, a bare final expression's
value is printed (as IPython does), uncaught exceptions print a traceback of the snippet's own frames and give exit
code 1, and `sys.exit` behaves as in a script. Returns the exit code instead of exiting, so it is testable in-process.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import sys
import threading
import traceback

SNIPPET_FILENAME = "<code>"
MEMORY_ERROR_EXIT_CODE = 137  # the code a process killed for memory reports in a shell (128 + SIGKILL)


def compile_snippet(source: str) -> tuple[object, object | None]:
    """Compile `source` into (body, final_expression); the second is None unless the last statement is an expression."""
    tree = ast.parse(source, SNIPPET_FILENAME, "exec")
    final = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        final = ast.Expression(tree.body.pop().value)
    body = compile(tree, SNIPPET_FILENAME, "exec")
    return body, None if final is None else compile(final, SNIPPET_FILENAME, "eval")


def _exit_code_of(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_traceback(exc: BaseException) -> None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != SNIPPET_FILENAME:
        tb = tb.tb_next  # hide this module's frames; the model only wrote the snippet
    exc.__traceback__ = tb
    sys.stderr.write("".join(traceback.format_exception(exc)))


def _join_non_daemon_threads() -> None:
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()


def run_snippet(source: str) -> int:
    """Execute `source` as a script in a fresh `__main__` namespace; return its exit code."""
    linecache.cache[SNIPPET_FILENAME] = (len(source), None, source.splitlines(True), SNIPPET_FILENAME)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exit_code = 0
    try:
        body, final = compile_snippet(source)
        exec(body, namespace)
        if final is not None:
            value = eval(final, namespace)
            if value is not None:
                print(repr(value))
        _join_non_daemon_threads()
    except SystemExit as exc:
        exit_code = _exit_code_of(exc)
    except MemoryError as exc:
        _print_traceback(exc)
        exit_code = MEMORY_ERROR_EXIT_CODE
    except BaseException as exc:  # noqa: BLE001 - any uncaught exception is the snippet's error, as in a script
        _print_traceback(exc)
        exit_code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return exit_code
