"""argparse value types: each accepted and each refused value, by hand."""
import argparse

import pytest

from elastor_ds.cli_types import nonnegative_float, positive_float, positive_int


@pytest.mark.parametrize("fn,text,want", [(positive_int, "3", 3), (positive_float, "1.5", 1.5),
                                          (positive_float, "1e-3", 0.001), (nonnegative_float, "0", 0.0),
                                          (nonnegative_float, "2.5", 2.5)])
def test_accepted(fn, text, want):
    assert fn(text) == want


@pytest.mark.parametrize("fn,text,msg", [(positive_int, "0", ">= 1"), (positive_int, "1.5", "not an integer"),
                                         (positive_float, "0", "> 0"), (positive_float, "-2", "> 0"),
                                         (positive_float, "nan", "finite"), (positive_float, "inf", "finite"),
                                         (positive_float, "abc", "not a number"),
                                         (nonnegative_float, "-1", ">= 0"), (nonnegative_float, "nan", "finite")])
def test_refused_with_the_value_named(fn, text, msg):
    with pytest.raises(argparse.ArgumentTypeError, match=msg) as ei:
        fn(text)
    assert text in str(ei.value)


@pytest.mark.parametrize("text", ["1_0", "\uff11\uff10", "\u0663", "1e", "0x10", "1.2.3", ""])
def test_a_float_flag_takes_ascii_decimal_numbers_only(text):
    """Review of the thirty-third session: ``float()`` takes ``1_0`` and fullwidth or Arabic-Indic
    digits, which the integer flags already refuse."""
    with pytest.raises(argparse.ArgumentTypeError, match="not a number"):
        positive_float(text)
    assert positive_float(" 2.5 ") == 2.5 and positive_float("5.") == 5.0 and positive_float(".5") == 0.5


def test_a_strict_json_file_refuses_a_number_beyond_a_float(tmp_path):
    """``read_json_file(strict=True)`` took ``1e999`` as inf (``NaN`` and ``Infinity`` it refused)."""
    from elastor_ds.errors import ConfigError
    from elastor_ds.user_json import read_json_file
    f = tmp_path / "c.json"
    f.write_text('{"x": 1e999}')
    with pytest.raises(ConfigError, match="out of a float's range"):
        read_json_file(str(f), "--cluster", 1 << 20, "a cluster file", "fix it")
    f.write_text('{"x": 1e300}')
    assert read_json_file(str(f), "--cluster", 1 << 20, "a cluster file", "fix it") == {"x": 1e300}


@pytest.mark.parametrize("ch", ["\u115f", "\u1160", "\u3164", "\uffa0"])
def test_the_hangul_fillers_count_as_hidden(ch):
    """Letters (category Lo) that print as nothing: a name holding one reads as another."""
    from elastor_ds.cli_types import has_control_chars
    assert has_control_chars(f"layer{ch}.weight")
    assert not has_control_chars("layer.\uac00weight")   # a Hangul syllable prints
