"""The error hierarchy shared by both implementations.

Every message names the tensor or field, what was expected and what was found, so a user can fix
the input without reading our source.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError", "DSV4Error", "FoldError", "InputError"]


class DSV4Error(Exception):
    """Base class of every error raised on purpose by dsv4-mtp."""


class ConfigError(DSV4Error, ValueError):
    """A config field is missing, of the wrong type, or inconsistent with another field."""


class InputError(DSV4Error, ValueError):
    """A tensor argument has the wrong shape, dtype, device or values (e.g. token ids >= vocab)."""


class CheckpointError(DSV4Error):
    """A checkpoint directory is missing tensors, has unexpected ones, or holds bad values."""


class FoldError(DSV4Error, ValueError):
    """NVFP4 gate/up global scales cannot be folded into one fc1 alpha exactly."""
