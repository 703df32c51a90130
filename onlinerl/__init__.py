"""onlinerl: Kubernetes-native online reinforcement learning for code completion (shared library)."""

__version__ = "0.1.0"
