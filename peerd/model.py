"""`peerd.model`, the name transformers users import; the model lives in peerd.sdk.model."""

from peerd.sdk.model import (
    AutoDistributedModelForCausalLM,
    DistributedModelForCausalLM,
    ModelMismatch,
    RemoteBlocks,
    UnsupportedGeneration,
)

__all__ = [
    "AutoDistributedModelForCausalLM",
    "DistributedModelForCausalLM",
    "ModelMismatch",
    "RemoteBlocks",
    "UnsupportedGeneration",
]
