"""The `jlora` command line."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jlora", description="Multi-LoRA inference for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="self-check the multi-LoRA ops on random data and print a table")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jlora.selfcheck import run_selfcheck

        return 0 if run_selfcheck() else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
