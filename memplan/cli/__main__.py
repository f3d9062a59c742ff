"""``python -m memplan.cli``: the ``memplan`` command."""

from ._main import main

raise SystemExit(main())
