"""Every `coldsnapd` command and subcommand answers --help, and its description reads as prose.

The descriptions and help texts are triple-quoted strings indented with the code: argparse's
default formatter reflows them. A parser that keeps its text as written
(RawDescriptionHelpFormatter) must be given text written flush-left, or the code's indentation
would leak into `--help`; this test catches either slip for every parser there is."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from coldsnap.cli import build_parser, main


def _paths(parser: argparse.ArgumentParser,
           path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    # argparse has no public way to list a parser's subparsers: its actions hold them.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _paths(sub, (*path, name))


PATHS = list(_paths(build_parser()))


def test_the_walk_finds_the_subcommands() -> None:
    assert {("capture",), ("restore",), ("store", "verify"), ("jobs", "cancel")} <= set(PATHS)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "coldsnapd")
def test_help_exits_0_and_its_description_is_reflowed(
    path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as info:
        main([*path, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: coldsnapd {' '.join(path)}".rstrip())
    # The description (none for some subcommands): after the usage block's blank line,
    # before the arguments.
    description = "\n" + out.split("\n\n", 1)[1]
    for heading in ("\npositional arguments:\n", "\noptions:\n"):
        description = description.split(heading, 1)[0]
    for line in description.splitlines():
        # A raw description indents an example by a few spaces at the most; the code's
        # indentation (8 or more) or a run of spaces inside a line means nothing reflowed it.
        assert not re.match(r" {4,}|.*\S {2,}", line), f"unreflowed: {line!r}"
