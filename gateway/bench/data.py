"""What is sent: prompts and output lengths from a synthetic distribution or a ShareGPT file.

Every source returns :class:`BenchRequest` values, made before the run starts (so making them
costs the run nothing). Lengths are in tokens of a :class:`TokenCounter`: the byte-level one
of quicserve's built-in ``tiny`` model (one token a UTF-8 byte) by default, or a Hugging Face
``tokenizer.json`` (``--tokenizer DIR``) for a server running that model. The server's own
count (``usage``) is what the figures use when it reports one.

- ``random``: input and output lengths uniform in ``len * (1 +- range_ratio)`` (vLLM's definition).
- ``shared-prefix``: ``tenants`` system prompts of ``prefix_len`` tokens, chosen with Zipf
  popularity (tenant k of n in proportion to ``1 / k**zipf``); each session runs ``turns``
  turns, every turn resending the conversation so far (its assistant turns are made up, so
  requests never wait on one another), and ``sessions`` sessions interleave at a time.
- ``sharegpt``: the first human turn of each conversation as the prompt, the length of the
  reply after it as the output length (vLLM's reading of the format).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import orjson

__all__ = ["BenchRequest", "TokenCounter", "ByteCounter", "HFCounter", "load_counter", "random_requests",
           "shared_prefix_requests", "sharegpt_requests", "Message", "zipf_weights"]

Message = dict[str, str]
_ALPHABET = np.frombuffer((string.ascii_lowercase * 3 + " " * 14).encode(), dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: its chat messages (the completions endpoint sends them joined as a prompt)."""

    messages: tuple[Message, ...]
    prompt_len: int
    output_len: int
    session: int = -1  # shared-prefix: the session it belongs to
    tenant: int = -1

    @property
    def prompt(self) -> str:
        if len(self.messages) == 1:
            return self.messages[0]["content"]
        return "".join(f"{m['role']}: {m['content']}\n" for m in self.messages)


class TokenCounter(Protocol):
    name: str

    def count(self, text: str) -> int: ...

    def random_text(self, n: int, rng: np.random.Generator) -> str: ...


class ByteCounter:
    """One token a UTF-8 byte: quicserve's built-in ``tiny`` model (and the synthetic engine)."""

    name = "byte"

    def count(self, text: str) -> int:
        return len(text.encode())

    def random_text(self, n: int, rng: np.random.Generator) -> str:
        return rng.choice(_ALPHABET, size=max(n, 0)).tobytes().decode()


class HFCounter:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (no model, no network)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        self._vocab = self._tok.get_vocab_size()

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def random_text(self, n: int, rng: np.random.Generator) -> str:
        """Random ids decoded (vLLM's way). Encoding that text again merges or splits ids where they
        meet (a byte-level vocabulary's random ids are not all whole characters), so the ids of the
        text are cut or topped up to ``n`` and decoded again, a few times: near ``n``, counted after."""
        ids = rng.integers(100, max(self._vocab, 101), size=max(n, 0)).tolist()
        text: str = self._tok.decode(ids)
        for _ in range(8):
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if len(ids) == n:
                break
            ids = ids[:n] + rng.integers(100, max(self._vocab, 101), size=max(n - len(ids), 0)).tolist()
            text = self._tok.decode(ids)
        return text


def load_counter(spec: str) -> TokenCounter:
    """``byte`` or a path to a Hugging Face tokenizer directory / ``tokenizer.json``."""
    if spec == "byte":
        return ByteCounter()
    return HFCounter(Path(spec))


def _lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_requests(n: int, *, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                    counter: TokenCounter | None = None) -> list[BenchRequest]:
    """``n`` prompts of random text, lengths uniform around ``input_len`` / ``output_len``."""
    counter = counter or ByteCounter()
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(input_len, range_ratio, n, rng), _lengths(output_len, range_ratio, n, rng)
    out = []
    for i, o in zip(ins, outs, strict=True):
        text = counter.random_text(i, rng)  # a tokenizer's decode-encode may not give i back: count it
        out.append(BenchRequest(({"role": "user", "content": text},), counter.count(text), o))
    return out


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Popularity of ``n`` items, the k-th in proportion to ``1 / k**s``."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    out: np.ndarray = w / w.sum()
    return out


def shared_prefix_requests(n: int, *, tenants: int, prefix_len: int, suffix_len: int, output_len: int,
                           zipf: float = 1.0, turns: int = 1, sessions: int = 8, seed: int = 0,
                           counter: TokenCounter | None = None) -> list[BenchRequest]:
    """``n`` requests of multi-turn sessions whose system prompts are shared per tenant."""
    counter = counter or ByteCounter()
    rng = np.random.default_rng(seed)
    prefixes = [counter.random_text(prefix_len, rng) for _ in range(tenants)]
    weights = zipf_weights(tenants, zipf)
    active: list[tuple[int, int, list[Message]]] = []  # (session id, tenant, history)
    next_session = 0
    out: list[BenchRequest] = []
    while len(out) < n:
        while len(active) < sessions:
            tenant = int(rng.choice(tenants, p=weights))
            active.append((next_session, tenant, [{"role": "system", "content": prefixes[tenant]}]))
            next_session += 1
        k = int(rng.integers(len(active)))
        sid, tenant, history = active[k]
        history.append({"role": "user", "content": counter.random_text(suffix_len, rng)})
        msgs = tuple(history)
        out.append(BenchRequest(msgs, sum(counter.count(m["content"]) for m in msgs), output_len, sid, tenant))
        if (len(history) + 1) // 2 >= turns:
            active.pop(k)
        else:  # the made-up reply the next turn carries
            history.append({"role": "assistant", "content": counter.random_text(output_len, rng)})
    return out


def sharegpt_requests(path: str | Path, n: int, *, seed: int = 0, output_len: int | None = None,
                      counter: TokenCounter | None = None, min_len: int = 4) -> list[BenchRequest]:
    """``n`` requests from a ShareGPT-format file (shuffled; repeated if it holds fewer)."""
    counter = counter or ByteCounter()
    convs = orjson.loads(Path(path).read_bytes())
    if not isinstance(convs, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pool: list[BenchRequest] = []
    for c in convs:
        turns: Sequence[dict[str, str]] = c.get("conversations") or c.get("conversation") or []
        if len(turns) < 2 or turns[0].get("from") not in ("human", "user"):
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        p_len, o_len = counter.count(prompt), output_len or counter.count(reply)
        if p_len < min_len or o_len < min_len:
            continue
        pool.append(BenchRequest(({"role": "user", "content": prompt},), p_len, o_len))
    if not pool:
        raise ValueError(f"{path}: no usable conversations (a human turn and a reply, each >= {min_len} tokens)")
    order = np.random.default_rng(seed).permutation(len(pool)).tolist()
    return [pool[order[i % len(pool)]] for i in range(n)]
