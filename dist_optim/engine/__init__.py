"""The engine: hooks, buckets, the learning backward, settling, stepping an inner optimizer, what it may do.

The lowest layer. It knows one process's tensors and hooks and nothing about wrappers, the optimizer facade or the
planner: it may import torch and ``dist_optim._torch_internals`` only (and its own modules). Whatever it needs from
above (how a wrapper reduces, what the facade counts) is handed to it as data or a callback.
"""

__all__: list[str] = []
