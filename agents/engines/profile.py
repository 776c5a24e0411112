"""Engine profiles: step-time tables an engine is modeled by, and their JSON format.

The ``sim`` engine reads a profile to know an instance's shape (blocks, block
size, batch limit, context, vocabulary, KV layout) and how long a step takes.
``shoal bench engine --profile-out FILE`` writes one from measurements of a
real engine, so simulated instances can stand in for measured ones.

File format (JSON, one object; unknown keys are an error)::

    {
      "format": "shoal.engine-profile/1",
      "name": "llama-7b-a10",              # what ``load_profile(name)`` finds
      "description": "...", "source": "...", "estimated": true,
      "model": {"model_id": "...", "revision": "", "dtype": "float16", "tensor_parallel": 1},
      "kv": {"num_layers": 32, "num_kv_heads": 32, "head_dim": 128, "dtype": "float16"},
      "num_blocks": 851, "block_size": 16,
      "max_batch_size": 256, "max_model_len": 13616,
      "vocab_size": 32000, "eos_token_id": 2,
      "bytes_per_block": null,             # null: 2 * layers * kv_heads * head_dim * block_size * dtype size
      "decode": {                          # one decode step, milliseconds
        "batch_sizes":    [1, 8, ...],     # ascending: sequences decoding in the step
        "context_tokens": [0, 2048, ...],  # ascending: sum of their sequence lengths (KV read)
        "ms": [[...], ...]                 # ms[i][j] at batch_sizes[i], context_tokens[j]
      },
      "prefill": {                         # prompt tokens computed in one step, milliseconds
        "tokens": [1, 128, ...],           # ascending
        "ms": [...]
      }
    }

Between grid points the time is interpolated linearly (bilinearly for decode);
outside the grid the edge segment is extended, and times never go below 0.
A step with both prefills and decodes takes the sum of the two times (the
prefill time of all prompt tokens of the step together). A table of one point
on an axis means "constant along that axis".

Nothing here runs a model or sleeps; :class:`TimingModel` is pure arithmetic.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import msgspec

from schemas import KVLayout, ModelIdentity

__all__ = [
    "BUILTIN_PROFILES",
    "PROFILES_DIR",
    "PROFILE_FORMAT",
    "DecodeTable",
    "EngineProfile",
    "InvalidProfile",
    "PrefillTable",
    "ProfileKV",
    "ProfileModel",
    "TimingModel",
    "attention_ms_per_token2",
    "dump_profile",
    "load_profile",
]

PROFILE_FORMAT = "shoal.engine-profile/1"
PROFILES_DIR = Path(__file__).with_name("profiles")
#: Profiles shipped with shoal, by name (files in ``agents/engines/profiles/``).
BUILTIN_PROFILES = ("llama-7b-a10", "llama-3.1-8b-h100", "llama-3.1-70b-tp4-h100", "tiny-test")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1, "int8": 1}


class InvalidProfile(ValueError):
    """A profile file that cannot be read or does not describe a usable engine."""


class _Struct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ProfileModel(_Struct, frozen=True):
    model_id: str
    revision: str = ""
    dtype: str = "float16"
    tensor_parallel: int = 1

    @classmethod
    def of(cls, identity: ModelIdentity) -> ProfileModel:
        """The profile's model fields of a measured engine's identity."""
        return cls(model_id=identity.model_id, revision=identity.revision, dtype=identity.dtype)


class ProfileKV(_Struct, frozen=True):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    @classmethod
    def of(cls, layout: KVLayout) -> ProfileKV:
        """The profile's KV fields of a measured engine's layout."""
        return cls(
            num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
            dtype=layout.dtype,
        )


class DecodeTable(_Struct, frozen=True):
    batch_sizes: tuple[int, ...]
    context_tokens: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]


class PrefillTable(_Struct, frozen=True):
    tokens: tuple[int, ...]
    ms: tuple[float, ...]


class EngineProfile(_Struct, frozen=True, kw_only=True):
    """One engine configuration and its measured (or estimated) step times."""

    format: str = PROFILE_FORMAT
    name: str
    description: str = ""
    source: str = ""
    estimated: bool = True
    model: ProfileModel
    kv: ProfileKV
    num_blocks: int
    block_size: int
    max_batch_size: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None = None
    bytes_per_block: int | None = None
    decode: DecodeTable
    prefill: PrefillTable

    @property
    def model_identity(self) -> ModelIdentity:
        m = self.model
        return ModelIdentity(
            model_id=m.model_id, revision=m.revision, dtype=m.dtype, tensor_parallel=m.tensor_parallel
        )

    @property
    def kv_layout(self) -> KVLayout:
        kv = self.kv
        return KVLayout(
            num_layers=kv.num_layers,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            block_size=self.block_size,
            dtype=kv.dtype,
        )

    @property
    def kv_bytes_per_block(self) -> int:
        if self.bytes_per_block is not None:
            return self.bytes_per_block
        kv = self.kv
        return 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * self.block_size * _DTYPE_BYTES[kv.dtype]

    def validate(self) -> EngineProfile:
        """Raise :class:`InvalidProfile` unless the profile is usable; returns it."""
        problems: list[str] = []
        if self.format != PROFILE_FORMAT:
            problems.append(f"format is {self.format!r}, expected {PROFILE_FORMAT!r}")
        for name in ("num_blocks", "block_size", "max_batch_size", "max_model_len", "vocab_size"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            problems.append(f"eos_token_id {self.eos_token_id} outside the vocabulary")
        if self.kv.dtype not in _DTYPE_BYTES and self.bytes_per_block is None:
            problems.append(f"unknown kv dtype {self.kv.dtype!r}; give bytes_per_block")
        d = self.decode
        problems += _axis_problems("decode.batch_sizes", d.batch_sizes)
        problems += _axis_problems("decode.context_tokens", d.context_tokens)
        if len(d.ms) != len(d.batch_sizes) or any(len(row) != len(d.context_tokens) for row in d.ms):
            problems.append("decode.ms must have one row per batch size and one column per context size")
        elif any(v < 0 for row in d.ms for v in row):
            problems.append("decode.ms has negative times")
        p = self.prefill
        problems += _axis_problems("prefill.tokens", p.tokens)
        if len(p.ms) != len(p.tokens):
            problems.append("prefill.ms must have one value per prefill.tokens entry")
        elif any(v < 0 for v in p.ms):
            problems.append("prefill.ms has negative times")
        if problems:
            raise InvalidProfile(f"profile {self.name!r}: " + "; ".join(problems))
        return self


def _axis_problems(name: str, axis: Sequence[int]) -> list[str]:
    if not axis:
        return [f"{name} is empty"]
    if any(b <= a for a, b in itertools.pairwise(axis)):
        return [f"{name} must be strictly ascending"]
    return []


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """Read a profile from a file path, or a built-in one by name (see :data:`BUILTIN_PROFILES`)."""
    path = Path(name_or_path)
    if not path.is_file():
        builtin = PROFILES_DIR / f"{name_or_path}.json"
        if not builtin.is_file():
            raise InvalidProfile(
                f"no profile file {str(name_or_path)!r} and no built-in profile of that name "
                f"(built-in: {', '.join(BUILTIN_PROFILES)})"
            )
        path = builtin
    try:
        profile = msgspec.json.decode(path.read_bytes(), type=EngineProfile)
    except msgspec.ValidationError as exc:
        raise InvalidProfile(f"{path}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidProfile(f"{path}: not JSON: {exc}") from exc
    return profile.validate()


def dump_profile(profile: EngineProfile, path: str | Path) -> None:
    """Write a profile as indented JSON (what ``shoal bench engine --profile-out`` calls)."""
    profile.validate()
    Path(path).write_text(_format_json(msgspec.to_builtins(profile), 0) + "\n")


def _format_json(value: object, indent: int) -> str:
    """Indented JSON with lists of numbers kept on one line, so tables read as tables."""
    pad = "  " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {_format_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(value, list | tuple) and any(isinstance(v, list | tuple | dict) for v in value):
        items = [pad + _format_json(v, indent + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
    return json.dumps(value)


def _segment(axis: Sequence[int], x: float) -> tuple[int, float]:
    """Index ``i`` of the segment [axis[i], axis[i+1]] used for ``x`` and the fraction along it."""
    i = bisect.bisect_right(axis, x) - 1
    i = min(max(i, 0), len(axis) - 2)
    lo, hi = axis[i], axis[i + 1]
    return i, (x - lo) / (hi - lo)


def attention_ms_per_token2(table: PrefillTable) -> float:
    """The quadratic coefficient ``c`` of ``prefill(n) ~ a + b*n + c*n^2`` fitted to a prefill table.

    The ``n^2`` part is a prompt's causal attention over itself. Least squares on the relative
    error (short and long prompts weigh alike), clamped at 0; 0 for tables of fewer than 3 points.
    """
    points = [(n, ms) for n, ms in zip(table.tokens, table.ms, strict=True) if ms > 0]
    if len(points) < 3:
        return 0.0
    # normal equations of sum(((a + b*n + c*n^2) / ms - 1)^2), scaled per column for conditioning
    scale = (1.0, float(max(n for n, _ in points)), float(max(n for n, _ in points)) ** 2)
    rows = [[1.0 / ms, n / scale[1] / ms, n * n / scale[2] / ms] for n, ms in points]
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    rhs = [sum(r[i] for r in rows) for i in range(3)]
    try:
        solution = _solve3(gram, rhs)
    except ZeroDivisionError:
        return 0.0
    return max(solution[2] / scale[2], 0.0)


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a 3x3 system."""
    m = [[*row, v] for row, v in zip(a, b, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x


class TimingModel:
    """Step times from a profile's tables. Pure arithmetic, a few microseconds per call.

    A step that prefills several prompts is charged the table's time for their total, minus the
    attention the total would have had *across* prompts: each prompt attends only to itself, so
    the quadratic part is ``c * sum(n_i^2)``, not ``c * (sum n_i)^2``
    (:func:`attention_ms_per_token2`).
    """

    __slots__ = ("_attention", "_batch", "_context", "_decode", "_prefill_ms", "_prefill_tokens")

    def __init__(self, profile: EngineProfile) -> None:
        self._batch = profile.decode.batch_sizes
        self._context = profile.decode.context_tokens
        self._decode = profile.decode.ms
        self._prefill_tokens = profile.prefill.tokens
        self._prefill_ms = profile.prefill.ms
        self._attention = attention_ms_per_token2(profile.prefill)

    @property
    def attention_ms_per_token2(self) -> float:
        """The fitted quadratic coefficient of the prefill table (ms per token squared)."""
        return self._attention

    def decode_ms(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        rows = self._decode
        if len(self._batch) == 1:
            return max(0.0, self._along_context(rows[0], context_tokens))
        i, f = _segment(self._batch, batch_size)
        lo = self._along_context(rows[i], context_tokens)
        hi = self._along_context(rows[i + 1], context_tokens)
        return max(0.0, lo + (hi - lo) * f)

    def _along_context(self, row: Sequence[float], context_tokens: int) -> float:
        if len(row) == 1:
            return row[0]
        j, g = _segment(self._context, context_tokens)
        return row[j] + (row[j + 1] - row[j]) * g

    def prefill_ms(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        ms = self._prefill_ms
        if len(ms) == 1:
            return ms[0]
        i, f = _segment(self._prefill_tokens, num_tokens)
        return max(0.0, ms[i] + (ms[i + 1] - ms[i]) * f)

    def prefill_batch_ms(self, lengths: Sequence[int]) -> float:
        """One step's prefill of several prompts (or chunks) of these lengths: one pass over their
        total, without attention across them."""
        total = sum(lengths)
        ms = self.prefill_ms(total)
        if len(lengths) > 1 and self._attention > 0:
            ms -= self._attention * (total * total - sum(n * n for n in lengths))
        return max(ms, 0.0)

    def step_s(
        self,
        num_decodes: int,
        decode_context_tokens: int,
        num_prefill_tokens: int,
        prefill_lengths: Sequence[int] | None = None,
    ) -> float:
        """Seconds for a step that decodes ``num_decodes`` sequences and prefills some tokens
        (``prefill_lengths``: the prompts or chunks they belong to; default one prompt)."""
        if prefill_lengths is None or len(prefill_lengths) <= 1:
            prefill = self.prefill_ms(num_prefill_tokens)
        else:
            prefill = self.prefill_batch_ms(prefill_lengths)
        return (self.decode_ms(num_decodes, decode_context_tokens) + prefill) / 1000.0
