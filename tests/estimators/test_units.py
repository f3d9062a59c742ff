"""Tests for estimators._units: the one size parser, the one formatter and the count parser."""

from __future__ import annotations

import doctest

import pytest

from estimators import _units
from estimators._errors import ConfigError, MemplanError
from estimators._units import format_size, parse_count, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GB", 12 * 10**9),
        ("12GiB", 12 * 2**30),
        ("800MB", 800 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("123456", 123456),
        ("123456B", 123456),
        ("12 GB", 12 * 10**9),
        ("  12 gib ", 12 * 2**30),
        ("12gb", 12 * 10**9),
        ("12Gb", 12 * 10**9),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("4KB", 4000),
        ("4kB", 4000),
        ("4KiB", 4096),
        (".5GiB", 2**29),
        ("0", 0),
        ("0GB", 0),
        ("1e3", 1000),
        ("0.5B", 1),  # rounds to the nearest byte, half up
        ("0.4B", 0),
        ("1.0000000005GB", 1_000_000_001),
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    assert isinstance(parse_size(text), int)


def test_parse_size_passes_ints_and_whole_floats_through() -> None:
    assert parse_size(123456) == 123456
    assert parse_size(0) == 0
    assert parse_size(2.0**30) == 2**30


@pytest.mark.parametrize(
    "bad",
    ["-5GB", "", "   ", "12G", "twelve", "12XB", "nan", "inf", "-inf", "12 G B", "GB", "12gbit",
     "1e999999999GB", "5 GB 3", -1, float("nan"), float("inf"), 1.5, -2.0, True, None, [12]],
)
def test_parse_size_rejects_with_one_line(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, what="--vram")  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--vram: ")
    assert repr(bad) in message
    for form in ("12GB", "12GiB", "800MB", "512MiB", "123456"):
        assert form in message
    assert isinstance(info.value, MemplanError)
    assert isinstance(info.value, ValueError)


def test_parse_size_message_example_and_hints() -> None:
    with pytest.raises(ConfigError) as info:
        parse_size("12G", what="--vram")
    message = str(info.value)
    assert message.startswith("--vram: cannot read '12G' as a size")
    assert "12GB" in message and "12GiB" in message
    assert "10^9" in message and "2^30" in message
    with pytest.raises(ConfigError, match="negative"):
        parse_size("-5GB")
    with pytest.raises(ConfigError, match="unknown unit 'XB'"):
        parse_size("12XB")
    with pytest.raises(ConfigError, match="^size: "):
        parse_size("twelve")


@pytest.mark.parametrize(
    ("n", "binary", "expected"),
    [
        (0, False, "0 B"),
        (512, False, "512 B"),
        (999, False, "999 B"),
        (1000, False, "1.00 kB"),
        (1536, False, "1.54 kB"),
        (1536, True, "1.50 KiB"),
        (5_300_000_000, False, "5.30 GB"),
        (12 * 2**30, True, "12.0 GiB"),
        (12 * 2**30, False, "12.9 GB"),
        (80 * 10**9, False, "80.0 GB"),
        (141 * 10**9, False, "141 GB"),
        (999_999, False, "1.00 MB"),  # rounding carries into the next unit
        (99_960, False, "100 kB"),
        (-1_200_000_000, False, "-1.20 GB"),
        (-512, False, "-512 B"),
        (3 * 10**15, False, "3.00 PB"),
    ],
)
def test_format_size(n: int, binary: bool, expected: str) -> None:
    assert format_size(n, binary=binary) == expected


@pytest.mark.parametrize("n", [0, 1, 999, 1000, 123_456, 5_300_000_000, 85_899_345_920, 10**13])
@pytest.mark.parametrize("binary", [False, True])
def test_format_size_reads_back_within_three_figures(n: int, binary: bool) -> None:
    back = parse_size(format_size(n, binary=binary))
    assert abs(back - n) <= 0.005 * n + 0.5


@pytest.mark.parametrize(
    ("text", "expected"), [("8", 8), (" 16 ", 16), (4, 4), (8.0, 8), ("+2", 2)]
)
def test_parse_count_accepts(text: str | int, expected: int) -> None:
    assert parse_count(text, what="--batch-size") == expected


@pytest.mark.parametrize("bad", [0, "0", -1, "-3", "8.5", 8.5, "eight", "", True, None, "1e3"])
def test_parse_count_rejects_with_the_fix(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_count(bad, what="--batch-size")  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--batch-size must be a whole number ≥ 1, got ")


def test_parse_count_message_example_and_minimum() -> None:
    with pytest.raises(ConfigError, match=r"^--batch-size must be a whole number ≥ 1, got 0$"):
        parse_count(0, what="--batch-size")
    assert parse_count("0", what="--offset", minimum=0) == 0
    with pytest.raises(ConfigError, match=r"--gpus must be a whole number ≥ 2, got '1'"):
        parse_count("1", what="--gpus", minimum=2)


def test_docstring_examples_run() -> None:
    failures, tried = doctest.testmod(_units, raise_on_error=False)
    assert tried > 0
    assert failures == 0
