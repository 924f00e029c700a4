"""DataError, in a module of its own so that data.formats (the readers) and data.cleaning
(check_drop_fraction) can both raise it without a cycle: data.formats imports data.cleaning.
data.formats re-exports it (`from data.formats import DataError` keeps working)."""
from __future__ import annotations

from glm_lora.configs.errors import UserError


class DataError(UserError, ValueError):
    """A bad row in a data file; the message names path, row and field."""
