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
