"""Wire messages of folio's processes: msgpack headers plus raw array frames, typed by dataclasses.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack map, the *header*::

    {"v": PROTOCOL_VERSION, "type": "<message type>", <fields...>}

Every message type is a dataclass (``MESSAGES``: the client and control messages below, and the
step contract's ``StepPlan`` / ``StepResult`` from ``runtime/common/step.py``); its fields and type
annotations are the wire schema. One codec walks ``dataclasses.fields`` and the resolved
annotations (``_spec``, once per type): a field without a default is required, one annotated
``X | None`` may be null, and each annotation has one wire form:

- ``str``, ``int``, ``float``, ``bool``: the msgpack value (``int`` / ``float`` never a bool; an int
  is a float);
- ``dict``, ``list`` (untyped content, e.g. ``SamplingParams`` as a dict): the msgpack container,
  with arrays anywhere inside it travelling as below;
- ``list[int]``: a msgpack list of ints;
- ``np.ndarray``: its own frame of raw bytes (sent zero-copy, received zero-copy where pyzmq
  allows), the header holding ``{"__nd__": k, "dtype": "<i8", "shape": [..]}`` in its place, ``k``
  the frame's index (1-based); arrays are never msgpack lists;
- ``list[D]`` of a dataclass ``D`` (a plan's ``new_seqs``): ``{"rows": [...], "ints": <array>}``,
  each row a map of ``D``'s fields in which every ``list[int]`` field (token ids) is its length,
  and the values of those fields of every row end to end in the one int64 array ``ints``: a plan
  has a fixed number of frames however many sequences start in it.

Adding a field to a message dataclass is the only edit its wire form needs. ``encode`` sends the
fields given; ``encode_message`` sends a dataclass instance, leaving out a defaulted field that is
empty (``None``, an empty list or array: the receiver takes the default).

``decode`` checks, in order: the frame count and sizes against ``max_message_bytes`` (before
anything is parsed), the msgpack header (read with ``msgpack.unpackb`` size limits so a small frame
cannot ask for a huge allocation), the protocol version, the type, then every field's presence and
wire form, and every array's dtype, shape and byte length. Any failure raises ``MessageError``,
whose text is meant to be sent back to the one peer that sent the message (see ``error_reply``).

Message types:
  client -> scheduler: generate, chat, beam_search, abort, health, metrics
  scheduler -> client: output, error, health_reply, metrics_reply
  scheduler <-> worker: init, ready, step, step_result, shutdown, shutdown_ack, heartbeat, error

This module imports no zmq: frames are plain ``bytes``/``memoryview`` objects (or anything with
the buffer protocol, e.g. ``zmq.Frame``) so the codecs are testable alone.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any, Sequence

import msgpack
import numpy as np

from ..runtime.common.step import StepPlan, StepResult

PROTOCOL_VERSION = 2

# 64 MiB: a 256-sequence plan at 8k context is ~1 MiB; anything far bigger is abuse or a bug.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_FRAMES = 1024

# dtypes that may travel as arrays (little-endian; we never accept object arrays).
_ALLOWED_DTYPES = {"<i8", "<i4", "<f4", "<f8", "|u1", "<u4", "|b1", "<i2", "<u2", "<f2"}


class MessageError(ValueError):
    """An incoming message is malformed: wrong framing, version, type, field or size.

    Attributes:
        request_id: the request id found in the header, when one could be read (to address the reply).
        corr_id: the correlation id found in the header, when one could be read.
    """

    def __init__(self, message: str, request_id: str | None = None, corr_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.corr_id = corr_id


# ---------------------------------------------------------------------------------------------
# message types (the step contract's are runtime/common/step.py's StepPlan and StepResult)
# ---------------------------------------------------------------------------------------------

@dataclass
class Generate:
    """client -> scheduler: a completion request (``prompt`` text or ``prompt_token_ids``)."""

    request_id: str
    sampling: dict                       # SamplingParams fields
    prompt: str | None = None
    prompt_token_ids: np.ndarray | None = None
    cache_salt: str | None = None


@dataclass
class Chat:
    """client -> scheduler: a chat request (the messages rendered with the chat template)."""

    request_id: str
    messages: list
    sampling: dict
    add_generation_prompt: bool = True
    cache_salt: str | None = None


@dataclass
class BeamSearch:
    """client -> scheduler: one prompt's beam search, answered by one ``output`` at the end."""

    request_id: str
    params: dict                         # BeamSearchParams fields
    prompt: str | None = None
    prompt_token_ids: np.ndarray | None = None
    cache_salt: str | None = None


