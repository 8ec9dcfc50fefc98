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


def installed_consumers() -> dict[str, Consumer]:
    """Every installed consumer by architecture family (the reference consumer always)."""
    return _registry()[0]


@cache
def _registry() -> tuple[dict[str, Consumer], tuple[str, ...]]:
    """The consumers by family, and a line for each registered plugin that failed to load: one
    broken package in the environment must not stop the others (the CPU reference included); a
    lookup that finds no consumer names the failures, since one of them may have served it."""
    found: dict[str, Consumer] = {}
    failed: list[str] = []
    consumers = [ReferenceConsumer()]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            consumers.append(ep.load()())
        except Exception as e:  # noqa: BLE001 - any import or constructor failure of a third party
            failed.append(f"{ep.name} = {ep.value} ({type(e).__name__}: {e})")
            log.warning("consumer plugin %s (%s) failed to load and is skipped: %s", ep.name, ep.value, e)
    for consumer in consumers:
        for family in consumer.arch_families:
            other = found.get(family)
            if other is not None and type(other) is not type(consumer):
                raise ConsumerNotFoundError(
                    f"two installed consumers claim {family}: {other.name} and {consumer.name}; uninstall one"
                )
            found[family] = consumer
    return found, tuple(failed)


def consumer_for(family: str) -> Consumer:
    found, failed = _registry()
    consumer = found.get(family)
    if consumer is None:
        hint = _INSTALL_HINT.get(family)
        if hint is None:  # a target name nothing claims: say which ones are there
            names = ", ".join(repr(f) for f in sorted(found))
            hint = f"the installed consumers serve {names}; a package may register another"
        if failed:  # first: an installed consumer of this family may be among them
            hint = "plugins that failed to load: " + "; ".join(failed) + f"; else {hint}"
        raise ConsumerNotFoundError(f"no installed consumer serves {family!r}: {hint}")
    if not consumer.hardware_verified:
        log.warning("%s has been compiled for %s but never run on that hardware", consumer.name, family)
    return consumer
