"""KV (and EC) connector outputs: what every rank reports for a model step, merged on rank 0.

With a KV connector (``--kv-transfer-config``) each rank's step output carries its own
``kv_connector_output``: requests it finished sending or receiving, blocks that failed to load,
stats and events. vLLM's scheduler must see all of them merged; ``EngineCore`` sets
``kv_output_aggregator`` (and ``ec_output_aggregator`` for encoder-cache connectors) on the
executor for that. Rank 0's output alone would let the scheduler free blocks before the other
ranks finished with them, or never, and drop their load failures.

So while an aggregator is set, model steps use ``Replies.STEP``: after its part of the step,
every other rank sends back :func:`step_reply` of its output (the connector parts only, not
the sampled tokens, which rank 0 has) in the same reply gather the channel uses for
``collective_rpc``, and rank 0 merges them with vLLM's own aggregators (:func:`merge`).
Steps without a connector keep the one-broadcast path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

__all__ = ["StepReply", "step_reply", "merge"]


@dataclass(frozen=True)
class StepReply:
    """The parts of one rank's step output that vLLM's aggregators read."""

    present: bool
    kv_connector_output: Any = None
    ec_connector_output: Any = None


def step_reply(output: Any) -> StepReply:
    """What a rank sends back after a model step."""
    if output is None:
        return StepReply(False)
    return StepReply(True, getattr(output, "kv_connector_output", None),
                     getattr(output, "ec_connector_output", None))


def merge(output: Any, replies: list[StepReply], kv_aggregator: Any, ec_aggregator: Any,
          ) -> Any:
    """Rank 0's ``output`` with every rank's connector outputs merged in, as
    ``MultiprocExecutor`` does with ``output_rank`` 0. ``replies[r]`` is rank r's."""
    if output is None:
        return None
    # vLLM's aggregators write into the output they return; rank 0's may be vLLM's shared
    # EMPTY_MODEL_RUNNER_OUTPUT (mp's are unpickled copies), so merge into a copy.
    outputs: list[Any] = [copy.copy(output)]
    for reply in replies[1:]:
        outputs.append(_StandIn(reply.kv_connector_output, reply.ec_connector_output)
                       if reply.present else None)
    if any(o is None for o in outputs):
        missing = [r for r, o in enumerate(outputs) if o is None]
        raise RuntimeError(f"ranks {missing} returned no step output while rank 0 did")
    merged = outputs[0]
    for aggregator in (kv_aggregator, ec_aggregator):
        if aggregator is not None:
            merged = aggregator.aggregate([merged, *outputs[1:]], output_rank=0)
    return merged


class _StandIn:
    """Another rank's step output, as far as the aggregators read it."""

    def __init__(self, kv: Any, ec: Any) -> None:
        self.kv_connector_output = kv
        self.ec_connector_output = ec
