"""shoal's wire messages: msgspec structs for every event, command and RPC.

One module per protocol, tagged unions for event families, an envelope with a
schema version, subject builders and a strict codec. No I/O lives here.
"""

from schemas.base import SCHEMA_CHANGES, SCHEMA_VERSION, Message
from schemas.decisions import *  # noqa: F403
from schemas.envelope import Body, Codec, Envelope, decode_body, encode_body
from schemas.errors import *  # noqa: F403
from schemas.history import *  # noqa: F403
from schemas.instance import *  # noqa: F403
from schemas.kv_events import *  # noqa: F403
from schemas.load import *  # noqa: F403
from schemas.migration import *  # noqa: F403
from schemas.position import Position
from schemas.reasons import *  # noqa: F403
from schemas.requests import *  # noqa: F403
from schemas.rpc import *  # noqa: F403
from schemas.subjects import Subjects
from schemas.tokens import Alternatives, TokenDelta, TokenDeltaBatch

__all__ = [
    "SCHEMA_CHANGES",
    "SCHEMA_VERSION",
    "Alternatives",
    "Body",
    "Codec",
    "Envelope",
    "Message",
    "Position",
    "Subjects",
    "TokenDelta",
    "TokenDeltaBatch",
    "decode_body",
    "encode_body",
]

#: Marks this top-level package as shoal's own; `shoal` checks it at start-up (frontend/packages.py).
__shoal_package__ = True
