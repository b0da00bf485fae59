"""What vramd.manage raises, and how its messages name a dtype and a list of names."""
from __future__ import annotations

import torch


class ManageError(ValueError):
    """The module and the leased model do not fit together, a unit cannot fit the limit, or a
    managed weight is asked for outside its unit (a move or cast of the managed module)."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _listed(names: list[str]) -> str:
    return ", ".join(map(repr, names[:8])) + (", ..." if len(names) > 8 else "")
