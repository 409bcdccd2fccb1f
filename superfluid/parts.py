"""superfluid ships three top-level packages: `superfluid`, `engines` and `kvpool`. The last two
have common names, so before anything uses them this checks that the ones Python found are ours:
another distribution's `engines` earlier on sys.path would otherwise fail far from the cause."""

from __future__ import annotations

import importlib

PARTS = ("kvpool", "engines")


class ForeignPart(ImportError):
    """A package superfluid needs was found, but it is another distribution's."""


def check() -> None:
    """ForeignPart naming the package and where it was found unless both parts are superfluid's."""
    for name in PARTS:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ForeignPart(f"superfluid needs its `{name}` package and Python could not import it ({exc}); "
                              "reinstall superfluid-llm") from None
        if getattr(module, "PART_OF", None) != "superfluid":
            raise ForeignPart(f"the `{name}` package Python found at {getattr(module, '__file__', '?')} is not "
                              f"superfluid's (another distribution installs a package named `{name}`); uninstall "
                              "that distribution or give superfluid its own virtual environment")
