"""A spy on the consumer flexattn dispatches to (``flexattn.ops.checked_consumer``): what each of
its forward and backward calls receives, as the facade's tests compare it eager and compiled."""

from __future__ import annotations


def record_calls(monkeypatch) -> list[tuple[str, tuple, dict]]:
    """The consumer calls from now on (the list fills as they come): ``(direction, args, kwargs)``
    per ``forward`` / ``backward`` call, ``args`` ``(plan, q, k, v, ...)`` as the consumer gets them."""
    from flexattn import ops

    checked, calls = ops.checked_consumer, []

    class Recording:
        def __init__(self, consumer):
            self.consumer = consumer

        def forward(self, *args, **kwargs):
            calls.append(("forward", args, kwargs))
            return self.consumer.forward(*args, **kwargs)

        def backward(self, *args, **kwargs):
            calls.append(("backward", args, kwargs))
            return self.consumer.backward(*args, **kwargs)

    monkeypatch.setattr(ops, "checked_consumer", lambda *a: Recording(checked(*a)))
    return calls
