"""Every command line of the project documents every flag on its own line of --help, with its default where
it has one (common/cli_help.py adds it where the text does not say it)."""
from __future__ import annotations

import argparse
import importlib

import pytest

CLIS = ["client.cli", "scheduler_svc.cli", "worker_svc.cli", "gateway.cli"]


def _parsers(parser: argparse.ArgumentParser, name: str):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


@pytest.mark.parametrize("module", CLIS)
def test_every_flag_has_help_and_its_default(module):
    for name, parser in _parsers(importlib.import_module(module).build_parser(), module):
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings or action.dest)
            if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
                line = parser._get_formatter()._format_action(action)
                assert "default" in line, (name, action.option_strings, line)
        assert "Traceback" not in text
