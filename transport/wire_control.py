"""Control frame bodies (msgpack) with strict validation: any deviation is a ``WireError``."""

from __future__ import annotations

import enum
import sys
from array import array
from typing import Any

import msgpack

from .errors import WireError
from .messages import Continuation, Pooling, SamplingParams, Submit, Task

__all__ = [
    "MAX_TOP_N",
    "INT64_MAX",
    "check_rid",
    "pack",
    "submit_fields",
    "submit_body",
    "continuation_fields",
    "continuation",
    "task_fields",
    "task_problem",
    "Fields",
    "unpack_fields",
    "enum_value",
    "le_bytes",
    "params_extension",
]

MAX_TOP_N = 20
INT64_MAX = (1 << 63) - 1  # integer fields are signed 64-bit unless a field says otherwise
_BIG_ENDIAN = sys.byteorder == "big"


def le_bytes(a: array[Any]) -> bytes:
    if _BIG_ENDIAN:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def check_rid(rid: int) -> None:
    if not 0 < rid < 1 << 32:
        raise ValueError(f"request id {rid} outside 1..2**32-1")


# One Packer, reused: ``msgpack.packb`` builds a Packer per call, which is half
# its cost for small bodies. Safe to share: ``pack`` runs in C under the GIL and
# resets the buffer on error.
_PACKER = msgpack.Packer(use_bin_type=True)


def pack(obj: object) -> bytes:
    out = _PACKER.pack(obj)
    assert isinstance(out, bytes)
    return out


def submit_fields(s: Submit) -> list[object]:
    """The SUBMIT body as a list (the spec's field order); :func:`submit_body` packs the same."""
    return [s.model, _params_fields(s.params), *_submit_rest(s)]


def submit_body(s: Submit) -> bytes:
    """``pack(submit_fields(s))``, faster: the params sub-array is packed once per SamplingParams
    object (the gateway shares one per distinct setting) and spliced in."""
    rest: bytes = _PACKER.pack(_submit_rest(s))
    # msgpack: an array of n < 16 is the byte 0x90 + n then its items; ``rest`` is an array of 8 (0x98 +
    # items), 9 with a continuation, 10 with a task; the body has model and params besides.
    model: bytes = _PACKER.pack(s.model)
    return (b"\x9a" if rest[0] == 0x98 else bytes((rest[0] + 2,))) + model + _params_bytes(s.params) + rest[1:]


def _submit_rest(s: Submit) -> list[object]:
    """Fields 2..9 (10 with a continuation) of a checked SUBMIT (everything after model and params)."""
    _check_submit(s)
    ids = None if s.prompt_token_ids is None else le_bytes(array("I", s.prompt_token_ids))
    msgs = None if s.messages is None else list(s.messages)
    rest: list[object] = [s.prompt, ids, msgs, s.deadline_ms, s.priority, s.trace, bool(s.return_text), bool(s.buffered)]
    if s.continuation is not None:
        rest.append(continuation_fields(s.continuation))
    if s.task or s.pooling or s.echo:
        if s.continuation is None:
            rest.append(None)
        rest.append([int(s.task), int(s.pooling), bool(s.echo)])
    return rest


def task_fields(f: Fields) -> tuple[Task, Pooling, bool]:
    """SUBMIT field 11, checked: (task, pooling, echo); absent: a generation, no echo."""
    if len(f.items) <= 11:
        return Task.GENERATE, Pooling.MEAN, False
    t = Fields(f.items[11], "SUBMIT task", 3)
    return enum_value(Task, t.integer(0), "SUBMIT task"), enum_value(Pooling, t.integer(1), "SUBMIT pooling"), t.flag(2)


def continuation_fields(c: Continuation) -> list[object]:
    """SUBMIT field 10: [token_ids (bin, u32 LE), text_bytes]."""
    if not 0 <= c.text_bytes <= INT64_MAX:
        raise ValueError("a continuation's text_bytes must be in 0..2**63-1")
    return [le_bytes(array("I", c.token_ids)), c.text_bytes]


def continuation(f: Fields) -> Continuation | None:
    """SUBMIT field 10, checked (None when absent or nil: a new request)."""
    if len(f.items) <= 10 or f.items[10] is None:
        return None
    c = Fields(f.items[10], "SUBMIT continuation", 2)
    return Continuation(c.uints(0), c.integer(1))


def _check_submit(s: Submit) -> None:
    if not 0 <= s.params.top_logprobs <= MAX_TOP_N:
        raise ValueError(f"top_logprobs must be 0..{MAX_TOP_N}")
    if (s.prompt is not None) + (s.prompt_token_ids is not None) + (s.messages is not None) != 1:
        raise ValueError("Submit needs exactly one of prompt, prompt_token_ids, messages")
    if s.buffered and (s.params.logprobs or s.params.top_logprobs):
        raise ValueError("a buffered Submit cannot ask for logprobs")
    problem = task_problem(s)
    if problem:
        raise ValueError(problem)


def task_problem(s: Submit) -> str:
    """What breaks the task rules of the spec ("Tasks"), or ""."""
    if s.echo and (s.task or s.buffered):
        return "echo is for a generation that is not buffered"
    if s.task and not s.buffered:
        return "an embed, tokenize or detokenize Submit is buffered"
    if s.task == Task.DETOKENIZE and s.prompt_token_ids is None:
        return "a detokenize Submit carries prompt_token_ids"
    return ""


_PARAMS_PACKED: dict[int, tuple[SamplingParams, bytes]] = {}  # id -> (the object, kept alive; its bytes)
_PARAMS_PACKED_MAX = 4096


