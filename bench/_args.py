"""argparse value types the bench scripts share, beside the package's own (:mod:`elastor_ds.cli_types`:
``positive_int``, ``nonnegative_int``, ``nonnegative_float``, ...): paths checked before a run starts
and comma-separated lists. Not a benchmark.

A bad value becomes argparse's usage error (exit 2) naming the flag and what it accepts. The scripts
parse their arguments before they import torch or start a process, so a bad flag costs no minute of
setup, leaves nothing behind and overwrites no result file."""
from __future__ import annotations

import argparse
import os
from typing import Callable, TypeVar

T = TypeVar("T")


def writable_dir(text: str) -> str:
    """An existing directory this user may create files in."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


def dir_to_make(text: str) -> str:
    """A directory that exists and is writable, or that the script may create: its nearest existing
    parent is a writable directory."""
    if os.path.isdir(text):
        return writable_dir(text)
    if os.path.lexists(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    parent = _nearest_existing(text)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {parent!r} is not writable")
    return text


def output_file(text: str) -> str:
    """A file the script may write its results to at the end of the run (checked first, so that a
    long run does not end in a write error): not a directory, writable if it exists, else in a
    directory that exists or can be created."""
    if not text or text.endswith(os.sep) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if os.path.exists(text):
        if not os.access(text, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} is not writable")
        return text
    parent = _nearest_existing(os.path.dirname(os.path.abspath(text)))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {parent!r} is not writable")
    return text


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        p = os.path.dirname(p)
    return p


def csv_choices(*choices: str) -> Callable[[str], list[str]]:
    """A comma-separated, non-empty list of names out of ``choices`` (a misspelled name is refused,
    not silently skipped); repeats dropped, order kept."""
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in choices]
        if bad or not names:
            what = f"unknown {', '.join(map(repr, bad))}" if bad else f"{text!r} names none"
            raise argparse.ArgumentTypeError(f"{what}: give a comma-separated subset of {', '.join(choices)}")
        return list(dict.fromkeys(names))
    parse.__name__ = "list"
    return parse


def csv_of(item: Callable[[str], T], *, allow_empty: bool = False) -> Callable[[str], list[T]]:
    """A comma-separated list of values, each parsed by ``item`` (e.g. ``positive_int``)."""
    def parse(text: str) -> list[T]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts and not allow_empty:
            raise argparse.ArgumentTypeError(f"{text!r} names none: give a comma-separated list, e.g. 8,7")
        out = []
        for x in parts:
            try:
                out.append(item(x))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"in {text!r}: {e}") from None
        return out
    parse.__name__ = "list"
    return parse
