"""Wire messages of folio's processes: msgpack headers plus raw array frames.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack map, the *header*::

    {"v": PROTOCOL_VERSION, "type": "<message type>", <fields...>}

Every NumPy array travels as its own frame of raw bytes (sent zero-copy, received zero-copy where
pyzmq allows); the header holds a descriptor ``{"__nd__": k, "dtype": "<i8", "shape": [..]}`` in
its place, ``k`` being the frame's index (1-based). Arrays are never encoded as msgpack lists.

Every message type has a schema in ``SCHEMAS`` (field -> kind, required). ``decode`` checks, in
order: the frame count and sizes against ``max_message_bytes`` (before anything is parsed), the
msgpack header (read with ``msgpack.unpackb`` size limits so a small frame cannot ask for a huge
allocation), the protocol version, the type, then every field's presence and kind, and every
array's dtype, shape and byte length. Any failure raises ``MessageError``, whose text is meant to
be sent back to the one peer that sent the message (see ``error_reply``).

Message types:
  client -> scheduler: generate, chat, beam_search, abort, health, metrics
  scheduler -> client: output, error, health_reply, metrics_reply
  scheduler <-> worker: init, ready, step, step_result, shutdown, shutdown_ack, heartbeat, error

This module imports no zmq: frames are plain ``bytes``/``memoryview`` objects (or anything with
the buffer protocol, e.g. ``zmq.Frame``) so the codecs are testable alone.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

import math

import msgpack
import numpy as np

from ..runtime.common.step import NewSequence, StepPlan, StepResult

PROTOCOL_VERSION = 1

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
# schemas: field -> (kind, required). Kinds: "str", "int", "float", "bool", "dict", "list",
# "array" (an array frame), "arrays" (a list of array frames), "any"; "?kind" = may be None.
# ---------------------------------------------------------------------------------------------

SCHEMAS: dict[str, dict[str, tuple[str, bool]]] = {
    # client -> scheduler
    "generate": {
        "request_id": ("str", True),
        "prompt": ("?str", False),
        "prompt_token_ids": ("?array", False),
        "sampling": ("dict", True),
        "cache_salt": ("?str", False),
    },
    "chat": {
        "request_id": ("str", True),
        "messages": ("list", True),
        "sampling": ("dict", True),
        "add_generation_prompt": ("bool", False),
        "cache_salt": ("?str", False),
    },
    "beam_search": {                        # one prompt; answered by one "output" at the end
        "request_id": ("str", True),
        "prompt": ("?str", False),
        "prompt_token_ids": ("?array", False),
        "params": ("dict", True),           # BeamSearchParams fields
        "cache_salt": ("?str", False),
    },
    "abort": {"request_id": ("str", True)},
    "health": {"corr_id": ("str", True)},
    "metrics": {"corr_id": ("str", True)},
    # scheduler -> client
    "output": {
        "request_id": ("str", True),
        "outputs": ("list", True),          # [{index, token_ids (array), text, finish_reason, stop_reason,
        "finished": ("bool", True),         #   cumulative_logprob, logprobs}]
        "prompt": ("?str", False),
        "prompt_token_ids": ("?array", False),
        "num_cached_tokens": ("?int", False),
        "metrics": ("?dict", False),
        "prompt_logprobs": ("?list", False),  # [None, [[token, logprob, rank, text], ...], ...]
    },
    "error": {
        "message": ("str", True),
        "code": ("str", True),
        "request_id": ("?str", False),
        "corr_id": ("?str", False),
    },
    "health_reply": {"corr_id": ("str", True), "healthy": ("bool", True), "detail": ("dict", True)},
    "metrics_reply": {"corr_id": ("str", True), "metrics": ("dict", True)},
    # scheduler <-> worker
    "init": {"config": ("dict", True), "parent_pid": ("int", True)},
    "ready": {"num_blocks": ("int", True), "pid": ("int", True), "info": ("dict", True)},
    "step": {
        "step_id": ("int", True),
        "input_ids": ("array", True),
        "positions": ("array", True),
        "slot_mapping": ("array", True),
        "query_start_loc": ("array", True),
        "seq_lens": ("array", True),
        "block_tables": ("array", True),
        "seq_ids": ("array", True),
        "logits_indices": ("array", True),
        "sample_seq_ids": ("array", True),
        "new_seqs": ("list", True),          # [{seq_id, sampling, seed, n_prompt, n_output, n_eos}]
        "new_seq_token_ids": ("array", True),  # all new_seqs' prompt, output and eos ids, end to end
        "finished_seq_ids": ("list", True),
        "block_copies": ("array", True),
        "prompt_logprob_indices": ("array", False),    # only when a request asked for them
        "prompt_logprob_token_ids": ("array", False),
    },
    "step_result": {
        "step_id": ("int", True),
        "sampled_token_ids": ("array", True),
        "logprobs": ("?array", False),
        "logprob_token_ids": ("?array", False),
        "prompt_logprobs": ("?array", False),
        "prompt_logprob_token_ids": ("?array", False),
        "prompt_logprob_ranks": ("?array", False),
        "forward_time": ("float", True),
        "sample_time": ("float", True),
        "idle_time": ("float", False),
        "error": ("?str", False),
    },
    "shutdown": {},
    "shutdown_ack": {},
    "heartbeat": {"pid": ("int", True), "time": ("float", True)},
}

_PY_KIND = {"str": str, "int": int, "float": (float, int), "bool": bool, "dict": dict, "list": list}


# ---------------------------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------------------------

def encode(msg_type: str, **fields: Any) -> list:
    """Build the frames of one message.

    NumPy arrays anywhere in ``fields`` (top level, or inside lists/dicts) become raw frames; all
    other values must be msgpack-able. Returns ``[header_bytes, array_buffer, ...]`` where each
    array buffer is a C-contiguous ``memoryview`` (pass ``copy=False`` to ``send_multipart`` to
    send it without a copy).

    Raises:
        KeyError: unknown ``msg_type`` (a programming error on the sending side).
    """
    if msg_type not in SCHEMAS:
        raise KeyError(f"unknown message type {msg_type!r}")
    frames: list = [b""]

    def pack(value):
        if isinstance(value, np.ndarray):
            arr = np.ascontiguousarray(value)
            if arr.dtype.byteorder == ">":
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            frames.append(memoryview(arr).cast("B") if arr.size else b"")
            return {"__nd__": len(frames) - 1, "dtype": arr.dtype.str, "shape": list(arr.shape)}
        if isinstance(value, dict):
            return {k: pack(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [pack(v) for v in value]
        if isinstance(value, np.integer):
            return int(value)
        if isinstance(value, np.floating):
            return float(value)
        return value

    header = {"v": PROTOCOL_VERSION, "type": msg_type}
    header.update({k: pack(v) for k, v in fields.items()})
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def _buffer(frame) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)          # zmq.Frame
    if buf is not None:
        return memoryview(buf)
    return memoryview(frame)


def decode(frames: Sequence, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[str, dict]:
    """Parse and validate one message.

    Args:
        frames: the message frames (after any routing envelope); bytes or ``zmq.Frame``.
        max_message_bytes: the largest total size accepted, checked before parsing.
    Returns:
        ``(msg_type, fields)`` with array descriptors replaced by read-only NumPy arrays viewing
        the frames (no copy).
    Raises:
        MessageError: for any malformed message (the text says what is wrong).
    """
    if not frames:
        raise MessageError("empty message")
    if len(frames) > MAX_FRAMES:
        raise MessageError(f"too many frames: {len(frames)} > {MAX_FRAMES}")
    bufs = [_buffer(f) for f in frames]
    total = sum(b.nbytes for b in bufs)
    if total > max_message_bytes:
        raise MessageError(f"message too large: {total} bytes > limit {max_message_bytes}")
    head = bufs[0]
    n = head.nbytes
    try:
        header = msgpack.unpackb(
            head, raw=False, strict_map_key=True, use_list=True,
            max_str_len=n, max_bin_len=n,
            max_array_len=n, max_map_len=n, max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several types for garbage (ExtraData, FormatError, ...)
        raise MessageError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise MessageError(f"header must be a msgpack map, got {type(header).__name__}")
    rid = header.get("request_id") if isinstance(header.get("request_id"), str) else None
    cid = header.get("corr_id") if isinstance(header.get("corr_id"), str) else None

    def fail(msg: str):
        raise MessageError(msg, request_id=rid, corr_id=cid)

    version = header.get("v")
    if version != PROTOCOL_VERSION:
        fail(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})")
    msg_type = header.get("type")
    if not isinstance(msg_type, str) or msg_type not in SCHEMAS:
        fail(f"unknown message type {msg_type!r}")
    schema = SCHEMAS[msg_type]
    used: set[int] = set()

    def unpack_array(desc, name):
        if not isinstance(desc, dict) or set(desc) != {"__nd__", "dtype", "shape"}:
            fail(f"field {name!r} must be an array descriptor")
        k, dtype, shape = desc["__nd__"], desc["dtype"], desc["shape"]
        if not isinstance(k, int) or not 1 <= k < len(bufs) or k in used:
            fail(f"field {name!r}: bad frame index {k!r}")
        if dtype not in _ALLOWED_DTYPES:
            fail(f"field {name!r}: dtype {dtype!r} not allowed")
        if not isinstance(shape, list) or len(shape) > 4 or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            fail(f"field {name!r}: bad shape {shape!r}")
        used.add(k)
        dt = np.dtype(dtype)
        count = math.prod(shape)
        if count * dt.itemsize != bufs[k].nbytes:
            fail(f"field {name!r}: frame has {bufs[k].nbytes} bytes, dtype {dtype} shape {shape} needs "
                 f"{count * dt.itemsize}")
        return np.frombuffer(bufs[k], dtype=dt, count=count).reshape(shape)

    def resolve(value, name):
        # arrays nested in lists/dicts (e.g. outputs[i].token_ids, new_seqs[i].prompt_token_ids)
        if isinstance(value, dict):
            if "__nd__" in value:
                return unpack_array(value, name)
            return {k: resolve(v, f"{name}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, f"{name}[{i}]") for i, v in enumerate(value)]
        return value

    out: dict = {}
    for key in header:
        if key not in ("v", "type") and key not in schema:
            fail(f"{msg_type}: unknown field {key!r}")
    for name, (kind, required) in schema.items():
        if name not in header:
            if required:
                fail(f"{msg_type}: missing field {name!r}")
            continue
        value = header[name]
        nullable = kind.startswith("?")
        base = kind.lstrip("?")
        if value is None:
            if not nullable:
                fail(f"{msg_type}: field {name!r} must not be null")
            out[name] = None
            continue
        if base == "array":
            out[name] = unpack_array(value, name)
            continue
        py = _PY_KIND[base]
        if isinstance(value, bool) and base in ("int", "float"):
            fail(f"{msg_type}: field {name!r} must be {base}, got bool")
        if not isinstance(value, py):
            fail(f"{msg_type}: field {name!r} must be {base}, got {type(value).__name__}")
        out[name] = resolve(value, name) if base in ("dict", "list") else value
    if len(used) != len(bufs) - 1:
        fail(f"{msg_type}: {len(bufs) - 1 - len(used)} array frame(s) not referenced by the header")
    return msg_type, out


def error_reply(message: str, code: str = "bad_request", request_id: str | None = None,
                corr_id: str | None = None) -> list:
    """Frames of an ``error`` message (codes: bad_request, invalid_argument, worker_died, internal, ...)."""
    return encode("error", message=message, code=code, request_id=request_id, corr_id=corr_id)


# ---------------------------------------------------------------------------------------------
# StepPlan / StepResult
# ---------------------------------------------------------------------------------------------

_PLAN_ARRAYS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                "seq_ids", "logits_indices", "sample_seq_ids", "block_copies")
_PROMPT_LOGPROB_ROWS = ("prompt_logprob_indices", "prompt_logprob_token_ids")  # sent only when non-empty
_RESULT_ARRAYS = ("logprobs", "logprob_token_ids", "prompt_logprobs", "prompt_logprob_token_ids",
                  "prompt_logprob_ranks")


def encode_plan(plan: StepPlan) -> list:
    """Frames of a ``step`` message for ``plan``.

    The token id lists of all new sequences travel as one int64 array (each sequence's prompt,
    output and EOS ids end to end, lengths in its ``new_seqs`` entry), so a plan has a fixed
    number of frames however many sequences start in it.
    """
    new_seqs, chunks = [], []
    for s in plan.new_seqs:
        new_seqs.append({"seq_id": int(s.seq_id), "sampling": s.sampling, "seed": s.seed,
                         "n_prompt": len(s.prompt_token_ids), "n_output": len(s.output_token_ids),
                         "n_eos": len(s.eos_token_ids)})
        chunks += [s.prompt_token_ids, s.output_token_ids, s.eos_token_ids]
    ids = np.fromiter((int(t) for c in chunks for t in c), dtype=np.int64) if chunks else np.zeros(0, np.int64)
    arrays = {name: np.asarray(getattr(plan, name)) for name in _PLAN_ARRAYS}
    if len(plan.prompt_logprob_indices):
        arrays.update({name: np.asarray(getattr(plan, name), dtype=np.int64) for name in _PROMPT_LOGPROB_ROWS})
    return encode("step", step_id=int(plan.step_id), new_seqs=new_seqs, new_seq_token_ids=ids,
                  finished_seq_ids=[int(i) for i in plan.finished_seq_ids], **arrays)


def plan_from_fields(fields: dict) -> StepPlan:
    """Rebuild a ``StepPlan`` from a decoded ``step`` message; ``MessageError`` if new_seqs are malformed."""
    new_seqs = []
    ids = fields["new_seq_token_ids"]
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise MessageError("step: new_seq_token_ids must be a 1-D integer array")
    ids = ids.tolist()
    pos = 0
    for i, d in enumerate(fields["new_seqs"]):
        try:
            n_p, n_o, n_e = (int(d[k]) for k in ("n_prompt", "n_output", "n_eos"))
            if min(n_p, n_o, n_e) < 0 or pos + n_p + n_o + n_e > len(ids):
                raise ValueError("token id counts exceed new_seq_token_ids")
            ns = NewSequence(
                seq_id=int(d["seq_id"]),
                prompt_token_ids=ids[pos:pos + n_p],
                output_token_ids=ids[pos + n_p:pos + n_p + n_o],
                sampling=dict(d["sampling"]),
                seed=None if d["seed"] is None else int(d["seed"]),
                eos_token_ids=ids[pos + n_p + n_o:pos + n_p + n_o + n_e],
            )
            pos += n_p + n_o + n_e
        except (KeyError, TypeError, ValueError) as e:
            raise MessageError(f"step: new_seqs[{i}] malformed: {e!r}") from None
        new_seqs.append(ns)
    if pos != len(ids):
        raise MessageError("step: new_seq_token_ids longer than the new_seqs counts")
    if not all(isinstance(x, int) for x in fields["finished_seq_ids"]):
        raise MessageError("step: finished_seq_ids must be ints")
    extra = {name: fields[name] for name in _PROMPT_LOGPROB_ROWS if name in fields}
    if len(extra) == 1 or (extra and extra["prompt_logprob_indices"].shape != extra["prompt_logprob_token_ids"].shape):
        raise MessageError("step: prompt_logprob_indices and prompt_logprob_token_ids go together, same shape")
    return StepPlan(step_id=fields["step_id"], new_seqs=new_seqs, finished_seq_ids=fields["finished_seq_ids"],
                    **{name: fields[name] for name in _PLAN_ARRAYS}, **extra)


def encode_result(result: StepResult) -> list:
    """Frames of a ``step_result`` message."""
    arrays = {name: np.asarray(getattr(result, name)) for name in _RESULT_ARRAYS
              if getattr(result, name) is not None}
    return encode("step_result", step_id=int(result.step_id),
                  sampled_token_ids=np.asarray(result.sampled_token_ids, dtype=np.int64), **arrays,
                  forward_time=float(result.forward_time), sample_time=float(result.sample_time),
                  idle_time=float(result.idle_time), error=result.error)


def result_from_fields(fields: dict) -> StepResult:
    """Rebuild a ``StepResult`` from a decoded ``step_result`` message."""
    return StepResult(step_id=fields["step_id"], sampled_token_ids=fields["sampled_token_ids"],
                      **{name: fields.get(name) for name in _RESULT_ARRAYS},
                      forward_time=float(fields["forward_time"]), sample_time=float(fields["sample_time"]),
                      idle_time=float(fields.get("idle_time", 0.0)), error=fields.get("error"))


def config_to_dict(config) -> dict:
    """``EngineConfig`` -> plain dict for the ``init`` message."""
    return asdict(config)
