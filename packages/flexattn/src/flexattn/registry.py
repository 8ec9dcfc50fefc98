"""Consumer registry: consumers are found through the entry-point group ``maskplan.consumers``.

Lookup is by architecture family (``"reference"`` for CPU tensors, ``"sm90"`` for compute
capability 9.x, ``"sm100"`` for 10.x); the facade never branches on architecture itself.
"""

from __future__ import annotations

import logging
from functools import cache
from importlib.metadata import entry_points

import torch

from maskplan_core import ENTRY_POINT_GROUP, Consumer, ConsumerNotFoundError
from maskplan_core.reference import ReferenceConsumer

log = logging.getLogger("flexattn")

#: compute-capability major -> architecture family
_ARCH_BY_MAJOR = {9: "sm90", 10: "sm100"}
_INSTALL_HINT = {"sm90": "pip install 'flexattn[sm90]'", "sm100": "pip install 'flexattn[sm100]'"}


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def arch_family(device: torch.device) -> tuple[str, tuple[int, int] | None]:
    """Architecture family and compute capability of the device tensors live on."""
    if device.type == "cpu":
        return "reference", None
    if device.type != "cuda":
        raise ConsumerNotFoundError(f"flexattn runs on CPU (reference) or CUDA tensors, not on {device.type}")
    cc = _capability(device)
    family = _ARCH_BY_MAJOR.get(cc[0])
    if family is None:
        raise ConsumerNotFoundError(
            f"no flexattn consumer targets compute capability {cc[0]}.{cc[1]} "
            f"({torch.cuda.get_device_name(device)}); "
            f"supported: {sorted(f'{m}.x' for m in _ARCH_BY_MAJOR)}"
        )
    return family, cc


@cache
def installed_consumers() -> dict[str, Consumer]:
    """Every installed consumer by architecture family (the reference consumer always)."""
    found: dict[str, Consumer] = {}
    candidates = [ReferenceConsumer] + [ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)]
    for factory in candidates:
        consumer = factory()
        for family in consumer.arch_families:
            other = found.get(family)
            if other is not None and type(other) is not type(consumer):
                raise ConsumerNotFoundError(
                    f"two installed consumers claim {family}: {other.name} and {consumer.name}; uninstall one"
                )
            found[family] = consumer
    return found


def consumer_for(family: str) -> Consumer:
    consumer = installed_consumers().get(family)
    if consumer is None:
        hint = _INSTALL_HINT.get(family)
        if hint is None:  # a target name nothing claims: say which ones are there
            names = ", ".join(repr(f) for f in sorted(installed_consumers()))
            hint = f"the installed consumers serve {names}; a package may register another"
        raise ConsumerNotFoundError(f"no installed consumer serves {family!r}: {hint}")
    if not consumer.hardware_verified:
        log.warning("%s has been compiled for %s but never run on that hardware", consumer.name, family)
    return consumer
