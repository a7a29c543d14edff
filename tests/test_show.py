"""expect_error: the error is printed and the cell goes on; no error is itself an error."""

import pytest

from amp_lessons.precision import parse_precision
from amp_lessons.show import expect_error


def test_the_expected_error_is_printed_as_a_tracebacks_last_line(capsys):
    with expect_error(ValueError):
        parse_precision("fp61")
    assert capsys.readouterr().out == "ValueError: precision must be one of fp32, tf32, bf16, fp16; got 'fp61'\n"


def test_code_after_the_block_runs(capsys):
    ran = []
    with expect_error(RuntimeError, KeyError):
        raise KeyError("k")
    ran.append(True)
    assert ran == [True] and capsys.readouterr().out == "KeyError: 'k'\n"


def test_a_block_that_raises_nothing_is_an_error():
    with pytest.raises(AssertionError, match="expected ValueError, but the block ran without raising it"):
        with expect_error(ValueError):
            parse_precision("fp16")


def test_another_kind_of_error_goes_through():
    with pytest.raises(TypeError):
        with expect_error(ValueError):
            raise TypeError("not the one the lesson shows")


def test_any_exception_by_default(capsys):
    with expect_error():
        {}["missing"]
    assert capsys.readouterr().out == "KeyError: 'missing'\n"
