"""``flashattn-teach replay ARGV`` in this process, through the package's one command entry point."""

from __future__ import annotations

from flashattn_teach.cli import main as cli_main


def main(argv: list[str]) -> int:
    return cli_main(["replay", *argv])