def _params_bytes(p: SamplingParams) -> bytes:
    hit = _PARAMS_PACKED.get(id(p))
    if hit is not None and hit[0] is p:
        return hit[1]
    out = pack(_params_fields(p))
    if len(_PARAMS_PACKED) >= _PARAMS_PACKED_MAX:
        _PARAMS_PACKED.clear()
    _PARAMS_PACKED[id(p)] = (p, out)
    return out


def _params_fields(p: SamplingParams) -> list[object]:
    # The decoder's ranges: a SUBMIT outside them is a protocol error that closes the connection.
    if not (0 <= p.max_tokens <= INT64_MAX and 0 <= p.top_k <= INT64_MAX) or (
            p.seed is not None and not -INT64_MAX - 1 <= p.seed <= INT64_MAX):
        raise ValueError("max_tokens and top_k must be in 0..2**63-1 and seed in -2**63..2**63-1")
    fields: list[object] = [
        p.max_tokens,
        float(p.temperature),
        float(p.top_p),
        p.top_k,
        p.seed,
        list(p.stop),
        le_bytes(array("I", p.stop_token_ids)),
        bool(p.ignore_eos),
        bool(p.logprobs),
        p.top_logprobs,
    ]
    if p.extended:  # the optional group 10..17, all or none (absent: the defaults)
        fields += [float(p.presence_penalty), float(p.frequency_penalty), float(p.repetition_penalty),
                   [[int(t), float(b)] for t, b in p.logit_bias], p.min_tokens, p.guide_kind, p.guide, p.tools]
    return fields


def params_extension(p: Fields) -> dict[str, Any]:
    """SUBMIT params 10..17 as SamplingParams keywords ({} when absent), each checked."""
    if len(p.items) <= 10:
        return {}
    if len(p.items) < 18:
        raise WireError("SUBMIT params: the optional fields 10..17 come all together or not at all")
    bias = p.items[13]
    if not isinstance(bias, list) or not all(
            isinstance(x, list) and len(x) == 2 and type(x[0]) is int and 0 <= x[0] < 1 << 32
            and type(x[1]) in (int, float) for x in bias):
        raise p.fail(13, "a list of [token id, bias] pairs")
    return dict(presence_penalty=p.number(10), frequency_penalty=p.number(11), repetition_penalty=p.number(12),
                logit_bias=tuple((int(t), float(b)) for t, b in bias), min_tokens=p.integer(14),
                guide_kind=p.text(15), guide=p.text(16), tools=p.text(17))


# --- decoding ------------------------------------------------------------------------------------


class Fields:
    """Validating accessors over one decoded msgpack list."""

    __slots__ = ("items", "what")

    def __init__(self, items: object, what: str, min_len: int) -> None:
        if not isinstance(items, list) or len(items) < min_len:
            raise WireError(f"{what}: expected a list of at least {min_len} fields")
        self.items: list[object] = items
        self.what = what

    def fail(self, i: int, kind: str) -> WireError:
        return WireError(f"{self.what}: field {i} must be {kind}")

    def integer(self, i: int, lo: int = 0, hi: int = INT64_MAX) -> int:
        v = self.items[i]
        if type(v) is not int or not lo <= v <= hi:
            raise self.fail(i, f"an integer in {lo}..{hi}")
        return v

    def opt_integer(self, i: int) -> int | None:
        return None if self.items[i] is None else self.integer(i, -INT64_MAX - 1)

    def number(self, i: int) -> float:
        v = self.items[i]
        if type(v) is int:
            return float(v)
        if type(v) is not float:
            raise self.fail(i, "a number")
        return v

    def flag(self, i: int) -> bool:
        v = self.items[i]
        if type(v) is not bool:
            raise self.fail(i, "a bool")
        return v

    def text(self, i: int) -> str:
        v = self.items[i]
        if type(v) is not str:
            raise self.fail(i, "a string")
        return v

    def opt_text(self, i: int) -> str | None:
        return None if self.items[i] is None else self.text(i)

    def strs(self, i: int) -> tuple[str, ...]:
        v = self.items[i]
        if not isinstance(v, list) or not all(type(x) is str for x in v):
            raise self.fail(i, "a list of strings")
        return tuple(v)

    def uints(self, i: int, itemsize: int = 4) -> tuple[int, ...]:
        v = self.items[i]
        if type(v) is not bytes or len(v) % itemsize:
            raise self.fail(i, f"bytes of u{itemsize * 8} values")
        a = array("I" if itemsize == 4 else "Q")
        a.frombytes(v)
        if _BIG_ENDIAN:
            a.byteswap()
        return tuple(a)

    def str_dict(self, i: int) -> dict[str, str] | None:
        v = self.items[i]
        if v is None:
            return None
        if not isinstance(v, dict) or not all(type(k) is str and type(x) is str for k, x in v.items()):
            raise self.fail(i, "a map of strings")
        return v

    def chat(self, i: int) -> tuple[dict[str, Any], ...] | None:
        v = self.items[i]
        if v is None:
            return None
        if not isinstance(v, list) or not all(
            isinstance(m, dict) and all(type(k) is str for k in m) for m in v
        ):
            raise self.fail(i, "a list of maps with string keys")
        return tuple(v)


def unpack_fields(body: memoryview, what: str, min_len: int) -> Fields:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types for bad input; all mean one thing
        raise WireError(f"{what}: body is not valid msgpack ({type(exc).__name__})") from None
    return Fields(obj, what, min_len)


def enum_value(cls: type[enum.IntEnum], v: int, what: str) -> Any:
    try:
        return cls(v)
    except ValueError:
        raise WireError(f"{what}: unknown {cls.__name__} {v}") from None
