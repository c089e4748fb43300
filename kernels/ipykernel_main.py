"""A kernel process's entry point: ipykernel's own launcher, without the debugger's import.

Run as ``python -m kernels.ipykernel_main -f CONNECTION_FILE [IPKernelApp options...]`` (what
:class:`kernels.kernel.Kernel` launches instead of ``-m ipykernel_launcher``; the options are
ipykernel's, unchanged).

ipykernel imports ``debugpy`` in every kernel it starts, to serve the Debug Adapter Protocol
on the control channel. Nothing drives these kernels that way: the host runs cells through
``jupyter_client`` and never sends a ``debug_request``. Here ``debugpy`` is made unimportable
before ipykernel loads (a ``None`` entry in ``sys.modules`` makes ``import debugpy`` raise
``ImportError``, which ipykernel treats as "debugpy is not installed": its kernel then reports
``"debugger": false`` in its ``kernel_info`` reply). Once the kernel object exists the block
is lifted, so a cell (or a library it uses) can still ``import debugpy``. Measured here:
70-100 ms less per cold start, out of about 0.4 s.

Standard library only before ipykernel: like ``ipykernel_launcher``, the first ``sys.path``
entry (the kernel's working directory) is left out while ipykernel loads; IPython puts the
working directory back for the cells.
"""
import sys
from pathlib import Path


def main() -> None:
    """Start the kernel as ``ipykernel.kernelapp.launch_new_instance`` does (the application's
    ``initialize`` with this process's arguments, then ``start``); returns when it exits.
    Raises SystemExit as ipykernel does (bad options, a connection file it cannot read)."""
    if sys.path and (sys.path[0] == "" or Path(sys.path[0]) == Path.cwd()):
        del sys.path[0]
    sys.modules["debugpy"] = None  # type: ignore[assignment] - an import of it fails
    from ipykernel.kernelapp import IPKernelApp
    app = IPKernelApp.instance()
    init_kernel = app.init_kernel

    def init_kernel_then_unblock() -> None:
        # the kernel object, which asks for the debugger, exists now: from here on (the start-up
        # code, the cells) ``import debugpy`` imports it as usual
        try:
            init_kernel()
        finally:
            if "debugpy" in sys.modules and sys.modules["debugpy"] is None:
                del sys.modules["debugpy"]
    app.init_kernel = init_kernel_then_unblock
    app.initialize()
    app.start()


if __name__ == "__main__":
    main()
