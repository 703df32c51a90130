"""Errors that the CLI shows as one line (the message says what to fix), never as a traceback."""

from __future__ import annotations

from onlinerl.auth import AuthConfigError
from onlinerl.config import ConfigError
from onlinerl.data.builder import DataFileError
from onlinerl.model import ModelError


class CommandError(RuntimeError):
    """A command cannot proceed; the message says why and what to do."""


UserError = (ConfigError, ModelError, AuthConfigError, CommandError, FileNotFoundError, DataFileError)
