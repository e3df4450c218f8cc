"""Every exception batchgen raises on purpose lives here.

Errors that belong to one request (a bad prompt, a bad sampling value) never raise out of a
batch: they become that request's ``finish_reason="error"`` with a message. These types are for
what must stop the caller: a model that cannot be loaded, a config we do not support.
"""
from __future__ import annotations


class BatchgenError(Exception):
    """Base class of batchgen's own errors."""


class ModelLoadError(BatchgenError):
    """The model directory is missing, incomplete or unreadable."""


class UnsupportedModelError(BatchgenError):
    """The checkpoint's architecture or one of its config options is not implemented."""


class RequestError(BatchgenError, ValueError):
    """One request is invalid; the message names the field and the value."""


class StateError(BatchgenError):
    """A suspended coroutine state cannot be resumed here (wrong model, corrupt bytes)."""


class PlanError(BatchgenError, ValueError):
    """A simulation or plan cannot run: unknown profile, unreadable lengths file, bad option."""
