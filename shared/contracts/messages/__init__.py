"""Versioned stream messages. One module per stream; `codec` turns any of them into compact bytes.

    from shared.contracts.messages import RolloutTask, encode, decode
    fields = encode(task)            # {b"t": b"rollout_task", b"v": b"1", b"d": <msgpack>}
    task = decode(fields)            # -> RolloutTask, or raises MessageDecodeError
"""

from shared.contracts.messages.codec import MESSAGE_TYPES, Message, MessageDecodeError, decode, encode
from shared.contracts.messages.control import RunCommand, RunCommandReply, RunControl
from shared.contracts.messages.env import EnvReply, EnvRequest
from shared.contracts.messages.jobs import JobRequest, JobRequestReply
from shared.contracts.messages.rollout import RolloutTask
from shared.contracts.messages.tinker import (
    TinkerCheckpoint,
    TinkerDatum,
    TinkerFuture,
    TinkerOp,
    TinkerSample,
    TinkerWake,
)
from shared.contracts.messages.training import AcceptedResult, ConsumedGroup, TrainerProgress
from shared.contracts.messages.trajectory import EpisodeResult, TrajectoryRecord, TrajectoryStep
from shared.contracts.messages.weights import WeightsPublished

__all__ = [
    "MESSAGE_TYPES", "AcceptedResult", "ConsumedGroup", "EnvReply", "EnvRequest", "EpisodeResult", "JobRequest",
    "JobRequestReply", "Message", "MessageDecodeError", "RolloutTask", "RunCommand", "RunCommandReply", "RunControl", "TinkerCheckpoint", "TinkerDatum", "TinkerFuture",
    "TinkerOp", "TinkerSample", "TinkerWake", "TrajectoryStep", "TrainerProgress", "TrajectoryRecord", "WeightsPublished",
    "decode", "encode",
]
