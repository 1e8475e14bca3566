"""eyas: EAGLE-3 speculative decoding that trains, verifies and serves on the same hidden states."""

__version__ = "0.1.0"
