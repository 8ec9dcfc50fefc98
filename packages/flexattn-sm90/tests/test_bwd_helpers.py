"""Host-side maths of ``flexattn_sm90.bwd_helpers`` (no compile, no GPU)."""

import pytest

pipeline = pytest.importorskip("cutlass.pipeline")

from flexattn_sm90.bwd_helpers import item_state  # noqa: E402


def _advanced(state: tuple[int, int], stages: int) -> tuple[int, int]:
    """``PipelineState.advance()`` on ``(index, phase)``: the phase flips where the index wraps."""
    index, phase = state[0] + 1, state[1]
    return (0, phase ^ 1) if index == stages else (index, phase)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("user", ["Producer", "Consumer"])
def test_item_state_is_the_state_advanced_once_per_item(stages, user):
    """The persistent backward derives the state of a pipeline used once per item from the item
    count; it must be the state that many ``advance()`` calls from ``make_pipeline_state`` reach."""
    kind = getattr(pipeline.PipelineUserType, user)
    start = pipeline.make_pipeline_state(kind, stages)
    state = (int(start.index), int(start.phase))
    for item in range(4 * stages + 3):
        derived = item_state(stages, item, kind)
        assert (derived.index, derived.phase) == state, item
        state = _advanced(state, stages)