@dataclass
class Abort:
    request_id: str


@dataclass
class Health:
    corr_id: str


@dataclass
class Metrics:
    corr_id: str


@dataclass
class Output:
    """scheduler -> client: a request's delta. ``outputs``: ``[{index, token_ids (array), text,
    finish_reason, stop_reason, cumulative_logprob, logprobs}]``; ``prompt_logprobs``: ``[None,
    [[token, logprob, rank, text], ...], ...]``."""

    request_id: str
    outputs: list
    finished: bool
    prompt: str | None = None
    prompt_token_ids: np.ndarray | None = None
    num_cached_tokens: int | None = None
    metrics: dict | None = None
    prompt_logprobs: list | None = None


@dataclass
class Error:
    """An error for one request (``request_id``) or query (``corr_id``), or a peer's bad message
    (codes: bad_request, invalid_argument, worker_died, internal, ...)."""

    message: str
    code: str
    request_id: str | None = None
    corr_id: str | None = None


@dataclass
class HealthReply:
    corr_id: str
    healthy: bool
    detail: dict


@dataclass
class MetricsReply:
    corr_id: str
    metrics: dict


@dataclass
class Init:
    """scheduler -> worker: the ``EngineConfig`` as a dict."""

    config: dict
    parent_pid: int


@dataclass
class Ready:
    """worker -> scheduler: the runner is built (its KV cache's ``num_blocks``)."""

    num_blocks: int
    pid: int
    info: dict


@dataclass
class Shutdown:
    pass


@dataclass
class ShutdownAck:
    pass


@dataclass
class Heartbeat:
    pid: int
    time: float


MESSAGES: dict[str, type] = {
    "generate": Generate, "chat": Chat, "beam_search": BeamSearch, "abort": Abort, "health": Health,
    "metrics": Metrics, "output": Output, "error": Error, "health_reply": HealthReply,
    "metrics_reply": MetricsReply, "init": Init, "ready": Ready, "step": StepPlan, "step_result": StepResult,
    "shutdown": Shutdown, "shutdown_ack": ShutdownAck, "heartbeat": Heartbeat,
}
"""Every message type by its wire name."""


# ---------------------------------------------------------------------------------------------
# the codec: one wire form per annotation (module docstring), compiled once per dataclass
# ---------------------------------------------------------------------------------------------

_SCALARS = {str: "str", int: "int", float: "float", bool: "bool"}
_PY_TYPE = {"str": str, "int": int, "float": (float, int), "bool": bool, "dict": dict, "list": list, "ints": list}


@dataclass(frozen=True)
class _Field:
    """One field's wire form: ``kind`` (str, int, float, bool, dict, list, ints, array, rows),
    whether it is required (no default: else ``encode_message`` leaves it out when empty) and
    nullable (``X | None``), and for ``rows`` the row dataclass."""

    name: str
    kind: str
    required: bool
    nullable: bool
    row_type: type | None = None


