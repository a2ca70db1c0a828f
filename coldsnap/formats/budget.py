"""A cache's size budget: a host's `data_dir` (inventory `cache_budget`) or the control node's
store (`<store>/config.yaml`, key `cache_budget`), with the two watermarks of a kubelet's
image gc: once usage passes `high_percent` of `size`, eviction removes until it is at most
`low_percent` of it (coldsnap.store.eviction decides what).

    cache_budget: {size: 200GiB, high_percent: 85, low_percent: 80}

`size` is bytes, as an integer or with a unit (`K`, `M`, `G`, `T`: powers of 1000; `KiB`,
`MiB`, `GiB`, `TiB`: powers of 1024; `B` optional).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from coldsnap.formats.fields import StrictModel, invalid

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?)B?\s*$")
_POWER = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string such as `20GiB`; raises the field's error."""
    if isinstance(value, bool):
        raise invalid("must be a size in bytes, e.g. 200GiB or 500000000")
    if isinstance(value, int):
        if value < 1:
            raise invalid("must be at least 1 byte")
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None:
        raise invalid("must be a size in bytes, e.g. 200GiB or 500000000")
    base = 1024 if m.group(3) else 1000
    size: int = int(m.group(1)) * base ** _POWER[m.group(2)]
    if size < 1:
        raise invalid("must be at least 1 byte")
    return size


class CacheBudget(StrictModel):
    size: Annotated[int, BeforeValidator(parse_size)]
    high_percent: int = Field(default=85, ge=1, le=100)
    low_percent: int = Field(default=80, ge=0, le=99)

    @model_validator(mode="after")
    def _low_below_high(self) -> CacheBudget:
        if self.low_percent >= self.high_percent:
            raise ValueError("low_percent must be below high_percent")
        return self

    @property
    def high_bytes(self) -> int:
        return self.size * self.high_percent // 100

    @property
    def low_bytes(self) -> int:
        return self.size * self.low_percent // 100

    def describe(self) -> str:
        return (f"budget {self.size} bytes: evict past {self.high_percent}% "
                f"({self.high_bytes} bytes) down to {self.low_percent}% ({self.low_bytes})")
