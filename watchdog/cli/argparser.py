"""argparse that reports bad arguments as one line (via UserError) instead of usage + exit."""

from __future__ import annotations

import argparse
from typing import NoReturn

from ..errors import UserError


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see 'rankwatch {self.prog.split()[-1]} --help')")
