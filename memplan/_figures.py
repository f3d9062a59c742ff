"""matplotlib for memplan's pictures (the ``memplan[plots]`` extra): imported lazily with the
Agg backend (files only, no display), so that the rest of memplan neither needs it nor pays
for its import; figures saved to files or as base64 PNG."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from estimators import ConfigError

__all__ = ["require_matplotlib", "save_figure", "figure_png"]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a one-line error saying what to install."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'memplan[plots]' (or pip install matplotlib)") from None
    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    require_matplotlib().close(fig)
    return path


def figure_png(fig: Any) -> str:
    """The figure as base64 PNG (for an HTML page or an Optuna user attribute)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")
