"""One DataFrame cell's missing value, for code that reads rows one by one."""
from __future__ import annotations

from typing import Any


def is_na(value: Any) -> bool:
    """pd.isna of a scalar cell (None, NaN, pd.NA, NaT); False for a value it cannot judge
    (a list, an array)."""
    import pandas as pd

    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False
