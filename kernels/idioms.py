"""Idioms a model writes from habit, made to work inside a Jupyter kernel.

Imported inside every kernel by :mod:`kernels.runtime` (standard library only). A kernel's cell
already runs inside an event loop (ipykernel's own, on the main thread), so the idiom of every
asyncio script, ``asyncio.run(main())``, raises "cannot be called from a running event loop".
:func:`install` replaces ``asyncio.run`` with :func:`run`, which behaves as before wherever no
loop runs and, where one does, runs the coroutine to its end on a fresh event loop in a thread of
its own and waits for it (an interrupt of the cell cancels the coroutine). Top-level ``await``
works as it always does in a kernel.

What cannot be made to work is reported by the host with a hint (:mod:`kernels.outputs`):
``loop.run_until_complete`` on the kernel's running loop, and functions defined in a cell sent
to a ``spawn`` or ``forkserver`` process, which cannot import the cell.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

#: Marks the replacement, so a re-import does not wrap it twice.
_MARK = "_rlm_kernel_run"

# the standard function itself (``asyncio.run`` is the name replaced), also after a reload
_real_run = asyncio.runners.run


def run(main: Any, *, debug: bool | None = None, **kwargs: Any) -> Any:
    """``asyncio.run(main)``, in a kernel too: returns the coroutine's value or raises its
    exception.

    Where no event loop runs in this thread this is the standard ``asyncio.run``. Where one
    runs (a cell of the kernel), ``main`` runs on a new event loop in a new thread, and this
    thread waits; KeyboardInterrupt (the cell's interrupt or timeout) cancels ``main`` and is
    raised here.

    Raises:
        ValueError: ``main`` is not a coroutine (as ``asyncio.run``).
    """
    if asyncio.events._get_running_loop() is None:
        return _real_run(main, debug=debug, **kwargs)
    if not asyncio.iscoroutine(main):
        raise ValueError(f"a coroutine was expected, got {main!r}")
    return _run_beside(main, debug, kwargs)


def _run_beside(main: Any, debug: bool | None, kwargs: dict) -> Any:
    """``main`` run to its end by the standard ``asyncio.run`` on a thread of its own."""
    box: dict[str, Any] = {}

    async def tracked() -> Any:
        box["loop"], box["task"] = asyncio.get_running_loop(), asyncio.current_task()
        return await main

    def target() -> None:
        try:
            box["value"] = _real_run(tracked(), debug=debug, **kwargs)
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    worker = threading.Thread(target=target, name="asyncio.run", daemon=True)
    worker.start()
    try:
        worker.join()
    except KeyboardInterrupt:
        loop, task = box.get("loop"), box.get("task")
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed meanwhile
                pass
        worker.join(1.0)
        raise
    if "error" in box:
        raise box["error"]
    return box.get("value")


setattr(run, _MARK, True)


def install() -> None:
    """Put :func:`run` in place of ``asyncio.run`` (once; never raises)."""
    if not getattr(asyncio.run, _MARK, False):
        asyncio.run = run


def called_with_literal() -> bool:
    """True if the ``FINAL_VAR`` call in its caller's source line has a quoted argument
    (``FINAL_VAR("answer")``, the habit of naming the variable): called by ``FINAL_VAR`` itself,
    it reads the line two frames up; an unknown call site counts as quoted (the strict answer)."""
    import inspect
    import linecache
    import re
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame and frame.f_back else None
        if caller is None:
            return True
        line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    finally:
        del frame
    m = re.search(r"FINAL_VAR\s*\(\s*([^)]*)", line or "")
    if not m:
        return True  # unknown call site: be strict
    return m.group(1).lstrip()[:1] in ("'", '"')
