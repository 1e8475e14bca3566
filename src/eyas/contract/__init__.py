"""The contract stored with every dataset and drafter, and its checks."""

from eyas.contract.contract import (
    CHECKED_FIELDS,
    CaptureContract,
    Contract,
    ContractError,
    DrafterFlags,
    Mismatch,
    SlotFingerprint,
    TargetIdentity,
    Tokenisation,
    ValidationMetrics,
    compare,
    enforce,
    target_identity,
    tokenisation_of,
    weights_fingerprint,
)

__all__ = [
    "CHECKED_FIELDS", "CaptureContract", "Contract", "ContractError", "DrafterFlags", "Mismatch",
    "SlotFingerprint", "TargetIdentity", "Tokenisation", "ValidationMetrics", "compare", "enforce", "target_identity",
    "tokenisation_of", "weights_fingerprint",
]
