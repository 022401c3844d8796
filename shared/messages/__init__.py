"""Versioned stream messages. One module per stream; `codec` turns any of them into compact bytes.

    from shared.messages import RolloutTask, encode, decode
    fields = encode(task)            # {b"t": b"rollout_task", b"v": b"1", b"d": <msgpack>}
    task = decode(fields)            # -> RolloutTask, or raises MessageDecodeError
"""

from shared.messages.codec import MESSAGE_TYPES, Message, MessageDecodeError, decode, encode
from shared.messages.control import RunCommand, RunCommandReply, RunControl
from shared.messages.env import EnvReply, EnvRequest
from shared.messages.jobs import JobRequest, JobRequestReply
from shared.messages.rollout import RolloutTask
from shared.messages.training import AcceptedResult, ConsumedGroup, TrainerProgress
from shared.messages.trajectory import EpisodeResult, TrajectoryRecord, TrajectoryStep
from shared.messages.weights import WeightsPublished

__all__ = [
    "MESSAGE_TYPES", "AcceptedResult", "ConsumedGroup", "EnvReply", "EnvRequest", "EpisodeResult", "JobRequest",
    "JobRequestReply", "Message", "MessageDecodeError", "RolloutTask", "RunCommand", "RunCommandReply", "RunControl", "TrajectoryStep", "TrainerProgress", "TrajectoryRecord", "WeightsPublished",
    "decode", "encode",
]
