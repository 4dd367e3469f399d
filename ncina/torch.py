"""``import ncina.torch`` registers ``ncina`` as a ``torch.distributed`` backend (docs/pytorch.md).

PyTorch also calls :func:`register` at ``import torch`` through the ``torch.backends`` entry point
of this package (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off), so a script needs no import
of its own: ``dist.init_process_group("ncina")`` is enough. The backend itself is
:mod:`ncina.worker.torch_backend`, imported only when a group is made, so that registering costs
``import torch`` nothing.
"""

from __future__ import annotations

from typing import Any

NAME = "ncina"


def _create(backend_options: Any, options: Any) -> Any:
    from ncina.worker.torch_backend import create

    return create(backend_options, options)


def register() -> None:
    """Register the ``ncina`` backend with ``torch.distributed`` (once; later calls do nothing)."""
    import torch.distributed as dist

    if not dist.is_available() or NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


register()
