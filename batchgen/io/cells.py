"""DataFrame and file cells as plain Python: the one conversion every row reader uses."""
from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping
from typing import Any


def is_na(value: Any) -> bool:
    """pd.isna of a scalar cell (None, NaN, pd.NA, NaT); False for a value it cannot judge
    (a list, an array)."""
    import pandas as pd

    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def plain(value: Any) -> Any:
    """numpy / pyarrow / pandas scalars and arrays -> Python; NA -> None."""
    if value is None or (not hasattr(value, "__len__") and is_na(value)):  # a list or array is no NA
        return None
    if hasattr(value, "as_py"):  # pyarrow scalar
        value = value.as_py()
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy scalar -> Python scalar, ndarray -> list
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        value = [v.item() if hasattr(v, "item") and not isinstance(v, (str, bytes)) else v for v in value]
    return value


def whole_floats_to_int(fields: Mapping[str, Any], int_fields: Collection[str],
                        int_list_fields: Collection[str] = ()) -> dict[str, Any]:
    """An integral float in an integer field becomes an int (``max_tokens: 3.0`` -> 3), as the
    OpenAI server's lax parsing takes it; a pandas integer column with nulls holds floats, and
    reaches Parquet as floats too. Anything else (3.5, true, "3") is left as it is, for the
    field's check to reject naming the field and the value."""
    out = dict(fields)
    for name, value in fields.items():
        if name in int_fields:
            out[name] = _as_int(value)
        elif name in int_list_fields and isinstance(value, (list, tuple)):
            out[name] = [_as_int(v) for v in value]
    return out


def _as_int(value: Any) -> Any:
    # bool is Integral, so it is never touched; inf and NaN are not integral.
    if (isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
            and float(value).is_integer()):
        return int(value)
    return value
