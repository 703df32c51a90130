"""onlinerl component."""
