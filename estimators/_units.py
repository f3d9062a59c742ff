"""Units at the edges: the one parser for memory sizes and counts, and the one formatter.

Every size a user types (``--vram 24GB``, ``budget="80GiB"``) goes through :func:`parse_size`;
every size memplan prints goes through :func:`format_size`. Inside memplan, bytes are plain
``int``.

Decimal units are powers of ten (``GB`` = 10⁹ bytes, as disk and cloud vendors count), binary
units are powers of two (``GiB`` = 2³⁰ bytes, as ``nvidia-smi`` and PyTorch count). Unit letters
are case-insensitive (``gb``, ``GB`` and ``Gb`` all mean 10⁹ bytes; memplan never deals in bits).
A bare ``G`` or ``M`` is rejected rather than guessed, because the two readings differ by 7%.

Known limitations: no bit units, no ``PB``/``PiB``; a fractional size is rounded to the nearest
byte (half rounds up).
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_UP, Decimal, DecimalException, localcontext

from ._errors import ConfigError

__all__ = ["parse_size", "format_size", "parse_count"]

#: Bytes per unit, keyed by the lower-cased unit as written after the number.
_UNIT_BYTES: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_ACCEPTED = (
    "use a number with a unit such as 12GB (10^9 bytes), 12GiB (2^30 bytes), 800MB, 512MiB "
    "or plain bytes like 123456 (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; any case)"
)

# A non-negative decimal number (optionally with an exponent), optional spaces, optional unit.
_SIZE_RE = re.compile(
    r"^(?P<sign>[+-]?)\s*(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)$"
)


def _size_error(text: object, what: str, reason: str = "") -> ConfigError:
    detail = f" ({reason})" if reason else ""
    return ConfigError(f"{what}: cannot read {text!r} as a size{detail}; {_ACCEPTED}")


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Read a memory size and return it in bytes.

    Args:
        text: ``"12GB"`` (12·10⁹), ``"12GiB"`` (12·2³⁰), ``"1.5 GB"``, ``"512MiB"``,
            ``"123456"`` or ``"123456B"``; letters in any case, spaces allowed. An ``int``
            (not ``bool``) passes through; an integral, finite ``float`` is accepted too.
        what: What the value is for, named at the start of the error message (e.g. ``"--vram"``).

    Returns:
        The size in bytes, rounded to the nearest byte; zero is allowed (callers decide).

    Raises:
        ConfigError: for anything else (negative, empty, ``"12G"``, ``"twelve"``, ``"12XB"``,
            NaN, infinity), with one line that names ``what``, the value and the accepted forms.

    Example:
        >>> parse_size("12GB"), parse_size("12GiB"), parse_size("1.5 gb")
        (12000000000, 12884901888, 1500000000)
        >>> parse_size(123456)
        123456
    """
    if isinstance(text, bool):
        raise _size_error(text, what, "a bool is not a size")
    if isinstance(text, int):
        if text < 0:
            raise _size_error(text, what, "sizes cannot be negative")
        return text
    if isinstance(text, float):
        if not math.isfinite(text) or not text.is_integer():
            raise _size_error(text, what, "not a whole number of bytes")
        if text < 0:
            raise _size_error(text, what, "sizes cannot be negative")
        return int(text)
    if not isinstance(text, str):
        raise _size_error(text, what, f"expected text or an int, got {type(text).__name__}")

    match = _SIZE_RE.match(text.strip())
    if match is None:
        raise _size_error(text, what)
    unit = match["unit"].lower()
    if unit not in _UNIT_BYTES:
        hint = ""
        if unit in {"k", "m", "g", "t"}:
            number = match["number"]
            hint = f"did you mean {number}{unit.upper()}B or {number}{unit.upper()}iB?"
        elif unit in {"kbit", "mbit", "gbit", "bit", "bits"}:
            hint = "bits are not accepted"
        raise _size_error(text, what, hint or f"unknown unit {match['unit']!r}")
    if match["sign"] == "-":
        raise _size_error(text, what, "sizes cannot be negative")
    try:
        with localcontext() as ctx:
            ctx.prec = 64  # exact for any size below 10^64 bytes
            exact = Decimal(match["number"]) * _UNIT_BYTES[unit]
            return int(exact.quantize(Decimal(1), rounding=ROUND_HALF_UP))
    except DecimalException as exc:  # e.g. 1e999999999GB
        raise _size_error(text, what, "number out of range") from exc


_DECIMAL_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_size(n: int, *, binary: bool = False) -> str:
    """Format a byte count for people, with three significant figures.

    Args:
        n: Bytes (negative values get a minus sign, e.g. for "needs 1.20 GB more").
        binary: Use KiB/MiB/GiB (powers of two, like ``nvidia-smi``) instead of kB/MB/GB.

    Returns:
        ``"512 B"``, ``"5.30 GB"``, ``"12.0 GiB"``, ``"-1.20 GB"``; whole bytes below one kB.
        Each non-negative result reads back through :func:`parse_size` (to three figures).

    Example:
        >>> format_size(5_300_000_000), format_size(512), format_size(12 * 2**30, binary=True)
        ('5.30 GB', '512 B', '12.0 GiB')
    """
    if n < 0:
        return "-" + format_size(-n, binary=binary)
    base = 1024 if binary else 1000
    units = _BINARY_UNITS if binary else _DECIMAL_UNITS
    if n < base:
        return f"{round(n)} B"
    value = float(n)
    for index, unit in enumerate(units):  # noqa: B007 - the unit the loop stops at is used below
        scaled = value / base**index
        rounded = float(f"{scaled:.3g}")
        if rounded < base or index == len(units) - 1:
            break
    if rounded >= 100:
        return f"{rounded:.0f} {unit}"
    if rounded >= 10:
        return f"{rounded:.1f} {unit}"
    return f"{rounded:.2f} {unit}"


def parse_count(text: str | int, *, what: str = "count", minimum: int = 1) -> int:
    """Read a whole-number count such as a batch size or a number of GPUs.

    Args:
        text: An ``int`` (not ``bool``) or digits such as ``"8"`` (surrounding spaces allowed).
        what: The name shown in the error, e.g. ``"--batch-size"``.
        minimum: The smallest accepted value.

    Returns:
        The count.

    Raises:
        ConfigError: for zero or negatives below ``minimum``, fractions, and text that is not a
            whole number, with one line such as
            ``--batch-size must be a whole number ≥ 1, got 0``.

    Example:
        >>> parse_count("8", what="--batch-size")
        8
    """
    shown = repr(text) if isinstance(text, str) else str(text)
    error = ConfigError(f"{what} must be a whole number ≥ {minimum}, got {shown}")
    if isinstance(text, bool):
        raise error
    if isinstance(text, int):
        value = text
    elif isinstance(text, float):
        if not math.isfinite(text) or not text.is_integer():
            raise error
        value = int(text)
    elif isinstance(text, str) and re.fullmatch(r"\s*[+-]?\d+\s*", text):
        value = int(text)
    else:
        raise error
    if value < minimum:
        raise error
    return value
