"""Typed access to the data plane (Redis): one module per key family, each with its reader and its writer.

No other code sends a Redis command; ``contract.FAMILIES`` says who may write and read each family, and the ACL users
(``acl``) are generated from it. See docs/architecture.md.
"""
