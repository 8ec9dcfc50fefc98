"""maskplan_core.errors.warn_caller: the warning names the first frame outside the library and
torch, whatever the frames between look like."""

from __future__ import annotations

import os
import warnings

import torch

from maskplan_core.errors import warn_caller

#: a file beside torch's directory whose name starts like it (torchvision's, say)
NEIGHBOUR = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "torchvision", "ops.py")


def _warned_from(filename: str, module_name) -> warnings.WarningMessage:
    code = compile("warn_caller('held head dims')", filename, "exec")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        exec(code, {"__name__": module_name, "warn_caller": warn_caller})
    return said[0]


def test_a_neighbour_of_torchs_directory_is_the_callers():
    assert _warned_from(NEIGHBOUR, "torchvision.ops").filename == NEIGHBOUR


def test_a_frame_without_a_module_name_does_not_break_the_walk():
    """``exec`` in a namespace whose ``__name__`` is None (Python itself then records nothing)."""
    code = compile("warn_caller('held head dims')", "/somewhere/user_code.py", "exec")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        exec(code, {"__name__": None, "warn_caller": warn_caller})


def test_torchs_own_frames_are_passed_over():
    inside = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "module.py")
    assert _warned_from(inside, "torch.nn.modules.module").filename == __file__
