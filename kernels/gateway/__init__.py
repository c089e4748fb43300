"""Kernels on a Jupyter gateway (Jupyter Kernel Gateway or Enterprise Gateway).

:mod:`~kernels.gateway.client` speaks the gateway's REST and WebSocket API;
:mod:`~kernels.gateway.kernel` is the host's :class:`GatewayKernel`; the bridge rides the
kernel's stdin channel (:mod:`~kernels.gateway.courier` in the kernel,
:mod:`~kernels.gateway.serve` on the host; the processes a cell starts reach it through
:mod:`~kernels.gateway.relay`), contexts, one file or many, are pulled by hash
(:mod:`~kernels.gateway.fetch`), and :mod:`~kernels.gateway.kernelspec` installs the sandboxed
kernelspec on the gateway host. See docs/remote-kernels.md.
"""

#: The kernelspec a gateway host installs (:mod:`kernels.gateway.kernelspec`) and gateway
#: kernels start unless told otherwise (``--gateway-kernelspec``).
DEFAULT_KERNELSPEC = "rlm"
