"""Section decoders by device type: the seam through which GPU decode plugs into the codec.

The codec itself is pure and only knows its CPU decoder. A backend for another device
type (``kvwire_kernels`` for ``cuda``) registers a factory here when it is imported; the codec
never imports it, so ``import codec`` pulls in no GPU stack and there is no import cycle.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol

import torch

from .container import BlobHeader
from .errors import GpuUnavailable
from .profile import Profile

Layers = Iterator[tuple[int, torch.Tensor, torch.Tensor]]


class DeviceDecoder(Protocol):
    """What a device backend provides, per device (e.g. one per ``cuda:N``)."""

    def decode_section(self, header: BlobHeader, profile: Profile | None, layer: int,
                       section: bytes | memoryview) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode_layers(self, header: BlobHeader, profile: Profile | None,
                      sections: Iterable[tuple[int, bytes | memoryview]]) -> Layers: ...


#: device type -> factory building (or returning the cached) decoder of one device
_factories: dict[str, Callable[[torch.device], DeviceDecoder]] = {}
#: the package that registers each known device type, for the error when it has not
_PROVIDERS = {"cuda": "kvwire_kernels"}


def register(device_type: str, factory: Callable[[torch.device], DeviceDecoder]) -> None:
    """Make ``factory(device)`` the decoder of every ``device_type`` device."""
    if device_type == "cpu":
        raise ValueError("the CPU decoder is the codec's own and cannot be replaced")
    _factories[device_type] = factory


def device_decoder(device: torch.device) -> DeviceDecoder:
    """The registered decoder of a non-CPU ``device``; GpuUnavailable or ValueError if none."""
    factory = _factories.get(device.type)
    if factory is not None:
        return factory(device)   # the backend raises GpuUnavailable when it cannot run here
    provider = _PROVIDERS.get(device.type)
    if provider is None:
        raise ValueError(f"unsupported device {str(device)!r}: use 'cpu' or 'cuda'")
    raise GpuUnavailable(f"no decoder is registered for device {str(device)!r}: `import {provider}` "
                         f"first (needs pip install 'kvwire[cuda]' and a GPU)")
