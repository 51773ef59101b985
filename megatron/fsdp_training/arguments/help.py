"""``--help`` that shows every argument's meaning and default, for pretrain_gpt.py's parser.

A newcomer reads ``--help`` to learn that ``--use-megatron-fsdp`` alone is ZeRO-3
(``optim_grads_params``, as in Megatron-LM) and what each flag does; each concern module of this
package writes its flags' meanings, this module makes every default show. docs/arguments.md's
argument tables are generated from the same parser (tools/regenerate_docs.py), so the two say the same.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every default; a help text that already explains its default keeps its own words."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return (text + " (default: off)").strip()  # a flag is off unless given
        return super()._get_help_string(action).strip()


def show_every_default(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every argument a help text, so that ``--help`` shows its default.

    argparse prints no help line (and so no default) for an argument without one.
    """
    for action in parser._actions:
        if not action.help:
            action.help = "(default: off)" if isinstance(
                action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) else "(default: %(default)s)"
    return parser
