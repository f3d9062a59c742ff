"""The ``memplan`` command line: ``main(argv) -> int`` (the console script), one module a part.

``_main``      the parser, the subcommands' registry, one line and exit code 2 for every error.
``_args``      the arguments the subcommands share, and what they parse into.
``_commands``  estimate, probe, plan, fit (which calls :func:`memplan.fit`) and train.
``_init``      ``memplan init``: a model file and a config file to start from.
``_doctor``    ``memplan doctor``'s arguments and output.
"""

from __future__ import annotations

from ._main import build_parser, main

__all__ = ["main", "build_parser"]
