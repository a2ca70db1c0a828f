"""The engines ColdSnap knows: the names `launch.engine` takes in a request, and that the
receipt, the replay plan and the operation carry.

Public API: `EngineName`.
"""

from __future__ import annotations

from typing import Literal

EngineName = Literal["vllm", "sglang"]
