"""Capsule errors: every one names the host, the unit and the step it failed in."""

from __future__ import annotations


class CapsuleError(Exception):
    """A step on one unit failed. `host`, `unit` and `step` say where; `detail` says why."""

    def __init__(self, host: str, unit: str, step: str, detail: str) -> None:
        super().__init__(f"{host}: unit {unit}: {step}: {detail}")
        self.host = host
        self.unit = unit
        self.step = step
        self.detail = detail


class ImageDigestMismatch(CapsuleError):
    """The image reference, the pulled image or a loaded capsule is not the pinned digest."""


class CriuProbeFailed(CapsuleError):
    """`criu check` from the capsule image failed on this host: its kernel cannot restore."""


class CriuProbeRefused(CriuProbeFailed):
    """The probe ran and its verdict is no (`criu check` failed, or CRIU is older than the
    host's kernel needs): unlike a probe that could not run, waiting or retrying changes
    nothing."""


class EngineNotReady(CapsuleError):
    """The engine did not become healthy, or its process tree is not what the unit declares."""


class QuiesceFailed(CapsuleError):
    """The engine did not drain its in-flight requests."""


class GpuCheckpointFailed(CapsuleError):
    """cuda-checkpoint refused or failed; what this step had locked was put back."""


class DumpFailed(CapsuleError):
    """CRIU refused or failed the dump; the engine was returned to serving, no images remain."""


class CommitFailed(CapsuleError):
    """The capsule image or its tar could not be written; nothing half-written remains."""


class RestoreFailed(CapsuleError):
    """Loading the capsule, starting its container, CRIU restore or GPU restore failed."""


class ValidationFailed(CapsuleError):
    """The restored engine is not healthy or did not give the expected answer."""