def _wire_kind(tp) -> tuple[str, bool, type | None]:
    """``(kind, nullable, row dataclass)`` of a resolved annotation. Raises TypeError for a type
    with no wire form (at import, where a message type is compiled)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"no wire form for {tp!r}: only X | None unions")
        return _wire_kind(inner[0])[0], True, _wire_kind(inner[0])[2]
    if tp is np.ndarray:
        return "array", False, None
    if tp in _SCALARS:
        return _SCALARS[tp], False, None
    if tp is dict or typing.get_origin(tp) is dict:
        return "dict", False, None
    if tp is list or typing.get_origin(tp) is list:
        if args and args[0] is int:
            return "ints", False, None
        if args and dataclasses.is_dataclass(args[0]):
            return "rows", False, args[0]
        return "list", False, None
    raise TypeError(f"no wire form for {tp!r}")


_SPECS: dict[type, tuple[_Field, ...]] = {}
_NAMES: dict[type, frozenset] = {}    # a dataclass's field names


def _spec(cls: type) -> tuple[_Field, ...]:
    """The wire fields of dataclass ``cls`` (cached)."""
    spec = _SPECS.get(cls)
    if spec is None:
        hints = typing.get_type_hints(cls)
        fields = []
        for f in dataclasses.fields(cls):
            kind, nullable, row = _wire_kind(hints[f.name])
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            fields.append(_Field(f.name, kind, required, nullable, row))
        spec = _SPECS[cls] = tuple(fields)
        _NAMES[cls] = frozenset(f.name for f in spec)
    return spec


# ---------------------------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------------------------

class _Packer:
    """The frames of one message being encoded: arrays become frames, the rest msgpack values."""

    def __init__(self):
        self.frames: list = [b""]

    def array(self, value) -> dict:
        arr = np.ascontiguousarray(value)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        self.frames.append(memoryview(arr).cast("B") if arr.size else b"")
        return {"__nd__": len(self.frames) - 1, "dtype": arr.dtype.str, "shape": list(arr.shape)}

    def any(self, value):
        """An untyped value: arrays inside dicts / lists become frames, NumPy scalars Python's."""
        if isinstance(value, np.ndarray):
            return self.array(value)
        if isinstance(value, dict):
            return {k: self.any(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.any(v) for v in value]
        if isinstance(value, np.integer):
            return int(value)
        if isinstance(value, np.floating):
            return float(value)
        return value

    def rows(self, values, row_type: type) -> dict:
        spec = _spec(row_type)
        ints = [f.name for f in spec if f.kind == "ints"]
        rows = []
        for v in values:
            row = {}
            for f in spec:
                x = getattr(v, f.name)
                row[f.name] = len(x) if f.kind == "ints" else self.field(f, x)
            rows.append(row)
        flat = list(chain.from_iterable(getattr(v, name) for v in values for name in ints))
        return {"rows": rows, "ints": self.array(np.array(flat, dtype=np.int64))}

    def field(self, f: _Field, value):
        if value is None:
            return None
        kind = f.kind
        if kind == "array":
            return self.array(value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            return bool(value)
        if kind == "str":
            return value
        if kind == "ints":
            return [int(x) for x in value]
        if kind == "rows":
            return self.rows(value, f.row_type)
        return self.any(value)

    def finish(self, msg_type: str, header_fields: dict) -> list:
        header = {"v": PROTOCOL_VERSION, "type": msg_type}
        header.update(header_fields)
        self.frames[0] = msgpack.packb(header, use_bin_type=True)
        return self.frames


def _type_of(msg_type: str) -> type:
    cls = MESSAGES.get(msg_type)
    if cls is None:
        raise KeyError(f"unknown message type {msg_type!r}")
    return cls


def encode(msg_type: str, **fields: Any) -> list:
    """Build the frames of one message from its fields (those of ``MESSAGES[msg_type]``).

    Returns ``[header_bytes, array_buffer, ...]`` where each array buffer is a C-contiguous
    ``memoryview`` (pass ``copy=False`` to ``send_multipart`` to send it without a copy).

    Raises:
        KeyError: unknown ``msg_type`` or field (a programming error on the sending side).
    """
    spec = {f.name: f for f in _spec(_type_of(msg_type))}
    packer = _Packer()
    out = {}
    for name, value in fields.items():
        f = spec.get(name)
        if f is None:
            raise KeyError(f"{msg_type} has no field {name!r}")
        out[name] = packer.field(f, value)
    return packer.finish(msg_type, out)


def encode_message(msg_type: str, message) -> list:
    """The frames of a message dataclass instance (``MESSAGES[msg_type]``): every field, but a
    defaulted one left out when empty (``None``, or a list or array of length 0)."""
    packer = _Packer()
    out = {}
    for f in _spec(_type_of(msg_type)):
        value = getattr(message, f.name)
        if not f.required and (value is None or (f.kind in ("array", "rows", "ints", "list") and len(value) == 0)):
            continue
        out[f.name] = packer.field(f, value)
    return packer.finish(msg_type, out)


def _buffer(frame) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)          # zmq.Frame
    if buf is not None:
        return memoryview(buf)
    return memoryview(frame)


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------

class _Unpacker:
    """The frames of one message being decoded: which array frames the header used, and its ids
    (for the error reply)."""

    def __init__(self, bufs: list, msg_type: str, request_id, corr_id):
        self.bufs = bufs
        self.msg_type = msg_type
        self.used: set[int] = set()
        self.request_id, self.corr_id = request_id, corr_id

    def fail(self, msg: str):
        raise MessageError(msg, request_id=self.request_id, corr_id=self.corr_id)

    def array(self, desc, name: str) -> np.ndarray:
        if not isinstance(desc, dict) or set(desc) != {"__nd__", "dtype", "shape"}:
            self.fail(f"field {name!r} must be an array descriptor")
        k, dtype, shape = desc["__nd__"], desc["dtype"], desc["shape"]
        if not isinstance(k, int) or not 1 <= k < len(self.bufs) or k in self.used:
            self.fail(f"field {name!r}: bad frame index {k!r}")
        if dtype not in _ALLOWED_DTYPES:
            self.fail(f"field {name!r}: dtype {dtype!r} not allowed")
        if not isinstance(shape, list) or len(shape) > 4 or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            self.fail(f"field {name!r}: bad shape {shape!r}")
        self.used.add(k)
        dt = np.dtype(dtype)
        count = math.prod(shape)
        if count * dt.itemsize != self.bufs[k].nbytes:
            self.fail(f"field {name!r}: frame has {self.bufs[k].nbytes} bytes, dtype {dtype} shape {shape} needs "
                      f"{count * dt.itemsize}")
        return np.frombuffer(self.bufs[k], dtype=dt, count=count).reshape(shape)

    def any(self, value, name: str):
        """An untyped value with the arrays nested in its lists / dicts (e.g. outputs[i].token_ids)
        in place (the containers are the header's own)."""
        if type(value) is dict:
            if "__nd__" in value:
                return self.array(value, name)
            for k, v in value.items():
                if type(v) is dict or type(v) is list:
                    value[k] = self.any(v, f"{name}.{k}")
        elif type(value) is list:
            for i, v in enumerate(value):
                if type(v) is dict or type(v) is list:
                    value[i] = self.any(v, f"{name}[{i}]")
        return value

    def fields(self, cls: type, values: dict, where: str) -> dict:
        """``values`` (a header) checked against dataclass ``cls``: the fields present, decoded."""
        spec, names = _spec(cls), _NAMES[cls]
        for key in values:
            if key not in names:
                self.fail(f"{where}: unknown field {key!r}")
        out = {}
        for f in spec:
            if f.name not in values:
                if f.required:
                    self.fail(f"{where}: missing field {f.name!r}")
                continue
            out[f.name] = self.field(f, values[f.name], where)
        return out

    def field(self, f: _Field, value, where: str):
        name, kind = f.name, f.kind
        if value is None:
            if not f.nullable:
                self.fail(f"{where}: field {name!r} must not be null")
            return None
        if kind == "array":
            return self.array(value, name)
        if kind == "rows":
            return self.rows(f, value, where)
        if isinstance(value, bool) and kind in ("int", "float"):
            self.fail(f"{where}: field {name!r} must be {kind}, got bool")
        if not isinstance(value, _PY_TYPE[kind]):
            self.fail(f"{where}: field {name!r} must be {kind}, got {type(value).__name__}")
        if kind == "ints":
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                self.fail(f"{where}: field {name!r} must be a list of ints")
            return value
        if kind == "float":
            return float(value)
        return self.any(value, name) if kind in ("dict", "list") else value

    def rows(self, f: _Field, value, where: str) -> list:
        """A ``list[D]`` field: ``{"rows": [...], "ints": array}`` -> a list of ``D``."""
        name = f.name
        if not isinstance(value, dict) or set(value) != {"rows", "ints"} or not isinstance(value["rows"], list):
            self.fail(f"{where}: field {name!r} must be a map of rows and their ints")
        ints = self.array(value["ints"], f"{name}.ints")
        if ints.ndim != 1 or ints.dtype.kind not in "iu":
            self.fail(f"{where}: {name}.ints must be a 1-D integer array")
        ints = ints.tolist()
        spec, names = _spec(f.row_type), _NAMES[f.row_type]
        out, pos = [], 0
        for i, row in enumerate(value["rows"]):
            at = f"{where}: {name}[{i}]"
            if type(row) is not dict:
                self.fail(f"{at} must be a map")
            for key in row:
                if key not in names:
                    self.fail(f"{at}: unknown field {key!r}")
            kw = {}
            for g in spec:
                if g.name not in row:
                    if g.required:
                        self.fail(f"{at}: missing field {g.name!r}")
                    continue
                x = row[g.name]
                if g.kind != "ints":
                    kw[g.name] = self.field(g, x, at)
                    continue
                if type(x) is not int or x < 0:     # a list[int] field: its count in the packed ints
                    self.fail(f"{at}: field {g.name!r} must be a count >= 0 (of {name}.ints)")
                if pos + x > len(ints):
                    self.fail(f"{at}: its counts exceed {name}.ints")
                kw[g.name] = ints[pos:pos + x]
                pos += x
            out.append(f.row_type(**kw))
        if pos != len(ints):
            self.fail(f"{where}: {name}.ints longer than its rows' counts")
        return out


def decode(frames: Sequence, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[str, dict]:
    """Parse and validate one message.

    Args:
        frames: the message frames (after any routing envelope); bytes or ``zmq.Frame``.
        max_message_bytes: the largest total size accepted, checked before parsing.
    Returns:
        ``(msg_type, fields)``: the fields present in the message, arrays as read-only NumPy arrays
        viewing the frames (no copy), a ``list[D]`` field as ``D`` instances.
    Raises:
        MessageError: for any malformed message (the text says what is wrong).
    """
    bufs, header = _read_header(frames, max_message_bytes)
    rid = header.get("request_id") if isinstance(header.get("request_id"), str) else None
    cid = header.get("corr_id") if isinstance(header.get("corr_id"), str) else None
    version = header.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise MessageError(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})", rid, cid)
    msg_type = header.pop("type", None)
    if not isinstance(msg_type, str) or msg_type not in MESSAGES:
        raise MessageError(f"unknown message type {msg_type!r}", rid, cid)
    u = _Unpacker(bufs, msg_type, rid, cid)
    out = u.fields(MESSAGES[msg_type], header, msg_type)
    if len(u.used) != len(bufs) - 1:
        u.fail(f"{msg_type}: {len(bufs) - 1 - len(u.used)} array frame(s) not referenced by the header")
    return msg_type, out


def _read_header(frames: Sequence, max_message_bytes: int) -> tuple[list, dict]:
    """The frames' buffers and the header map, after the size checks (module docstring)."""
    if not frames:
        raise MessageError("empty message")
    if len(frames) > MAX_FRAMES:
        raise MessageError(f"too many frames: {len(frames)} > {MAX_FRAMES}")
    bufs = [_buffer(f) for f in frames]
    total = sum(b.nbytes for b in bufs)
    if total > max_message_bytes:
        raise MessageError(f"message too large: {total} bytes > limit {max_message_bytes}")
    n = bufs[0].nbytes
    try:
        header = msgpack.unpackb(bufs[0], raw=False, strict_map_key=True, use_list=True, max_str_len=n,
                                 max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=0)
    except Exception as e:  # msgpack raises several types for garbage (ExtraData, FormatError, ...)
        raise MessageError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise MessageError(f"header must be a msgpack map, got {type(header).__name__}")
    return bufs, header


def error_reply(message: str, code: str = "bad_request", request_id: str | None = None,
                corr_id: str | None = None) -> list:
    """Frames of an ``error`` message (codes: bad_request, invalid_argument, worker_died, internal, ...)."""
    return encode("error", message=message, code=code, request_id=request_id, corr_id=corr_id)


# ---------------------------------------------------------------------------------------------
# StepPlan / StepResult
# ---------------------------------------------------------------------------------------------

def encode_plan(plan: StepPlan) -> list:
    """Frames of a ``step`` message for ``plan`` (``encode_message``)."""
    return encode_message("step", plan)


def plan_from_fields(fields: dict) -> StepPlan:
    """Rebuild a ``StepPlan`` from a decoded ``step`` message; ``MessageError`` if its prompt
    logprob rows are not a pair of the same shape."""
    a, b = fields.get("prompt_logprob_indices"), fields.get("prompt_logprob_token_ids")
    if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
        raise MessageError("step: prompt_logprob_indices and prompt_logprob_token_ids go together, same shape")
    return StepPlan(**fields)


def encode_result(result: StepResult) -> list:
    """Frames of a ``step_result`` message (``encode_message``)."""
    return encode_message("step_result", result)


def result_from_fields(fields: dict) -> StepResult:
    """Rebuild a ``StepResult`` from a decoded ``step_result`` message."""
    return StepResult(**fields)


def config_to_dict(config) -> dict:
    """``EngineConfig`` -> plain dict for the ``init`` message."""
    return asdict(config)


for _cls in MESSAGES.values():   # every message type has a wire form (TypeError at import if not)
    _spec(_cls)
