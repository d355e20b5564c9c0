"""--help formatting shared by run_trinity.py and the launcher."""

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Description and epilog as written (examples keep their lines); each flag's
    default appended, unless it has none (None, off) or its help already gives it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default == argparse.SUPPRESS
                or "default" in text):
            return text
        return f"{text} (default: %(default)s)"
