"""One help format for every command line of the project: each flag's line ends with its default, unless its
help already says it (or there is none to say); and the argument types the command lines share."""
from __future__ import annotations

import argparse
import json
from typing import Any


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and "default" not in text and "%(default)" not in text
                and action.default not in (None, False, [], argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def use_everywhere(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Gives `parser` and its subcommands' parsers HelpFormatter; returns it."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                use_everywhere(sub)
    return parser


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (vLLM's --hf-overrides, --override-generation-config)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value
