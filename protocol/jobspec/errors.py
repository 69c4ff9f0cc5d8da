"""How a bad job or config file is reported: :class:`SpecError`, whose message names the bad
key, and the two helpers every config file shares (the node's and the coordinator's too):
reading a TOML file, and one line per bad key of a validation error."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError


class SpecError(ValueError):
    """A job or config file that does not validate; the message names the bad key."""


def explain_validation(exc: ValidationError, what: str) -> SpecError:
    """One line per bad key: where it is and what is wrong ('unknown key' for typos)."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{what}: {where}: {msg}")
    return SpecError("\n".join(lines))


def read_toml(path: Path | None) -> dict[str, Any]:
    """The table in TOML file ``path`` ({} for None); SpecError if missing or malformed."""
    if path is None:
        return {}
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path} is not valid TOML: {exc}") from None
